"""Schema migrations declared once for SQLite and PostgreSQL: one ordered list per store.

A store declares its steps in order on a `Migrations` set:

    MIGRATIONS = Migrations("cacheproxy.leases")
    MIGRATIONS.add("m001_leases", '''
        CREATE TABLE leases (upstream TEXT PRIMARY KEY, holder TEXT NOT NULL,
                             expires {float} NOT NULL)
    ''')

`sql` is portable DDL in which `{int}`, `{float}`, `{blob}` and `{strict}` stand for the
dialect's 64-bit integer, double, byte string and SQLite's STRICT table option (nothing on
PostgreSQL), so a column has the same range on both (PostgreSQL's REAL is 4 bytes, its
INTEGER 32 bits). A step whose DDL differs more is given as `sqlite=` and `postgresql=` texts
(or callables of the `Database`, for DDL built in code); either way it is one step of one
sequence, recorded under one name.

Applied steps are recorded in one version table per database, one row per (set, step name):
on SQLite it is `_sqlite_migrations`, the table sqlite-utils' Migrations kept, so files made
before this module upgrade from where they are; on PostgreSQL `schema_migrations`, the same
columns. Steps are append-only: a released step is never edited, only followed by another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cacheproxy.db.connection import Database, DatabaseTarget, Dialect, connect, is_database_url

VERSION_TABLE = {Dialect.SQLITE: "_sqlite_migrations", Dialect.POSTGRESQL: "schema_migrations"}

# What `{int}`, `{float}`, `{blob}`, `{strict}` become in a portable step
TYPES: dict[Dialect, dict[str, str]] = {
    Dialect.SQLITE: {"int": "INTEGER", "float": "REAL", "blob": "BLOB", "strict": "STRICT"},
    Dialect.POSTGRESQL: {
        "int": "BIGINT",
        "float": "DOUBLE PRECISION",
        "blob": "BYTEA",
        "strict": "",
    },
}

MIGRATIONS_LOCK = "schema migrations"

StepSql = str | Callable[[Database], str]


@dataclass(frozen=True)
class Step:
    name: str
    sqlite: StepSql
    postgresql: StepSql

    def script(self, db: Database) -> str:
        text = self.postgresql if db.is_postgresql else self.sqlite
        return text(db) if callable(text) else text


class Migrations:
    """The ordered steps of one store's schema."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps: list[Step] = []

    def add(
        self,
        name: str,
        sql: str | None = None,
        *,
        sqlite: StepSql | None = None,
        postgresql: StepSql | None = None,
    ) -> None:
        """Append a step: portable `sql`, or one text (or callable) per dialect."""
        if any(step.name == name for step in self.steps):
            raise ValueError(f"migration {name!r} is already in set {self.name!r}")
        if sql is not None:
            if sqlite is not None or postgresql is not None:
                raise ValueError("give either portable sql or per-dialect texts, not both")
            sqlite = sql.format(**TYPES[Dialect.SQLITE])
            postgresql = sql.format(**TYPES[Dialect.POSTGRESQL])
        if sqlite is None or postgresql is None:
            raise ValueError(f"migration {name!r} needs DDL for both SQLite and PostgreSQL")
        self.steps.append(Step(name, sqlite, postgresql))

    def applied(self, db: Database) -> list[str]:
        """Names of the applied steps, in the order they were applied."""
        table = VERSION_TABLE[db.dialect]
        if not _table_exists(db, table):
            return []
        rows = db.execute(
            f"SELECT name FROM {table} WHERE migration_set = ? ORDER BY id", [self.name]
        ).fetchall()
        return [name for (name,) in rows]

    def pending(self, db: Database) -> list[Step]:
        done = set(self.applied(db))
        return [step for step in self.steps if step.name not in done]

    def migrate(self, db: Database) -> list[str]:
        """Apply the pending steps, all in one write transaction (so two processes opening a
        new database at once migrate it once, and a failed upgrade changes nothing). Returns
        the names applied."""
        if not self.pending(db):
            return []
        # one lock for every store's migrations: stores sharing a new PostgreSQL database
        # create the version table once
        with db.write(MIGRATIONS_LOCK):
            _ensure_version_table(db)
            pending = self.pending(db)  # again, under the write lock
            for step in pending:
                db.executescript(step.script(db))
                db.execute(
                    f"INSERT INTO {VERSION_TABLE[db.dialect]} (migration_set, name, applied_at)"
                    " VALUES (?, ?, ?)",
                    [self.name, step.name, str(datetime.now(UTC))],
                )
        return [step.name for step in pending]


def connect_migrated(
    target: DatabaseTarget, migrations: Migrations, *, busy_timeout_s: float, lock_name: str
) -> Database:
    """`connect` to `target` (a SQLite file's folder made first, private) with `migrations`
    applied; closed again if they fail."""
    if not is_database_url(target):
        Path(target).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    db = connect(target, busy_timeout_s=busy_timeout_s, lock_name=lock_name)
    try:
        migrations.migrate(db)
    except BaseException:
        db.close()
        raise
    return db


def _table_exists(db: Database, table: str) -> bool:
    if db.is_postgresql:
        found = db.execute("SELECT to_regclass(?) IS NOT NULL", [table]).fetchone()[0]
        return bool(found)
    found = db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [table]
    ).fetchone()
    return found is not None


def _ensure_version_table(db: Database) -> None:
    # the columns sqlite-utils' Migrations gave it: a file it migrated is read as it is
    table = VERSION_TABLE[db.dialect]
    key = "BIGINT GENERATED BY DEFAULT AS IDENTITY" if db.is_postgresql else "INTEGER"
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {table} (id {key} PRIMARY KEY, migration_set TEXT,"
        " name TEXT, applied_at TEXT)"
    )
    db.execute(
        f"CREATE UNIQUE INDEX IF NOT EXISTS idx_{table}_migration_set_name"
        f" ON {table} (migration_set, name)"
    )
