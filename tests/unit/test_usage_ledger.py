"""Usage figures and sums (tenancy/usage.py), the ledger (tenancy/ledger.py) and
`cacheproxy usage export` on a real SQLite file or PostgreSQL database (`--database`)."""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cacheproxy.tenancy.ledger import LedgerStore, LedgerUnusable
from cacheproxy.tenancy.limits import TokenBucket
from cacheproxy.tenancy.usage import aggregate, hour_of, parse_time, task_figures
from tests.support import databases

H = 3600
DAY_START = int(datetime(2026, 11, 30, tzinfo=UTC).timestamp())


def test_reuse_split_by_where_it_came_from() -> None:
    common = {"prompt_tokens": 100, "computed_tokens": 40, "reused_tokens": 60}
    slot = task_figures(
        **common, generated_tokens=5, tenant="a", previous_owner="a", disk_action=""
    )
    assert slot["reused_slot_tokens"] == 60 and slot["generated_tokens"] == 5
    disk = task_figures(
        **common, generated_tokens=5, tenant="a", previous_owner="b", disk_action="restore"
    )
    assert disk["reused_disk_tokens"] == 60 and disk["restores"] == 1
    public = task_figures(
        **common, generated_tokens=None, tenant="a", previous_owner="b", disk_action=""
    )
    assert public["reused_public_tokens"] == 60 and public["generated_tokens"] == 0
    unknown = task_figures(
        **common, generated_tokens=1, tenant="a", previous_owner=None, disk_action=""
    )
    assert unknown["reused_slot_tokens"] == 60


def test_aggregate_by_hour_day_month_and_tenant() -> None:
    rows = [
        {"tenant_id": "a", "hour": DAY_START, "requests": 1, "prompt_tokens": 10},
        {"tenant_id": "a", "hour": DAY_START + H, "requests": 2, "reused_slot_tokens": 3},
        {"tenant_id": "b", "hour": DAY_START + 24 * H, "requests": 4},
    ]
    by_hour = aggregate(rows, "hour")
    assert [row["hour"] for row in by_hour] == [
        "2026-11-30T00:00:00Z",
        "2026-11-30T01:00:00Z",
        "2026-12-01T00:00:00Z",
    ]
    by_day = aggregate(rows, "day")
    assert [(r["day"], r["tenant_id"], r["requests"]) for r in by_day] == [
        ("2026-11-30", "a", 3),
        ("2026-12-01", "b", 4),
    ]
    by_month = aggregate(rows, "month")
    assert [(r["month"], r["requests"]) for r in by_month] == [("2026-11", 3), ("2026-12", 4)]
    by_tenant = aggregate(rows, "tenant")
    assert by_tenant[0] == {
        "tenant_id": "a",
        "requests": 3,
        "prompt_tokens": 10,
        "computed_tokens": 0,
        "reused_slot_tokens": 3,
        "reused_disk_tokens": 0,
        "reused_public_tokens": 0,
        "generated_tokens": 0,
        "restores": 0,
        "archived_bytes": 0,
        "errors": 0,
        "reused_tokens": 3,
    }


def test_parse_time() -> None:
    assert parse_time("2026-11-30") == DAY_START
    assert parse_time("2026-11-30T01:00:00Z") == DAY_START + H
    assert parse_time("2026-11-30T02:00:00+01:00") == DAY_START + H
    assert parse_time(str(DAY_START)) == DAY_START
    with pytest.raises(ValueError, match="not a time"):
        parse_time("yesterday")


def test_store_adds_batches_keeps_buckets_and_prunes(
    tmp_path: Path, database_url: str | None
) -> None:
    path = databases.target(database_url, tmp_path / "usage.db")
    with LedgerStore(path) as store:
        store.write({("a", DAY_START): Counter(requests=1, prompt_tokens=5)}, [])
        store.write(
            {
                ("a", DAY_START): Counter(requests=2, generated_tokens=7),
                ("a", DAY_START - 10 * 24 * H): Counter(requests=9),
            },
            [("a", "requests_per_minute", TokenBucket(10.0, 3.5, 1000.0))],
        )
        assert [row["requests"] for row in store.rows("a")] == [9, 3]
        store.write({}, [], prune_before=DAY_START - 24 * H)
        [row] = store.rows("a")
        assert (row["requests"], row["prompt_tokens"], row["generated_tokens"]) == (3, 5, 7)
        assert store.budget_totals(DAY_START) == {"a": {DAY_START: 12}}
    if not databases.uses_postgresql(path):
        assert oct(Path(path).stat().st_mode & 0o777) == "0o600"
    with LedgerStore(path) as store:  # reopened: the levels are where they were
        assert store.buckets() == {"a": {"requests_per_minute": TokenBucket(10.0, 3.5, 1000.0)}}
        assert store.rows("b") == []
        assert store.rows(start=DAY_START + H) == []


