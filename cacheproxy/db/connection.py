"""One connection to a SQLite file or a PostgreSQL database, with the same SQL and transactions.

Stores write their SQL once, with `?` placeholders (turned into psycopg's `%s` for PostgreSQL),
and open transactions only through `read()` and `write()`:

- `write()` serialises writers of one store, as SQLite's `BEGIN IMMEDIATE` does for a file:
  on PostgreSQL a transaction-scoped advisory lock named after the store (and the schema) is
  taken first, so a transaction that counts rows and then writes (quota checks, migrations)
  cannot be raced by another process between its read and its write. Waiting for it is bounded
  by the busy timeout (`lock_timeout`), as SQLite's busy timeout bounds waiting for the file.
- `read()` gives several SELECTs one snapshot (PostgreSQL: REPEATABLE READ, read only).

Blocking, like sqlite3: the proxy calls it from worker threads. Not thread-safe by itself: each
store guards its connection with its own lock, as before.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

from cacheproxy.sqlite_wal import enable_wal

POSTGRES_SCHEMES = ("postgresql", "postgres")

# What any database call may raise, whichever the backend: callers that keep running through a
# database fault (the disk tier, the supervisor) catch these.
DATABASE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, psycopg.Error)

# A SQLite file path, or a `postgresql://user@host:port/db` URL.
DatabaseTarget = Path | str


class Dialect(StrEnum):
    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"


def is_database_url(target: DatabaseTarget) -> bool:
    return isinstance(target, str) and urlsplit(target).scheme in POSTGRES_SCHEMES


def shown_target(target: DatabaseTarget) -> str:
    """The target for a message or a log: a URL without its password."""
    if not is_database_url(target):
        return str(target)
    parts = urlsplit(str(target))
    if parts.password is None:
        return str(target)
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def is_lock_timeout(exc: BaseException) -> bool:
    """Whether `exc` is another writer holding the database past the busy timeout (a retry may
    succeed), as opposed to a database that cannot be used."""
    if isinstance(exc, sqlite3.OperationalError):
        return "locked" in str(exc)
    return isinstance(exc, psycopg.errors.LockNotAvailable | psycopg.errors.QueryCanceled)


class Database:
    """A connection with its dialect. Open it with `connect`."""

    def __init__(
        self,
        dialect: Dialect,
        connection: sqlite3.Connection | psycopg.Connection,
        shown: str,
        lock_name: str,
        reconnect: Callable[[], psycopg.Connection] | None = None,
    ) -> None:
        self.dialect = dialect
        self.shown = shown  # for messages: the file, or the URL without a password
        self._connection = connection
        self._reconnect = reconnect
        self._lock_name = lock_name
        self._in_transaction = False

    @property
    def is_postgresql(self) -> bool:
        return self.dialect is Dialect.POSTGRESQL

    def close(self) -> None:
        self._reconnect = None  # closed on purpose: stays closed
        self._connection.close()

    # -- statements --------------------------------------------------------------------------

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; the cursor answers fetchone/fetchall/rowcount/description and
        iterates over rows (tuples) on both backends."""
        if self.is_postgresql:
            self._reopen_if_lost()
            return self._connection.execute(_psycopg_sql(sql), tuple(params))
        return self._connection.execute(sql, tuple(params))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = [tuple(row) for row in rows]
        if not rows:
            return
        if self.is_postgresql:
            self._reopen_if_lost()
            with self._connection.cursor() as cursor:
                cursor.executemany(_psycopg_sql(sql), rows)
        else:
            self._connection.executemany(sql, rows)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Every row of a SELECT as a dict by column name."""
        cursor = self.execute(sql, params)
        columns = [column[0] for column in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]

    def executescript(self, script: str) -> None:
        """Several statements separated by `;`, each run in the current transaction (unlike
        sqlite3's executescript, which commits first)."""
        for statement in split_statements(script):
            self.execute(statement)

    # -- transactions ------------------------------------------------------------------------

    @contextmanager
    def write(self, lock_name: str | None = None) -> Iterator[None]:
        """A transaction that holds this store's write lock (or the one named) from its start:
        committed whole, or rolled back on any exception."""
        with self._transaction("BEGIN IMMEDIATE" if not self.is_postgresql else "BEGIN"):
            if self.is_postgresql:
                self.execute(
                    "SELECT pg_advisory_xact_lock(hashtext(current_schema() || ':' || ?))",
                    [lock_name or self._lock_name],
                )
            yield

    @contextmanager
    def read(self) -> Iterator[None]:
        """Several reads seeing one snapshot."""
        begin = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if self.is_postgresql else "BEGIN"
        with self._transaction(begin):
            yield

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[None]:
        self.execute(begin)
        self._in_transaction = True
        try:
            yield
        except BaseException:
            self._in_transaction = False
            self._rollback()
            raise
        self._in_transaction = False
        self.execute("COMMIT")

    def _reopen_if_lost(self) -> None:
        # A server restart or a dropped connection breaks it: the call that found out failed
        # with the driver's error; the next one, if it starts a transaction or runs alone,
        # connects again (never inside a transaction, which must fail whole).
        if not self._in_transaction and self._reconnect and not _usable(self._connection):
            self._connection.close()
            self._connection = self._reconnect()

    def _rollback(self) -> None:
        if not self.is_postgresql:
            if self._connection.in_transaction:
                self._connection.execute("ROLLBACK")
        elif _usable(self._connection):
            self._connection.execute("ROLLBACK")
        else:
            # nothing to roll back on it (the server ends the transaction of a connection that
            # is gone), and the caller sees the first error, not ROLLBACK's
            self._connection.close()


# What a usable PostgreSQL connection's transaction status is between statements (libpq's
# PQtransactionStatus): idle, or in a transaction (good or failed; a COMMIT or ROLLBACK follows)
_USABLE_STATES = (
    psycopg.pq.TransactionStatus.IDLE,
    psycopg.pq.TransactionStatus.INTRANS,
    psycopg.pq.TransactionStatus.INERROR,
)


def _usable(connection: psycopg.Connection) -> bool:
    """Whether a PostgreSQL connection can take a statement: open, and not busy with one still.
    A connection killed under a statement can fail that statement and stay busy with it without
    being marked closed; every later statement on it would fail."""
    return not connection.closed and connection.info.transaction_status in _USABLE_STATES


def connect(
    target: DatabaseTarget,
    *,
    busy_timeout_s: float,
    lock_name: str,
    wal: bool = True,
) -> Database:
    """Open `target`: a `postgresql://` URL, or a SQLite file (created if missing; WAL mode).

    `lock_name` names the store's write lock on PostgreSQL (stores sharing one database do not
    wait for each other's writes). Raises what the driver raises (see `DATABASE_ERRORS`).
    """
    if is_database_url(target):

        def open_postgresql() -> psycopg.Connection:
            connection = psycopg.connect(str(target), autocommit=True)
            try:
                # every lock wait (the write lock, a row lock) is bounded as SQLite's busy timeout
                connection.execute(f"SET lock_timeout = {int(busy_timeout_s * 1000)}")
            except BaseException:
                connection.close()
                raise
            return connection

        return Database(
            Dialect.POSTGRESQL,
            open_postgresql(),
            shown_target(target),
            lock_name,
            reconnect=open_postgresql,
        )
    # isolation_level=None: no implicit transactions; every one is opened by read() or write()
    connection = sqlite3.connect(
        target, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
    )
    try:
        if wal:
            enable_wal(connection, busy_timeout_s)
    except BaseException:
        connection.close()
        raise
    return Database(Dialect.SQLITE, connection, str(target), lock_name)


def split_statements(script: str) -> list[str]:
    """`script` cut at each `;` outside quotes and `--` comments, without empty statements."""
    statements, current, quote, comment = [], [], "", False
    for index, char in enumerate(script):
        if comment:
            current.append(char)
            comment = char != "\n"
            continue
        if quote:
            current.append(char)
            if char == quote:
                quote = ""
            continue
        if char in "'\"":
            quote = char
        elif char == "-" and script[index : index + 2] == "--":
            comment = True
        elif char == ";" and not _inside_trigger_body("".join(current)):
            statements.append("".join(current))
            current = []
            continue
        current.append(char)
    statements.append("".join(current))
    return [text.strip() for text in statements if _has_code(text)]


_TRIGGER_START = re.compile(r"(\s*--[^\n]*\n)*\s*CREATE\s+(TEMP\w*\s+)?TRIGGER\b", re.IGNORECASE)
_ENDED = re.compile(r"\bEND\s*$", re.IGNORECASE)


def _inside_trigger_body(statement: str) -> bool:
    """A SQLite trigger's statements end in `;` inside its BEGIN ... END: the statement is the
    whole trigger, up to the `;` after END."""
    return bool(_TRIGGER_START.match(statement)) and not _ENDED.search(statement)


def _has_code(statement: str) -> bool:
    return any(
        line.strip() and not line.strip().startswith("--") for line in statement.splitlines()
    )


def _psycopg_sql(sql: str) -> str:
    # psycopg's placeholder is %s; a literal % must be doubled
    return sql.replace("%", "%%").replace("?", "%s")
