"""`cacheproxy bench index`: the whole benchmark at its smallest, on the test's database (a
SQLite file, or PostgreSQL under `--database postgresql`, which it leaves without its archives);
the benchmark stops if a lookup misses its archive or a save keeps the wrong archives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import databases

pytestmark = pytest.mark.database


def test_the_index_benchmark_saves_and_finds_at_each_count(database_url: str | None) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cacheproxy",
            "bench",
            "index",
            *("--at", "3", "12", "--samples", "4", "--system", "130", "--tail", "90", "--json"),
            *(("--database-url", database_url) if database_url else ()),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["config"]["database_url"] == database_url
    assert [row["archives"] for row in report["figures"]] == [3, 12]
    for row in report["figures"]:
        assert row["save_ms"] > 0
        assert row["lookup_next_turn_ms"] > 0 and row["lookup_new_conversation_ms"] > 0
    if database_url:  # a database that outlives the run keeps none of its archives
        assert databases.query(database_url, "SELECT count(*) FROM archives") == [(0,)]