async def test_on_an_event_loop_the_store_is_opened_written_and_read_by_its_twins(
    tmp_path: Path, database_url: str | None
) -> None:
    path = databases.target(database_url, tmp_path / "usage.db")
    store = await LedgerStore.aopen(path)
    try:
        bucket = ("a", "requests_per_minute", TokenBucket(10.0, 3.5, 1000.0))
        await store.awrite({("a", DAY_START): Counter(requests=2, prompt_tokens=5)}, [bucket])
        assert [row["requests"] for row in await store.arows("a", DAY_START)] == [2]
        assert await store.abudget_totals(DAY_START) == {"a": {DAY_START: 5}}
        assert await store.abuckets() == {"a": {"requests_per_minute": bucket[2]}}
    finally:
        await store.aclose()


def test_a_damaged_ledger_is_named(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    path.write_bytes(b"this is not SQLite" * 100)
    with pytest.raises(LedgerUnusable, match=r"usage\.db"):
        LedgerStore(path)


def test_an_unreachable_postgresql_ledger_is_named_without_its_password() -> None:
    with socket.socket() as closed:  # a loopback port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(LedgerUnusable) as refused:
        LedgerStore(f"postgresql://cacheproxy:s3cret@127.0.0.1:{port}/usage")
    message = str(refused.value)
    assert f"postgresql://cacheproxy:***@127.0.0.1:{port}/usage" in message
    assert "s3cret" not in message and "PostgreSQL server runs" in message


def test_export_csv_and_json(tmp_path: Path, database_url: str | None) -> None:
    # the CLI child finds the same ledger: CACHEPROXY_DATABASE_URL is set for the test
    with LedgerStore(databases.target(database_url, tmp_path / "usage.db")) as store:
        store.write(
            {
                ("a", DAY_START): Counter(requests=1, prompt_tokens=5, reused_disk_tokens=2),
                ("b", DAY_START + H): Counter(requests=2),
            },
            [],
        )
    env = {**os.environ, "CACHEPROXY_STATE_DIR": str(tmp_path)}

    def export(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "cacheproxy", "usage", "export", *args],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout

    rows = list(csv.DictReader(io.StringIO(export("--format", "csv"))))
    assert [(r["tenant_id"], r["hour"], r["requests"]) for r in rows] == [
        ("a", "2026-11-30T00:00:00Z", "1"),
        ("b", "2026-11-30T01:00:00Z", "2"),
    ]
    assert rows[0]["reused_tokens"] == "2"
    document = json.loads(export("--format", "json", "--tenant", "b", "--group-by", "day"))
    assert document["rows"] == [
        {
            "tenant_id": "b",
            "day": "2026-11-30",
            **dict.fromkeys(
                (
                    "requests",
                    "prompt_tokens",
                    "computed_tokens",
                    "reused_slot_tokens",
                    "reused_disk_tokens",
                    "reused_public_tokens",
                    "generated_tokens",
                    "restores",
                    "archived_bytes",
                    "errors",
                ),
                0,
            ),
            "requests": 2,
            "reused_tokens": 0,
        }
    ]
    later = json.loads(export("--format", "json", "--from", "2026-11-30T01:00:00Z"))
    assert [r["tenant_id"] for r in later["rows"]] == ["b"]
    assert hour_of(DAY_START + H + 59) == DAY_START + H


def test_the_ledger_counts_per_model_too(tmp_path: Path, database_url: str | None) -> None:
    path = databases.target(database_url, tmp_path / "usage.db")
    with LedgerStore(path) as store:
        by_model = {
            ("a", "alpha", DAY_START): Counter(requests=1, prompt_tokens=5),
            ("a", "beta", DAY_START): Counter(requests=2, prompt_tokens=7),
            ("b", "alpha", DAY_START + H): Counter(requests=4),
        }
        store.write({("a", DAY_START): Counter(requests=3)}, [], model_hours=by_model)
        store.write({}, [], model_hours={("a", "alpha", DAY_START): Counter(requests=1)})
        rows = store.rows("a", by_model=True)
        assert [(r["model"], r["requests"], r["prompt_tokens"]) for r in rows] == [
            ("alpha", 2, 5),
            ("beta", 2, 7),
        ]
        assert [row["requests"] for row in store.rows("a")] == [3]  # per tenant, as before
        summed = aggregate(store.rows(by_model=True), "tenant", by_model=True)
        assert [(r["tenant_id"], r["model"], r["requests"]) for r in summed] == [
            ("a", "alpha", 2),
            ("a", "beta", 2),
            ("b", "alpha", 4),
        ]
        store.write({}, [], prune_before=DAY_START + H)
        assert [row["model"] for row in store.rows(by_model=True)] == ["alpha"]
