"""The disk tier under real faults: it turns itself off, never fails a request, and comes back.

The faults are real: a read-only bind mount over the archive folder, a 2 MiB tmpfs that fills,
another connection holding the archive index's write lock, the folder deleted, and another
model's weights copied over the model file. Clients must get llama-server's own answers all the
while (the requests just run without archiving or restoring).
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.http.app_keys import ARCHIVES
from cacheproxy.provision.make_model import ensure_model
from tests.support.completions import complete
from tests.support.disk_tier import (
    PROMPT_TOKENS,
    TWO_SLOTS,
    conversation,
    disk_settings,
    evict_with_others,
    next_turn,
    tier,
)
from tests.support.metrics import proxy_counters
from tests.support.mounts import remountable, small_tmpfs
from tests.support.restarts import found_under_a_request
from tests.support.servers import LlamaServer, StartServer, serving

RECHECK_S = 0.3
SAVED = 'cacheproxy_archive_saves_total{outcome="saved"}'


def fault_settings(server: LlamaServer, tmp_path: Path, **disk: Any) -> Any:
    return disk_settings(
        server,
        tmp_path,
        disk={"recheck_interval_s": RECHECK_S, "busy_timeout_s": 0.5, "min_free_mib": 0, **disk},
    )


async def saved(client: aiohttp.ClientSession, url: str) -> float:
    return (await proxy_counters(client, url)).get(SAVED, 0)


async def cut_already(client: aiohttp.ClientSession, url: str) -> None:
    """Until every archive saved so far is cut into blocks: the cutter writes and removes files
    in the folder meanwhile, and a deletion listing it then fails on a file already gone. The
    cutter runs at the lowest CPU priority: on a busy machine it may take a while."""
    for _ in range(1200):
        counters = await proxy_counters(client, url)
        if not counters.get("cacheproxy_archive_conversions_pending"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("archives still being cut into blocks after 60 s")


async def comes_back(client: aiohttp.ClientSession, url: str, app: Any, seeds: range) -> None:
    """After the cause went: within a few requests the tier is on and archiving again."""
    await asyncio.sleep(RECHECK_S * 2)
    before = await saved(client, url)
    await evict_with_others(client, url, seeds)
    assert await saved(client, url) > before
    assert tier(app).available


async def test_a_read_only_archive_folder_turns_the_tier_off_not_the_requests(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    with remountable(server.slot_save_path) as mount:
        async with (
            serving(fault_settings(server, tmp_path)) as (url, app),
            aiohttp.ClientSession() as client,
        ):
            first = conversation(1)
            answer = await complete(client, url, first)
            await evict_with_others(client, url, range(100, 102))
            assert await saved(client, url) >= 1

            mount.read_only()
            # the first save fails and turns the tier off; it stays off (its check cannot write
            # a file), so the first conversation's archive is not restored: its next turn is
            # llama-server's normal answer, computed in full (the slots hold others' text)
            await evict_with_others(client, url, range(200, 204))
            again = await complete(client, url, next_turn(first, answer, 2))
            assert again["timings"]["cache_n"] == 0
            assert not tier(app).available
            counters = await proxy_counters(client, url)
            assert counters.get('cacheproxy_archive_restores_total{outcome="restored"}', 0) == 0

            mount.writable()
            await comes_back(client, url, app, range(300, 303))


@pytest.mark.parametrize("blocks", [False, True], ids=["whole files", "blocks"])
async def test_a_full_archive_file_system_evicts_for_room_and_keeps_archiving(
    start_server: StartServer, tmp_path: Path, blocks: bool
) -> None:
    server = start_server(**TWO_SLOTS)
    with small_tmpfs(server.slot_save_path, "2m"):  # room for about three 600-token states
        # kept as blocks, as many saves are archived: a cut waits for room beside the file
        settings = fault_settings(server, tmp_path, min_free_mib=0.05, blocks=blocks)
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
            conversations = {seed: conversation(seed) for seed in range(1, 11)}
            answers = {}
            for seed, prompt in conversations.items():
                answers[seed] = await complete(client, url, prompt)
            # every eviction was archived: the oldest archives left to make room on the disk
            assert await saved(client, url) >= 8
            assert tier(app).available
            # the one before last leaves its slot to a text too short to keep (archived, the
            # oldest leaving for room), so that it comes back into that slot with no save beside
            # its restore: on this disk a save and a restore of one request compete for the
            # last room, and which gets it is the order of two threads
            await complete(client, url, conversation(1001, 20))
            assert await saved(client, url) >= 9
            # the latest evicted one comes back from disk
            again = await complete(client, url, next_turn(conversations[9], answers[9], 99))
            assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3
            assert len(app[ARCHIVES].blocking.list()) <= 3


async def test_an_index_locked_past_the_busy_timeout_serves_without_archiving(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    async with (
        serving(fault_settings(server, tmp_path)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        await evict_with_others(client, url, range(1, 4))
        before = await saved(client, url)
        holder = sqlite3.connect(tmp_path / "archive.db", isolation_level=None)
        try:
            holder.execute("BEGIN EXCLUSIVE")  # another process's write lock, held
            await evict_with_others(client, url, range(100, 104))
            assert not tier(app).available
            assert await saved(client, url) == before
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        await comes_back(client, url, app, range(200, 203))


async def test_a_deleted_archive_folder_is_made_again(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    async with (
        serving(fault_settings(server, tmp_path)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        first = conversation(1)
        answer = await complete(client, url, first)
        await evict_with_others(client, url, range(100, 102))
        await cut_already(client, url)
        shutil.rmtree(server.slot_save_path)
        again = await complete(client, url, next_turn(first, answer, 2))
        assert again["timings"]["cache_n"] == 0  # its archive is gone: prefilled
        await evict_with_others(client, url, range(200, 202))
        await comes_back(client, url, app, range(300, 303))
        assert server.slot_save_path.is_dir()


async def test_other_weights_under_the_same_path_never_get_the_old_archives(
    start_server: StartServer, tiny_model: Path, tmp_path: Path
) -> None:
    other_model = ensure_model("small", seed=4321)  # same shape and metadata, other weights
    model_path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, model_path)
    server = start_server(model=model_path, **TWO_SLOTS)
    settings = fault_settings(server, tmp_path)
    first = conversation(1)
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        answer = await complete(client, url, first)
        await evict_with_others(client, url, range(100, 102))
    follow_up = next_turn(first, answer, 2)

    # what the other model answers, straight from a llama-server of its own
    reference = start_server(model=other_model, **TWO_SLOTS)
    async with aiohttp.ClientSession() as client:
        direct = await complete(client, reference.url, follow_up)
    reference.stop()

    server.stop()
    shutil.copyfile(other_model, model_path)
    other = start_server(model=model_path, port=server.port, **TWO_SLOTS)
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        again = await complete(client, url, follow_up)
    assert again["timings"]["cache_n"] == 0  # the archive was not restored
    assert again["tokens"] == direct["tokens"] and again["content"] == direct["content"]

    # the same weights again find their archive: the fingerprint is stable across starts
    other.stop()
    shutil.copyfile(tiny_model, model_path)
    start_server(model=model_path, port=server.port, **TWO_SLOTS)
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        again = await complete(client, url, follow_up)
    assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3


async def test_other_weights_found_under_requests_never_get_the_old_archives(
    start_server: StartServer, tiny_model: Path, tmp_path: Path
) -> None:
    """The server comes back at once with other weights under the same path, and the proxy
    finds the new process by its slots' task ids while a request already runs on it: the table
    is emptied in place (the upstream kept in service), and the disk tier attaches to the new
    process afresh, fingerprint and all, before it archives or restores anything there."""
    other_model = ensure_model("small", seed=4321)  # same shape and metadata, other weights
    model_path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, model_path)
    server = start_server(model=model_path, **TWO_SLOTS)
    # no check looks on its own: only the request path, and `wake` below as a misprediction
    settings = fault_settings(server, tmp_path)
    settings.routing.health_interval_s = settings.routing.reconcile_interval_s = 3600
    settings.routing.recheck_idle_s = 0
    first = conversation(1)
    reference = start_server(model=other_model, **TWO_SLOTS)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        answer = await complete(client, url, first)
        await evict_with_others(client, url, range(100, 102))
        follow_up = next_turn(first, answer, 2)
        direct = await complete(client, reference.url, follow_up)  # what the other weights say
        server.stop()
        shutil.copyfile(other_model, model_path)
        start_server(model=model_path, port=server.port, **TWO_SLOTS)
        # as long as the slot's context allows: running through what follows, on a slow machine
        long_body = {"prompt": conversation(20, 64), "n_predict": 4000, "ignore_eos": True}
        long_answer = asyncio.create_task(client.post(url + "/completion", json=long_body))
        await found_under_a_request(app, long_answer)
        again = await complete(client, url, follow_up)
        (await long_answer).release()
    reference.stop()
    assert again["timings"]["cache_n"] == 0  # the archive was not restored
    assert again["tokens"] == direct["tokens"] and again["content"] == direct["content"]
