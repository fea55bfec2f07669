"""The disk tier keeping archives as blocks, against real llama-servers: conversations sharing a
head hold it once, a request sharing only the head restores just that, the admin API, the CLI
and /metrics show the shared bytes, a damaged block is never restored, and a conversation's
return reads the whole copy its archive keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.disk.kv_blocks import BLOCK_HEADER
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.http.app_keys import ARCHIVES
from cacheproxy.http.dashboard import ARCHIVE_USAGE
from tests.support import databases
from tests.support.completions import complete
from tests.support.disk_tier import TWO_SLOTS, conversation, disk_settings, next_turn
from tests.support.metrics import proxy_counters
from tests.support.servers import StartServer, serving
from tests.support.waiting import wait_for

pytestmark = pytest.mark.database

ADMIN_KEY = "admin-key-for-the-block-tests"
# saved when evicted (whatever the cost model would say of a short tail), cut in the background;
# every restore from blocks (a whole copy would serve most of them: tested on its own below)
EVICTION_SAVES = {"ahead_mib_s": 0.0, "always_save": True, "blocks": True, "whole_copies": False}
HEAD = conversation(50, 512)  # a long system prompt every conversation starts with


async def evict(client: aiohttp.ClientSession, url: str) -> None:
    """Longer conversations take both slots (the scheduler keeps the longer of two texts)."""
    for seed in range(100, 104):
        await complete(client, url, conversation(seed, 1200))


def all_cut(store: ArchiveIndex) -> bool:
    """The four conversations `evict` leaves on disk are saved and cut into blocks: the store's
    figures hold still (a cut still under way would change them between two reads)."""
    archives = store.list()
    return len(archives) >= 4 and all(archive.blocks for archive in archives)


async def test_conversations_sharing_a_head_hold_it_once_and_restore_only_what_they_share(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    settings = disk_settings(
        server, tmp_path, tenants={"admin_api_key": ADMIN_KEY}, disk=EVICTION_SAVES
    )
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        store = app[ARCHIVES].blocking
        for seed in (1, 2):
            await complete(client, url, HEAD + conversation(seed, 200))
        await evict(client, url)
        await wait_for(lambda: all_cut(store))

        sharing = store.sharing_by_tenant()["default"]
        usage = store.usage("default")
        # the head's eight whole blocks, stored once for both
        [(block_bytes,)] = databases.query(
            databases.chosen(tmp_path / "archive.db"),
            "SELECT DISTINCT bytes FROM kv_blocks WHERE n_cells = 64",
        )
        assert sharing.shared_bytes == len(HEAD) // 64 * block_bytes
        assert usage.bytes < sharing.whole_bytes
        async with client.get(url + "/admin/archives", headers=admin) as response:
            listing = await response.json()
        figures = listing["tenants"]["default"]
        assert figures["unique_bytes"] == usage.bytes == listing["unique_bytes"]
        assert figures["shared_bytes"] == sharing.shared_bytes == listing["shared_bytes"]
        assert figures["whole_bytes"] == sharing.whole_bytes
        dashboard = await app[ARCHIVE_USAGE]()
        assert dashboard["default"]["archive_shared_bytes"] == sharing.shared_bytes
        counters = await proxy_counters(client, url)
        deduplicated = counters['cacheproxy_archive_deduplicated_bytes{tenant="default"}']
        assert deduplicated == sharing.whole_bytes - usage.bytes > 0
        assert counters['cacheproxy_archive_block_bytes_total{kind="shared"}'] > 0

        # another question on the head: only the head comes back from disk
        whole = max(archive.bytes for archive in store.list())
        answer = await complete(client, url, HEAD + conversation(3, 200))
        assert answer["timings"]["cache_n"] == len(HEAD)
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 1
        restored = counters["cacheproxy_archive_restored_bytes_total"]
        assert 0 < restored < whole * len(HEAD) / (len(HEAD) + 200 + 8) + 4096
        assert counters["cacheproxy_archive_assembled_bytes_total"] == restored
        assert not list(server.slot_save_path.glob("r_*.slot"))  # given back

    # the CLI lists the same figures per tenant
    config = tmp_path / "cacheproxy.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[disk]\n'
        f'directory = "{server.slot_save_path}"\ndatabase = "{tmp_path / "archive.db"}"\n'
    )
    listed = subprocess.run(  # noqa: ASYNC221 (the proxy has stopped: nothing else runs)
        [sys.executable, "-m", "cacheproxy", "archives", "list", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    cli = json.loads(listed.stdout)["tenants"]["default"]
    assert cli["shared_bytes"] > 0 and cli["unique_bytes"] < cli["whole_bytes"]


async def test_a_damaged_block_is_never_restored(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(**TWO_SLOTS)
    first, second = HEAD + conversation(1, 200), conversation(2, 300)
    async with (
        serving(disk_settings(server, tmp_path, disk=EVICTION_SAVES)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        store = app[ARCHIVES].blocking
        await complete(client, url, first)
        second_answer = await complete(client, url, second)
        await evict(client, url)
        await wait_for(lambda: all_cut(store))
        damaged = store.covering("default", store.list()[0].fingerprint, first)
        kept = store.covering("default", damaged.fingerprint, second)  # type: ignore[union-attr]
        assert damaged is not None and kept is not None
        # one bit of one cell of the first conversation's first block
        [(block_id,)] = databases.query(
            databases.chosen(tmp_path / "archive.db"),
            "SELECT block_id FROM archive_kv_blocks WHERE archive_id = ? AND ordinal = 0",
            (damaged.id,),
        )
        path = store.blocks_directory / block_id
        data = bytearray(path.read_bytes())
        data[BLOCK_HEADER.size + 100] ^= 0x01
        path.write_bytes(bytes(data))

        again = await complete(client, url, first + conversation(3, 40))
        assert again["timings"]["cache_n"] == 0  # cold: its archive is not restored
        assert store.get(damaged.id) is None and not path.exists()
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_archive_restores_total{outcome="failed"}'] == 1
        # nothing else was lost: the other archive still restores
        answer = await complete(client, url, next_turn(second, second_answer, 4))
        assert answer["timings"]["cache_n"] == len(second) + 3


async def test_a_return_reads_the_whole_copy_and_a_request_sharing_little_the_blocks(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    long_one = HEAD + conversation(1, 1400)  # the head is a quarter of it
    disk = {**EVICTION_SAVES, "whole_copies": True}
    async with (
        serving(disk_settings(server, tmp_path, disk=disk)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        store = app[ARCHIVES].blocking
        for prompt in (long_one, conversation(5, 300)):
            await complete(client, url, prompt)
        for seed in range(100, 104):  # longer still: they take both slots
            await complete(client, url, conversation(seed, 2400))
        await wait_for(lambda: all_cut(store))
        archive = store.covering("default", store.list()[0].fingerprint, long_one)
        assert archive is not None and archive.blocks and archive.whole_copy
        assert archive.path.stat().st_size == archive.bytes  # the file the server wrote

        # another question on the head: a quarter of the archive, put together from blocks
        sibling = await complete(client, url, HEAD + conversation(2, 300))
        assert sibling["timings"]["cache_n"] == len(HEAD)
        counters = await proxy_counters(client, url)
        assembled = counters["cacheproxy_archive_assembled_bytes_total"]
        assert 0 < assembled == counters["cacheproxy_archive_restored_bytes_total"]
        assert assembled < archive.bytes / 2

        # the conversation's return: all of it, from its copy, nothing put together
        again = await complete(client, url, long_one + conversation(3, 40))
        assert again["timings"]["cache_n"] == len(long_one)
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 2
        assert counters["cacheproxy_archive_assembled_bytes_total"] == assembled
        restored = counters["cacheproxy_archive_restored_bytes_total"]
        assert restored == assembled + archive.bytes
        assert archive.path.stat().st_size == archive.bytes  # lent, given back, kept
        assert not list(server.slot_save_path.glob("r_*.slot"))
        # the slots the two turns evicted were saved; their cuts end in the background
        await wait_for(lambda: all_cut(store))
        counters = await proxy_counters(client, url)
        copies = counters['cacheproxy_archive_copy_bytes{tenant="default"}']
        assert copies == store.sharing_by_tenant()["default"].copy_bytes >= archive.bytes


async def test_a_whole_copy_gone_as_the_server_reads_it_drops_the_copy_not_the_archive(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Another proxy sharing the folder may drop a copy this one has just lent: the server
    cannot restore it (and clears the slot), the request runs cold, the archive stays as its
    blocks and its next return is put together from them."""
    server = start_server(**TWO_SLOTS)
    disk = {**EVICTION_SAVES, "whole_copies": True}
    async with (
        serving(disk_settings(server, tmp_path, disk=disk)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        store = app[ARCHIVES].blocking
        prompt = conversation(1, 1000)
        answer = await complete(client, url, prompt)
        await complete(client, url, conversation(5, 300))
        await evict(client, url)
        await wait_for(lambda: all_cut(store))
        archive = store.covering("default", store.list()[0].fingerprint, prompt)
        assert archive is not None and archive.whole_copy
        lend = store.restore_file

        def lend_then_lose(*args: object) -> object:
            made = lend(*args)  # type: ignore[arg-type]
            if made is not None and not made.temporary:
                store.path_for(made.file_name).unlink()  # dropped elsewhere meanwhile
            return made

        store.restore_file = lend_then_lose  # type: ignore[method-assign]
        prompt = next_turn(prompt, answer, 4)
        cold = await complete(client, url, prompt)
        assert cold["timings"]["cache_n"] == 0
        kept = store.get(archive.id)
        assert kept is not None and kept.blocks and not kept.whole_copy
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_archive_restores_total{outcome="failed"}'] == 1
        assert counters["cacheproxy_archive_assembled_bytes_total"] == 0  # the copy was lent

        store.restore_file = lend  # type: ignore[method-assign]
        # its next restore is put together from its blocks, even where the copy would pay
        tokens = store.tokens(kept.id)
        assert tokens is not None
        made = store.restore_file(kept, tokens, len(tokens), True)
        assert made is not None and made.temporary
        assert store.checked(made)
        store.release(made)
