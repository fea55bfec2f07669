"""A store's PostgreSQL connection lost under it (the server restarted, the connection killed):
the call that finds out fails with the driver's error, the next one connects again. Always on
a real PostgreSQL server, whatever `--database` says: SQLite has no connection to lose."""

from __future__ import annotations

import pytest

from cacheproxy.db.connection import DATABASE_ERRORS, connect
from cacheproxy.provision.postgres import PostgresServer
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support import databases


def test_a_killed_connection_is_opened_again_by_the_next_call(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.new_database()
    with TenantRegistry(url, refresh_interval_s=0) as registry:
        tenant, api_key = registry.create("acme")
        [(backend_pid,)] = databases.query(
            url,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()",
        )
        databases.query(url, "SELECT pg_terminate_backend(?)", (backend_pid,))
        with pytest.raises(DATABASE_ERRORS):
            registry.create("globex")
        globex, _ = registry.create("globex")  # a new connection
        assert [t.name for t in registry.list()] == ["acme", "globex"]
        assert registry.authenticate(api_key) == tenant
        assert registry.get(globex.id) == globex


def test_a_connection_left_busy_by_a_failed_statement_is_opened_again(
    postgres_server: PostgresServer,
) -> None:
    """A connection killed under a statement can fail it and stay "in progress" without being
    marked closed (seen once in the test above, a race the test cannot force): every later
    statement on it would fail. Left that way here by libpq's own call that sends a statement
    and does not wait for its result."""
    db = connect(postgres_server.new_database(), busy_timeout_s=1, lock_name="test")
    db.execute("CREATE TABLE items (x integer)")

    db._connection.pgconn.send_query(b"SELECT 1")
    with db.write():  # a transaction's first statement connects again
        db.execute("INSERT INTO items VALUES (1)")

    with pytest.raises(ValueError), db.write():
        db.execute("INSERT INTO items VALUES (2)")
        db._connection.pgconn.send_query(b"SELECT 1")
        raise ValueError("the caller's own error, not ROLLBACK's")
    assert db.rows("SELECT x FROM items") == [{"x": 1}]  # the transaction left nothing
    db.close()
