"""Lost, corrupt or unwritable state files, as `cacheproxy serve` meets them at start-up.

Each start runs `python -m cacheproxy serve` as its own process: a refusal must be one line on
stderr naming the file and the fix, a non-zero exit, and nothing ever served; an archive index
that lost its rows must cost no archive file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.disk.archive_types import FILE_NAME_PATTERN
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.tenancy.registry_schema import tenants_marker
from tests.support.completions import complete
from tests.support.disk_tier import (
    PROMPT_TOKENS,
    TWO_SLOTS,
    conversation,
    disk_settings,
    evict_with_others,
    next_turn,
)
from tests.support.mounts import read_only
from tests.support.serve_once import assert_refused_naming, serve_once
from tests.support.servers import LlamaServer, StartServer, serving


def lose(path: Path, how: str) -> None:
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    if how == "truncated":
        path.write_bytes(b"")
    elif how == "deleted":
        path.unlink()
    else:
        path.write_bytes(os.urandom(8192))


@pytest.mark.parametrize("how", ["truncated", "deleted", "garbage"])
def test_a_lost_registry_stops_the_proxy_before_it_serves_without_keys(
    llama_server: LlamaServer, tmp_path: Path, how: str
) -> None:
    state_dir = tmp_path / "state"
    database = state_dir / "cacheproxy.db"
    with TenantRegistry(database) as registry:
        registry.create("acme")
    # the start that works: keys are required
    assert serve_once(state_dir, llama_server.url).keyless_status == 401

    lose(database, how)
    started = serve_once(state_dir, llama_server.url)
    assert_refused_naming(started, database)
    if how != "garbage":
        assert str(tenants_marker(database)) in started.stderr  # the way out, named


@pytest.mark.parametrize("how", ["garbage", "half"])
def test_a_corrupt_archive_index_stops_the_proxy_with_one_line(
    llama_server: LlamaServer, tmp_path: Path, how: str
) -> None:
    state_dir = tmp_path / "state"
    assert serve_once(state_dir, llama_server.url).keyless_status == 200
    database = state_dir / "archive.db"
    if how == "half":
        for suffix in ("-wal", "-shm"):
            database.with_name(database.name + suffix).unlink(missing_ok=True)
        os.truncate(database, database.stat().st_size // 2)
    else:
        lose(database, how)
    assert_refused_naming(serve_once(state_dir, llama_server.url), database)


def test_a_corrupt_usage_ledger_stops_the_proxy_with_one_line(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    """Limits and budgets are read from the ledger: the proxy must not start without it (it
    would refill every bucket and forget every budget)."""
    state_dir = tmp_path / "state"
    assert serve_once(state_dir, llama_server.url).keyless_status == 200
    database = state_dir / "usage.db"
    lose(database, "garbage")
    assert_refused_naming(serve_once(state_dir, llama_server.url), database)


def test_an_unwritable_state_dir_stops_the_proxy_with_one_line(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    with read_only(state_dir):  # read-only for root too
        assert_refused_naming(serve_once(state_dir, llama_server.url), state_dir)


def test_a_read_only_archive_folder_starts_with_the_disk_tier_off(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    (server.slot_save_path / "a_00000000000000000000000000000000.slot").write_bytes(b"x")
    with read_only(server.slot_save_path):
        started = serve_once(
            tmp_path / "state", server.url, CACHEPROXY_DISK__DIRECTORY=str(server.slot_save_path)
        )
    assert started.keyless_status == 200, started.stderr  # it serves, without the disk tier
    warnings = [line for line in started.stderr.splitlines() if "disk tier off" in line]
    assert warnings and str(server.slot_save_path) in warnings[0], started.stderr
    assert "Traceback" not in started.stderr


async def test_an_emptied_archive_index_quarantines_files_and_adopt_brings_one_back(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    # archives kept whole (what a lost index does to blocks: test_archive_blocks.py)
    settings = disk_settings(server, tmp_path, disk={"blocks": False})
    first = conversation(1)
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        answer = await complete(client, url, first)
        await evict_with_others(client, url, range(100, 103))
    files = sorted(
        path.name
        for path in server.slot_save_path.iterdir()
        if FILE_NAME_PATTERN.fullmatch(path.name)
    )
    assert len(files) >= 4  # the first, and the others drained at shutdown

    database = tmp_path / "archive.db"
    for suffix in ("-wal", "-shm"):
        database.with_name(database.name + suffix).unlink(missing_ok=True)
    database.write_bytes(b"")  # the index is lost; the files are not

    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        quarantine = server.slot_save_path / "quarantine"
        assert sorted(path.name for path in quarantine.iterdir()) == files  # not one deleted
        follow_up = next_turn(first, answer, 2)

        listed = cli("archives", "quarantine", "list", env=settings_env(server, tmp_path))
        assert listed.returncode == 0, listed.stderr
        entries = json.loads(listed.stdout)["files"]
        assert sorted(entry["file_name"] for entry in entries) == files
        # the operator knows which file is whose; here: the one holding the first conversation
        [ours] = [
            e
            for e in entries
            if e["n_tokens"] == PROMPT_TOKENS + 3
            and e["problem"] is None
            and _holds(quarantine / e["file_name"], first)
        ]
        adopted = cli(
            "archives",
            "adopt",
            ours["file_name"],
            "--tenant",
            "default",
            env=settings_env(server, tmp_path),
        )
        assert adopted.returncode == 0, adopted.stderr
        assert not (quarantine / ours["file_name"]).exists()

        again = await complete(client, url, follow_up)
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3  # restored, not prefilled
    # the index holds rows again, under the current fingerprint
    connection = sqlite3.connect(database)
    try:
        assert connection.execute("SELECT count(*) FROM archives").fetchone()[0] >= 1
    finally:
        connection.close()


def _holds(path: Path, tokens: list[int]) -> bool:
    from cacheproxy.disk.slot_file import read_slot_file

    return read_slot_file(path).tokens.tolist()[: len(tokens)] == tokens


def settings_env(server: LlamaServer, tmp_path: Path) -> dict[str, str]:
    return {
        "CACHEPROXY_STATE_DIR": str(tmp_path / "state"),
        "CACHEPROXY_DISK__DIRECTORY": str(server.slot_save_path),
        "CACHEPROXY_DISK__DATABASE": str(tmp_path / "archive.db"),
    }


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cacheproxy", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
