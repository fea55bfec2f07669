"""The disk tier and the upstream monitor, wired end to end on a fake llama-server: saves and
restores through the server's slot files, the start-up probes, and an upstream that goes away
and comes back. Asserted on what the upstream was sent and on the answers."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.disk.slot_file import read_slot_file
from cacheproxy.http.app_keys import ARCHIVES, CACHE
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.completions import bearer, complete
from tests.support.fake_llama_server import fake_llama_server
from tests.support.fake_stack import proxy_before
from tests.support.metrics import sample
from tests.support.waiting import wait_for

PROMPT_TOKENS = 600


def ids(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


@pytest.fixture
async def client() -> aiohttp.ClientSession:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_an_evicted_conversation_is_saved_and_restored_through_slot_files(
    client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    folder = tmp_path / "slots"
    folder.mkdir()
    async with fake_llama_server(n_slots=1, slot_save_path=folder) as fake:
        # whole files: the test reads the archive's own file, which a cut into blocks removes
        disk = {"ahead_mib_s": 0.0, "blocks": False}
        async with proxy_before(fake, tmp_path, disk=disk) as (url, app):
            first = await complete(client, url, ids(1))
            started = len(fake.received)
            await complete(client, url, ids(2))  # takes the only slot
            [archive] = app[ARCHIVES].blocking.list()
            archived = list(read_slot_file(archive.path).tokens)
            turn = [*ids(1), *first["tokens"], *ids(3, 40)]
            again = await complete(client, url, turn)
            restores = sample(app, "cacheproxy_archive_restores_total", outcome="restored")
        sent = [(r.path, r.query.get("action"), r.body) for r in fake.received[started:]]
    # the slot was saved into the archive folder before the other conversation went out
    save = ("/slots/0", "save", {"filename": archive.file_name})
    restore = ("/slots/0", "restore", {"filename": archive.file_name})
    completions = [at for at, (path, _, _) in enumerate(sent) if path == "/completion"]
    assert sent.index(save) < completions[0]
    assert completions[0] < sent.index(restore) < completions[1]
    # it holds the first conversation as the slot held it: prompt and answer, its last token
    # never decoded
    held = [*ids(1), *first["tokens"][:3]]
    assert archived == held
    assert archive.n_tokens == len(held)
    # restored, the next turn reuses all of it
    assert again["timings"]["cache_n"] == len(held)
    assert restores == 1


async def test_without_a_slot_save_path_the_disk_tier_stays_off_for_that_upstream(
    client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with fake_llama_server(n_slots=1) as fake:
        # the proxy's archive folder exists, but the server saves nowhere
        async with proxy_before(fake, tmp_path, disk={"enabled": True}) as (url, app):
            await complete(client, url, ids(1))
            await complete(client, url, ids(2))
            assert app[CACHE].disk.attached == {}
    actions = fake.slot_actions()
    # the attach probe's save was refused (501), and nothing was tried since
    assert [action for _, action, _ in actions] == ["erase", "save"]


async def test_a_server_that_empties_idle_slots_picks_the_slot_and_is_predicted(
    client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """llama-server's default topology (unified KV, idle slots emptied into the RAM cache at
    every task launch) is served: tasks go without `id_slot`, the table follows the clears, and
    the RAM cache's loads are predicted."""
    async with fake_llama_server(unified_kv=True, ram_cache=True) as fake:
        async with proxy_before(fake, tmp_path) as (url, app):
            table = app[CACHE].tables[0]
            assert table.clears_idle and table.server_picks
            first = await complete(client, url, ids(1))
            await complete(client, url, ids(2))  # launched: the first goes to the RAM cache
            assert sum(not slot.empty for slot in table.slots) == 1
            turn = [*ids(1), *first["tokens"], *ids(3, 40)]
            again = await complete(client, url, turn)
            mismatches = sample(app, "cacheproxy_predictions_total", result="mismatch")
            matches = sample(app, "cacheproxy_predictions_total", result="match")
        sent = fake.bodies("/completion")[-3:]
    assert again["timings"]["cache_n"] >= PROMPT_TOKENS  # loaded from the RAM cache
    assert all(body["id_slot"] == -1 for body in sent)
    assert (matches, mismatches) == (3, 0)


async def test_a_ram_cache_the_probe_finds_keeps_tenants_out(
    client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    with TenantRegistry(tmp_path / "tenants.db") as registry:
        _, key = registry.create("alice")
    tenants = {"database": tmp_path / "tenants.db"}
    for ram_cache, status in ((True, 503), (False, 200)):
        async with (
            fake_llama_server(ram_cache=ram_cache) as fake,
            proxy_before(fake, tmp_path / str(ram_cache), tenants=tenants) as (url, app),
        ):
            assert app[CACHE].tables[0].ram_cache_state == ("on" if ram_cache else "off")
            await complete(client, url, ids(1), bearer(key), status=status)


async def test_an_upstream_that_goes_away_is_found_down_and_rebuilt_when_back(
    client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    routing = {"health_interval_s": 0.05, "health_timeout_s": 2.0}
    async with fake_llama_server() as fake:
        async with proxy_before(fake, tmp_path, routing=routing) as (url, app):
            first = await complete(client, url, ids(1))
            table = app[CACHE].tables[0]
            assert table.slots[first["id_slot"]].n_tokens == PROMPT_TOKENS + 3

            await fake.stop()
            await wait_for(lambda: not table.healthy, "the upstream to be found down")
            assert all(slot.empty for slot in table.slots)  # nothing of it is known now
            # every upstream is down: looked at again for the request, then 502 at once
            gone = await complete(client, url, ids(2), status=502)
            assert "no upstream is reachable" in gone["error"]["message"]

            # back as a new process, its slots empty: the table is rebuilt, probe and all
            since = len(fake.received)
            await fake.restart()
            await wait_for(lambda: table.healthy, "the upstream to be found back")
            again = await complete(client, url, ids(1))
            assert again["timings"]["cache_n"] == 0
            assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 0
        probe = [body for body in fake.bodies("/completion")[-5:-1] if body["n_predict"] == 1]
        assert len(probe) == 4
        assert ("GET", "/slots") in [(r.method, r.path) for r in fake.received[since:]]
