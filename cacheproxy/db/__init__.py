"""Database access shared by the registry, the archive index and the usage ledger: a SQLite file
or a PostgreSQL database (`database_url`), one connection type, one migrations runner."""
