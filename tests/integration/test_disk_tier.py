"""The disk tier against real llama-servers: evicted conversations come back without prefill.

Every proxy here archives into its llama-server's `--slot-save-path`, as a deployment must.
Prompts are token ids, so the only thing deciding reuse is what the slots and archives hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.disk.archive_types import Archive
from cacheproxy.disk.slot_file import read_slot_file
from cacheproxy.http.app_keys import ARCHIVES, CACHE, METRICS
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.upstreams.managed import free_port
from tests.support import databases
from tests.support.completions import complete
from tests.support.disk_tier import (
    PROMPT_TOKENS,
    SAVED_ON_THE_PATH,
    TWO_SLOTS,
    archived,
    conversation,
    disk_settings,
    evict_with_others,
    next_turn,
    open_store,
)
from tests.support.metrics import proxy_counters
from tests.support.servers import LlamaServer, StartServer, serving, wait_for_health
from tests.support.waiting import wait_for

# runs on the database backend chosen with --database (the archive index, the registry)
pytestmark = pytest.mark.database


async def test_evicted_conversation_is_restored_with_reuse(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    async with (
        serving(disk_settings(server, tmp_path)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        first = conversation(1)
        answer = await complete(client, url, first)
        await evict_with_others(client, url, range(100, 102))
        # the slot held the prompt and the answer but its last token, which is never decoded
        assert ("default", PROMPT_TOKENS + 3) in archived(app[ARCHIVES].blocking)

        follow_up = next_turn(first, answer, 2)
        again = await complete(client, url, follow_up)
        # everything the first turn left in the slot comes back from disk, not from prefill
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 1
        assert counters["cacheproxy_archive_restored_bytes_total"] > 0
        # each answer of the server to a save or restore timed: round trip, and its own part
        for action in ("save", "restore"):
            count = f'cacheproxy_disk_round_trip_seconds_count{{action="{action}"}}'
            trips = f'cacheproxy_disk_round_trip_seconds_sum{{action="{action}"}}'
            own = f'cacheproxy_disk_stall_seconds_total{{action="{action}"}}'
            assert counters[count] >= 1
            assert counters[trips] >= counters[own] > 0
        saves = counters['cacheproxy_archive_saves_total{outcome="saved"}']
        assert counters['cacheproxy_disk_round_trip_seconds_count{action="save"}'] >= saves

    # archived again at shutdown, the longer conversation replaced the older archive it contains
    with open_store(server, tmp_path) as store:
        [archive] = [a for a in store.list() if store.tokens(a.id)[:PROMPT_TOKENS] == first]
        assert archive.n_tokens == len(follow_up) + 3

    # the control: without the disk tier the same turn is decoded from scratch
    cold_dir = tmp_path / "cold"
    settings = disk_settings(server, cold_dir, disk={"enabled": False})
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        other = conversation(3)
        answer = await complete(client, url, other)
        await evict_with_others(client, url, range(200, 202))
        again = await complete(client, url, next_turn(other, answer, 4))
        assert again["timings"]["cache_n"] == 0


async def test_archives_outlive_proxy_and_server_restarts(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    # what is archived before the stop is what the evictions saved
    settings = disk_settings(
        server, tmp_path, routing={"health_interval_s": 0.2}, disk=SAVED_ON_THE_PATH
    )
    first, second = conversation(1), conversation(2)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        first_answer = await complete(client, url, first)
        second_answer = await complete(client, url, second)
        await evict_with_others(client, url, range(100, 101))
        # the first: the second is still in a slot
        assert len(archived(app[ARCHIVES].blocking)) == 1
    # stopping the proxy archived the live slots worth keeping (the second and the third)
    with open_store(server, tmp_path) as store:
        assert len(store.list()) == 3

    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        # a new proxy knows nothing of the slots, but finds the first in its archive
        again = await complete(client, url, next_turn(first, first_answer, 3))
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3

        table = app[CACHE].tables[0]
        server.kill()
        await wait_for(lambda: not table.healthy)
        start_server(port=server.port, **TWO_SLOTS)  # the same port and slot save path
        await wait_for(lambda: table.healthy)
        # a fresh llama-server holds nothing; the second comes back from disk all the same
        again = await complete(client, url, next_turn(second, second_answer, 4))
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3


def usage_by_tenant(database: databases.DatabaseTarget) -> dict[str, tuple[int, int]]:
    """Committed plus reserved bytes and archives per tenant, read as another process would."""
    rows = databases.query(
        database,
        "SELECT tenant_id, sum(bytes), count(*) FROM ("
        " SELECT tenant_id, bytes FROM archives UNION ALL"
        " SELECT tenant_id, bytes FROM reservations) AS held GROUP BY tenant_id",
    )
    return {tenant: (total, count) for tenant, total, count in rows}


def stored_by_tenant(database: databases.DatabaseTarget) -> dict[str, tuple[int, int]]:
    """What archives kept as blocks hold: whole files, each block once, and reservations,
    read as another process would."""
    rows = databases.query(
        database,
        "SELECT tenant_id, sum(bytes), sum(n) FROM ("
        " SELECT tenant_id, CASE WHEN coalesce(frame, '') = '' THEN bytes ELSE 0 END AS bytes,"
        " 1 AS n FROM archives UNION ALL"
        " SELECT tenant_id, bytes, 0 FROM kv_blocks UNION ALL"
        " SELECT tenant_id, bytes, 1 FROM reservations) AS held GROUP BY tenant_id",
    )
    return {tenant: (total, count) for tenant, total, count in rows}


@pytest.mark.parametrize("blocks", [False, True], ids=["whole-files", "blocks"])
async def test_quotas_hold_under_twenty_concurrent_savers(
    start_server: StartServer, tmp_path: Path, blocks: bool
) -> None:
    server = start_server(parallel=4, ctx_size=8192)
    database = tmp_path / "tenants.db"
    quota_bytes, quota_archives = 1_000_000, 4  # about three archives by bytes
    with TenantRegistry(databases.chosen(database)) as registry:
        tenants = [
            registry.create(name, quota_bytes=quota_bytes, quota_archives=quota_archives)
            for name in ("alice", "bob")
        ]
    settings = disk_settings(
        server, tmp_path, tenants={"database": database}, disk={"blocks": blocks}
    )
    peaks: dict[str, tuple[int, int]] = {}
    stop_sampling = asyncio.Event()
    # kept as blocks, a tenant holds each of its blocks once, whatever its archives add up to
    held_by_tenant = stored_by_tenant if blocks else usage_by_tenant

    async def sample() -> None:
        while not stop_sampling.is_set():
            usage = await asyncio.to_thread(
                held_by_tenant, databases.chosen(tmp_path / "archive.db")
            )
            for tenant_id, (used, count) in usage.items():
                old = peaks.get(tenant_id, (0, 0))
                peaks[tenant_id] = (max(old[0], used), max(old[1], count))
            await asyncio.sleep(0.005)

    async def client_turns(client: aiohttp.ClientSession, url: str, number: int) -> None:
        _, key = tenants[number % 2]
        headers = {"Authorization": f"Bearer {key}"}
        prompt = conversation(1000 + number, 320)
        for turn in range(3):
            answer = await complete(client, url, prompt, headers)
            prompt = next_turn(prompt, answer, 2000 + number * 10 + turn)

    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        sampler = asyncio.create_task(sample(), name="quota-sampler")
        await asyncio.gather(*(client_turns(client, url, number) for number in range(20)))
        stop_sampling.set()
        await sampler
        # /metrics is the admin's: read the registry behind it
        saved = app[METRICS].registry.get_sample_value(
            "cacheproxy_archive_saves_total", {"outcome": "saved"}
        )
        final = {tenant.id: app[ARCHIVES].blocking.usage(tenant.id) for tenant, _ in tenants}

    # evictions happened: many more saves than the quotas hold
    assert saved is not None and saved > 2 * 2 * quota_archives
    for tenant, _ in tenants:
        peak_bytes, peak_count = peaks[tenant.id]
        assert 0 < peak_bytes <= quota_bytes
        assert 0 < peak_count <= quota_archives
        assert 0 < final[tenant.id].bytes <= quota_bytes
    # after the drain at shutdown, what the index holds is what the folder holds
    files = {path.name for path in server.slot_save_path.glob("a_*.slot")}
    with open_store(server, tmp_path) as store:
        # whole archives' files, and the whole copies block archives keep
        assert files == {
            archive.file_name
            for archive in store.list()
            if not archive.blocks or archive.whole_copy
        }
        assert_blocks_on_disk(server.slot_save_path, databases.chosen(tmp_path / "archive.db"))
        for tenant, _ in tenants:
            assert store.usage(tenant.id).bytes <= quota_bytes
        # archives saved on the way were cut into blocks
        assert any(archive.blocks for archive in store.list()) == blocks


def assert_blocks_on_disk(folder: Path, database: databases.DatabaseTarget) -> None:
    """Every block row has its file at its size, and every block file a row."""
    rows = dict(databases.query(database, "SELECT id, bytes FROM kv_blocks"))
    files = {path.name: path.stat().st_size for path in (folder / "blocks").glob("b_*.kv")}
    assert files == rows


def damage(archive: Archive, other: Archive, how: str) -> None:
    if how == "truncated":
        with open(archive.path, "r+b") as file:
            file.truncate(archive.bytes // 2)
    elif how == "replaced":  # another conversation's valid file under this archive's name
        shutil.copyfile(other.path, archive.path)
    else:  # "layout": a state saved with one KV stream; only llama-server itself notices
        header = read_slot_file(archive.path)
        assert header.n_stream == TWO_SLOTS["parallel"]
        with open(archive.path, "r+b") as file:
            file.seek(header.state_offset)
            file.write(struct.pack("<I", 1))


@pytest.mark.parametrize("how", ["truncated", "replaced", "layout"])
async def test_damaged_archive_is_dropped_and_the_request_served_cold(
    start_server: StartServer, tmp_path: Path, how: str
) -> None:
    server = start_server(**TWO_SLOTS)
    first, second = conversation(1), conversation(2)
    whole_files = disk_settings(server, tmp_path, disk={"blocks": False})  # damaged files
    async with (
        serving(whole_files) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        first_answer = await complete(client, url, first)
        second_answer = await complete(client, url, second)
        await evict_with_others(client, url, range(100, 102))
        store = app[ARCHIVES].blocking
        damaged = store.covering("default", store.list()[0].fingerprint, first)
        kept = store.covering("default", damaged.fingerprint, second)
        assert damaged is not None and kept is not None
        before = {archive.id for archive in store.list()}
        damage(damaged, kept, how)

        again = await complete(client, url, next_turn(first, first_answer, 3))
        assert again["timings"]["cache_n"] == 0  # cold: neither slot nor archive holds it
        after = {archive.id for archive in store.list()}
        assert damaged.id not in after and before - {damaged.id} <= after
        assert not damaged.path.exists()
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_archive_restores_total{outcome="failed"}'] == 1

        # nothing else was lost: the other archive still restores
        again = await complete(client, url, next_turn(second, second_answer, 4))
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3


def rows(database: databases.DatabaseTarget, table: str) -> int:
    """Rows in the archive index, read as another process would (0 before it exists)."""
    try:
        return databases.query(database, f"SELECT count(*) FROM {table}")[0][0]
    except DATABASE_ERRORS:
        return 0


async def start_serve_process(
    server: LlamaServer, tmp_path: Path, blocks: bool = True
) -> tuple[asyncio.subprocess.Process, str]:
    """`cacheproxy serve` as its own process, archiving into the server's slot save path."""
    port = free_port()
    environment = {
        **os.environ,
        "CACHEPROXY_STATE_DIR": str(tmp_path / "state"),
        "CACHEPROXY_DISK__DIRECTORY": str(server.slot_save_path),
        "CACHEPROXY_DISK__DATABASE": str(tmp_path / "archive.db"),
        "CACHEPROXY_DISK__MIN_TOKENS": "128",
        "CACHEPROXY_DISK__BLOCKS": str(blocks).lower(),
    }
    command = [
        sys.executable,
        "-m",
        "cacheproxy",
        "serve",
        "--port",
        str(port),
        "--upstream",
        server.url,
    ]
    proxy = await asyncio.create_subprocess_exec(
        *command, env=environment, stderr=asyncio.subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    await asyncio.to_thread(wait_for_health, url)
    return proxy, url


async def test_sigterm_archives_the_live_slots(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(**TWO_SLOTS)
    proxy, url = await start_serve_process(server, tmp_path)
    try:
        async with aiohttp.ClientSession() as client:
            first = await complete(client, url, conversation(1))
            await complete(client, url, conversation(2))
    finally:
        proxy.terminate()
        assert await proxy.wait() == 0  # a clean stop, after the drain
    with open_store(server, tmp_path) as store:
        # nothing was evicted: both conversations were archived by the drain
        assert sorted(archive.n_tokens for archive in store.list()) == [PROMPT_TOKENS + 3] * 2
        # and cut into blocks before the process ended: the stop waits for the drain's cuts
        assert all(archive.blocks for archive in store.list())
        # the whole files stay as the archives' copies (the budget has room)
        assert {path.name for path in server.slot_save_path.glob("a_*.slot")} == {
            archive.file_name for archive in store.list() if archive.whole_copy
        }
    # and a new llama-server gets the first back from disk
    server.stop()
    fresh = start_server(**TWO_SLOTS, port=server.port)
    async with (
        serving(disk_settings(fresh, tmp_path)) as (url, _),
        aiohttp.ClientSession() as client,
    ):
        again = await complete(client, url, next_turn(conversation(1), first, 3))
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3


@pytest.mark.parametrize("blocks", [False, True], ids=["whole-files", "blocks"])
async def test_kill_during_saves_leaves_a_consistent_archive(
    start_server: StartServer, tmp_path: Path, blocks: bool
) -> None:
    server = start_server(**TWO_SLOTS)
    database = databases.chosen(tmp_path / "archive.db")
    proxy, proxy_url = await start_serve_process(server, tmp_path, blocks)
    try:

        async def keep_evicting(client: aiohttp.ClientSession, worker: int) -> None:
            for turn in range(1000):
                with contextlib.suppress(aiohttp.ClientError, AssertionError):
                    await complete(client, proxy_url, conversation(worker * 1000 + turn))

        async with aiohttp.ClientSession() as client:
            load = [
                asyncio.create_task(keep_evicting(client, worker), name=f"load-{worker}")
                for worker in range(6)
            ]
            # once some saves are done, kill it the moment another is under way
            deadline = asyncio.get_running_loop().time() + 20
            while asyncio.get_running_loop().time() < deadline:
                if await asyncio.to_thread(rows, database, "archives") >= 3 and (
                    await asyncio.to_thread(rows, database, "reservations")
                ):
                    break
                await asyncio.sleep(0.001)
            proxy.kill()
            await proxy.wait()
            await asyncio.gather(*load)
    finally:
        if proxy.returncode is None:
            proxy.kill()
            await proxy.wait()

    with open_store(server, tmp_path) as store:
        store.recover()
        archives = store.list()
        assert archives, "no save ever finished"
        for archive in archives:
            assert store.intact(archive, store.tokens(archive.id))
        files = {path.name for path in server.slot_save_path.glob("a_*.slot")}
        assert files == {
            archive.file_name for archive in archives if not archive.blocks or archive.whole_copy
        }
        assert_blocks_on_disk(server.slot_save_path, database)
        assert rows(database, "reservations") == 0
        survivor = archives[-1]
        survivor_tokens = store.tokens(survivor.id)

    # the next proxy restores from what survived
    async with (
        serving(disk_settings(server, tmp_path)) as (url, _),
        aiohttp.ClientSession() as client,
    ):
        await evict_with_others(client, url, range(5000, 5002))  # both slots: something else
        answer = await complete(client, url, survivor_tokens + conversation(7, 40))
        assert answer["timings"]["cache_n"] == len(survivor_tokens)


ADMIN_KEY = "admin-key-for-the-disk-tier-tests"


async def test_admin_api_and_cli_list_and_delete_archives(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    # archives kept whole: the listing's bytes are then their files' (blocks: test_admin.py)
    settings = disk_settings(
        server, tmp_path, tenants={"admin_api_key": ADMIN_KEY}, disk={"blocks": False}
    )
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        await complete(client, url, conversation(1))
        await evict_with_others(client, url, range(100, 103))
        async with client.get(url + "/admin/archives") as response:
            assert response.status == 401
        async with client.get(url + "/admin/archives", headers=admin) as response:
            listing = await response.json()
        assert listing["count"] == len(listing["archives"]) >= 2
        assert listing["bytes"] == sum(archive["bytes"] for archive in listing["archives"])
        assert "path" not in listing["archives"][0] and "file_name" not in listing["archives"][0]
        async with client.get(
            url + "/admin/archives", params={"tenant_id": "nobody"}, headers=admin
        ) as response:
            assert (await response.json())["archives"] == []

        doomed = listing["archives"][0]["id"]
        path = app[ARCHIVES].blocking.get(doomed).path
        async with client.delete(url + f"/admin/archives/{doomed}", headers=admin) as response:
            assert response.status == 204
        assert not path.exists() and app[ARCHIVES].blocking.get(doomed) is None
        async with client.delete(url + f"/admin/archives/{doomed}", headers=admin) as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == 404
        # the gauges are read from the index when /metrics is asked: they follow the delete,
        # and a change another writer of the index made (another proxy's, here a second index)
        tenant = listing["archives"][0]["tenant_id"]
        assert {archive["tenant_id"] for archive in listing["archives"]} == {tenant}
        count = f'cacheproxy_archives{{tenant="{tenant}"}}'
        held = f'cacheproxy_archive_bytes{{tenant="{tenant}"}}'
        gauges = await proxy_counters(client, url, admin)
        assert gauges[count] == listing["count"] - 1
        assert gauges[held] == listing["bytes"] - listing["archives"][0]["bytes"]
        other = open_store(server, tmp_path)
        try:
            other.remove(listing["archives"][1]["id"])
        finally:
            other.close()
        assert (await proxy_counters(client, url, admin))[count] == listing["count"] - 2

    # the CLI reads the same index (here after the drain added the live slots)
    config = tmp_path / "cacheproxy.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[disk]\n'
        f'directory = "{server.slot_save_path}"\ndatabase = "{tmp_path / "archive.db"}"\n'
    )
    listed = cli("archives", "list", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    archives = json.loads(listed.stdout)["archives"]
    assert doomed not in {archive["id"] for archive in archives}
    deleted = cli("archives", "delete", archives[0]["id"], "--config", str(config))
    assert deleted.returncode == 0, deleted.stderr
    again = cli("archives", "delete", archives[0]["id"], "--config", str(config))
    assert again.returncode == 1 and "unknown_archive" in again.stderr
    remaining = json.loads(cli("archives", "list", "--config", str(config)).stdout)
    assert remaining["count"] == len(archives) - 1


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cacheproxy", *args], capture_output=True, text=True, timeout=60
    )


async def test_archive_routes_say_when_the_disk_tier_is_off(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    settings = load_settings(
        upstreams=[llama_server.url],
        state_dir=tmp_path / "state",
        tenants={"admin_api_key": ADMIN_KEY},
        disk={"enabled": False},
    )
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with client.get(url + "/admin/archives", headers=headers) as response:
            assert response.status == 501
            assert (await response.json())["error"]["type"] == "not_supported_error"
