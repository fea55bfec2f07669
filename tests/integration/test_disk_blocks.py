"""The disk tier keeping archives as blocks, against real llama-servers: conversations sharing a
head hold it once, a request sharing only the head restores just that, the admin API, the CLI
and /metrics show the shared bytes, and a damaged block is never restored."""

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
# saved when evicted (whatever the cost model would say of a short tail), cut in the background
EVICTION_SAVES = {"ahead_mib_s": 0.0, "always_save": True, "blocks": True}
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
