"""The database layer the stores share (cacheproxy/db), on a real SQLite file or, under
`--database postgresql`, a real PostgreSQL database: portable SQL, migrations declared once,
the write lock between connections."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cacheproxy.db.connection import (
    DATABASE_ERRORS,
    Database,
    DatabaseTarget,
    connect,
    shown_target,
    split_statements,
)
from cacheproxy.db.migrations import VERSION_TABLE, Migrations
from tests.support import databases


@pytest.fixture
def where(database_url: str | None, tmp_path: Path) -> DatabaseTarget:
    return databases.target(database_url, tmp_path / "test.db")


def opened(where: DatabaseTarget, lock_name: str = "test") -> Database:
    return connect(where, busy_timeout_s=5.0, lock_name=lock_name)


def test_statements_split_outside_quotes_and_comments() -> None:
    script = """
        -- a comment; with a semicolon and an apostrophe's
        CREATE TABLE a (x TEXT DEFAULT 'one;two');
        INSERT INTO a VALUES ('it''s; fine');  -- trailing; comment
        ;
    """
    assert split_statements(script) == [
        "-- a comment; with a semicolon and an apostrophe's\n"
        "        CREATE TABLE a (x TEXT DEFAULT 'one;two')",
        "INSERT INTO a VALUES ('it''s; fine')",
    ]


def test_a_trigger_is_one_statement_with_the_semicolons_of_its_body() -> None:
    script = """
        CREATE TABLE a (x INTEGER);
        CREATE TRIGGER a_counted AFTER INSERT ON a BEGIN UPDATE a SET x = x + 1; END;
        INSERT INTO a VALUES (1);
    """
    assert split_statements(script) == [
        "CREATE TABLE a (x INTEGER)",
        "CREATE TRIGGER a_counted AFTER INSERT ON a BEGIN UPDATE a SET x = x + 1; END",
        "INSERT INTO a VALUES (1)",
    ]


def test_a_password_never_shows() -> None:
    shown = shown_target("postgresql://proxy:hunter2@db:5432/cacheproxy")
    assert shown == "postgresql://proxy:***@db:5432/cacheproxy"
    assert shown_target("postgresql://proxy@db/cacheproxy") == "postgresql://proxy@db/cacheproxy"


LEASES = Migrations("test.leases")
# the kind of step another store declares once: portable types, numeric timestamps
LEASES.add(
    "m001_leases",
    """
    CREATE TABLE leases (
        upstream TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        expires {float} NOT NULL,
        generation {int} NOT NULL DEFAULT 0,
        note {blob}
    ) {strict};
    """,
)
LEASES.add(
    "m002_leases_by_holder",
    sqlite="CREATE INDEX leases_by_holder ON leases(holder)",
    postgresql="CREATE INDEX leases_by_holder ON leases USING btree (holder)",
)


def test_a_portable_migration_keeps_full_precision_and_upserts(where: DatabaseTarget) -> None:
    db = opened(where)
    try:
        assert LEASES.migrate(db) == ["m001_leases", "m002_leases_by_holder"]
        assert LEASES.migrate(db) == []  # applied once
        upsert = (
            "INSERT INTO leases (upstream, holder, expires, generation, note)"
            " VALUES (?, ?, ?, 1, ?) ON CONFLICT (upstream) DO UPDATE SET"
            " holder = excluded.holder, expires = excluded.expires,"
            " generation = leases.generation + 1"
            " WHERE leases.expires < excluded.expires"
        )
        expires = 1_764_556_800.123456  # 4-byte floats would keep ~7 digits of it
        with db.write():
            db.execute(upsert, ["u1", "proxy-a", expires, b"\x00\xff"])
            db.execute(upsert, ["u1", "proxy-b", expires + 1, None])
            db.execute(upsert, ["u1", "proxy-c", expires - 5, None])  # older: no change
        assert db.rows("SELECT holder, expires, generation, note FROM leases") == [
            {"holder": "proxy-b", "expires": expires + 1, "generation": 2, "note": b"\x00\xff"}
        ]
        table = VERSION_TABLE[db.dialect]
        assert db.execute(f"SELECT migration_set, name FROM {table} ORDER BY id").fetchall() == [
            ("test.leases", "m001_leases"),
            ("test.leases", "m002_leases_by_holder"),
        ]
    finally:
        db.close()


def test_a_failing_step_leaves_nothing_and_stays_pending(where: DatabaseTarget) -> None:
    broken = Migrations("test.broken")
    broken.add("m001_fine", "CREATE TABLE fine (x {int})")
    broken.add("m002_fails", "CREATE TABLE nope (x {int}); INSERT INTO missing VALUES (1)")
    db = opened(where)
    try:
        with pytest.raises(DATABASE_ERRORS):
            broken.migrate(db)
        assert broken.applied(db) == []
        # the first step was rolled back with the second: its table is not there either
        with pytest.raises(DATABASE_ERRORS):
            db.execute("SELECT count(*) FROM fine").fetchall()
        assert [step.name for step in broken.pending(db)] == ["m001_fine", "m002_fails"]
    finally:
        db.close()


def test_a_step_needs_both_dialects() -> None:
    steps = Migrations("test.half")
    with pytest.raises(ValueError, match="both"):
        steps.add("m001", sqlite="CREATE TABLE t (x INTEGER)")
    steps.add("m001", "CREATE TABLE t (x {int})")
    with pytest.raises(ValueError, match="already"):
        steps.add("m001", "CREATE TABLE u (x {int})")


def test_a_writer_waits_for_another_writer_of_the_same_store(where: DatabaseTarget) -> None:
    """What a write transaction counted cannot change before it commits: a second connection's
    write transaction starts only after the first one ends (the quota guarantee's basis)."""
    first, second = opened(where, "store"), opened(where, "store")
    try:
        with first.write():
            first.execute("CREATE TABLE counted (n INTEGER)")
        events: list[str] = []

        def write_second() -> None:
            with second.write():
                events.append("second starts")
                second.execute("INSERT INTO counted VALUES (2)")

        with first.write():
            first.execute("INSERT INTO counted VALUES (1)")
            writer = threading.Thread(target=write_second)
            writer.start()
            time.sleep(0.5)  # long enough for the second writer to get in, if it could
            events.append("first commits")
        writer.join(timeout=10)
        assert events == ["first commits", "second starts"]
        assert sorted(first.execute("SELECT n FROM counted").fetchall()) == [(1,), (2,)]
    finally:
        first.close()
        second.close()
