"""Which database the stores run on in a test: SQLite files (the default) or PostgreSQL.

`pytest --database postgresql` (or CACHEPROXY_TEST_DATABASE=postgresql) starts one throwaway
PostgreSQL server for the session (`cacheproxy.provision.postgres`) and gives every test marked
`database` a fresh database of its own: the `database_url` fixture names it, and it is set as
CACHEPROXY_DATABASE_URL for the test, so every proxy the test starts (in this process or as a
`cacheproxy serve` child) and every `load_settings()` keeps its registry, archive index and
ledger there. With SQLite, `database_url` is None and the stores use their files as always.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cacheproxy.db.connection import DatabaseTarget, connect, is_database_url
from cacheproxy.provision.postgres import PostgresServer

BACKENDS = ("sqlite", "postgresql")
ENV_BACKEND = "CACHEPROXY_TEST_DATABASE"
ENV_DATABASE_URL = "CACHEPROXY_DATABASE_URL"  # the `database_url` setting


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(
        "--database",
        choices=BACKENDS,
        default=os.environ.get(ENV_BACKEND, "sqlite"),
        help="where the tests marked `database` keep the registry, archive index and ledger",
    )


def backend(config: pytest.Config) -> str:
    return str(config.getoption("--database"))


def target(database_url: str | None, file: Path) -> DatabaseTarget:
    """The database a store of the test opens: the test's PostgreSQL database, or `file`."""
    return database_url or file


def chosen(file: Path) -> DatabaseTarget:
    """The database a store opens in a test: the test's PostgreSQL database when it runs on
    one (CACHEPROXY_DATABASE_URL is set for it, as proxies read it), else `file`."""
    return os.environ.get(ENV_DATABASE_URL) or file


def query(where: DatabaseTarget, sql: str, params: tuple[object, ...] = ()) -> list[tuple]:
    """Rows of one statement, through a connection of its own (as another process reads)."""
    db = connect(where, busy_timeout_s=5.0, lock_name="test", wal=False)
    try:
        return [tuple(row) for row in db.execute(sql, params).fetchall()]
    finally:
        db.close()


def run(where: DatabaseTarget, script: str) -> None:
    """Statements that return no rows (separated by `;`), through a connection of their own."""
    db = connect(where, busy_timeout_s=5.0, lock_name="test", wal=False)
    try:
        db.executescript(script)
    finally:
        db.close()


def uses_postgresql(where: DatabaseTarget) -> bool:
    return is_database_url(where)


__all__ = [
    "DatabaseTarget",
    "PostgresServer",
    "add_option",
    "backend",
    "chosen",
    "query",
    "run",
    "target",
    "uses_postgresql",
]
