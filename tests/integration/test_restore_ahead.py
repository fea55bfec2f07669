"""A restore readied while the slot it goes to is saved, against a real llama-server.

When a request takes a slot whose text is archived first, the archive it will restore is looked
up and its file made for the server meanwhile (the save and the restore each wait for the
server in turn; the lookup and the file need only the archive). The spies below call through to
the real store and server: they only record, or hold the save until the restore's file exists,
which the work done one after the other never lets happen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.http.app_keys import ARCHIVES, CACHE
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
    tier,
)
from tests.support.metrics import proxy_counters
from tests.support.mounts import remountable
from tests.support.servers import StartServer, serving
from tests.support.waiting import wait_for

SAVED = 'cacheproxy_archive_saves_total{outcome="saved"}'
RESTORED = 'cacheproxy_archive_restores_total{outcome="restored"}'


def then_set(call: Callable[..., Awaitable[Any]], event: asyncio.Event) -> Callable[..., Any]:
    """`call`, calling through, and `event` set once it has returned."""

    async def calling(*args: Any) -> Any:
        result = await call(*args)
        event.set()
        return result

    return calling


def record_lending(disk: Any, made_after: asyncio.Event | None = None) -> tuple[list, list]:
    """Spies on `disk`'s store, calling through: the files made for restores (lent), made only
    once `made_after` is set if given, and the files given back."""
    lent: list[Any] = []
    given_back: list[Any] = []
    restore_file, release = disk.store.restore_file, disk.store.release

    async def making(*args: Any) -> Any:
        if made_after is not None:
            await made_after.wait()
        lent.append(result := await restore_file(*args))
        return result

    async def releasing(made: Any) -> None:
        given_back.append(made)
        await release(made)

    disk.store.restore_file = making
    disk.store.release = releasing
    return lent, given_back


async def test_the_restore_is_made_ready_while_the_evicted_slot_is_saved(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    async with (
        serving(disk_settings(server, tmp_path, disk=SAVED_ON_THE_PATH)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        first = conversation(1)
        answer = await complete(client, url, first)
        await evict_with_others(client, url, range(100, 102))  # the first is archived
        before = await proxy_counters(client, url)

        disk = tier(app)
        made = asyncio.Event()
        post_json = disk.client.post_json

        async def posting(upstream: Any, path: str, body: dict) -> Any:
            if "action=save" in path:
                # one after the other, the restore's file is made only once this save ended
                await asyncio.wait_for(made.wait(), 20)
            return await post_json(upstream, path, body)

        disk.store.restore_file = then_set(disk.store.restore_file, made)  # type: ignore[method-assign]
        disk.client.post_json = posting  # type: ignore[method-assign]
        again = await complete(client, url, next_turn(first, answer, 2))

        # the slot's text was saved, then the first conversation restored over it
        after = await proxy_counters(client, url)
        assert after[SAVED] == before[SAVED] + 1
        assert after[RESTORED] == before.get(RESTORED, 0) + 1
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3


async def test_a_restore_readied_beside_a_failed_save_gives_its_file_back(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(**TWO_SLOTS)
    # whole files: the restore lends the archive's own file, which a read-only folder allows;
    # cut into blocks in the background meanwhile, its file would be put together in the
    # folder and fail as the save does, as the cut's pace on the machine decides
    disk = {"recheck_interval_s": 60, "blocks": False, **SAVED_ON_THE_PATH}
    settings = disk_settings(server, tmp_path, disk=disk)
    with remountable(server.slot_save_path) as mount:
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
            first = conversation(1)
            answer = await complete(client, url, first)
            await evict_with_others(client, url, range(100, 102))

            disk = tier(app)
            lent, given_back = record_lending(disk)
            # the server cannot write the save: the tier turns off, the slot is left as it was
            mount.read_only()
            again = await complete(client, url, next_turn(first, answer, 2))
            assert not disk.available
            assert again["timings"]["cache_n"] < PROMPT_TOKENS  # not restored

            # the archive's file was lent for the restore and given back, not left lent
            await wait_for(lambda: len(given_back) == 1)
            assert lent == given_back and lent[0] is not None
            counters = await proxy_counters(client, url)
            assert counters.get(RESTORED, 0) == 0
            mount.writable()


async def test_a_restore_whose_archive_left_to_make_room_for_the_save_is_looked_for_again(
    start_server: StartServer, tmp_path: Path
) -> None:
    # room for one archive: saving the slot the returning conversation takes evicts that
    # conversation's own archive. Made after the save's room was made, its file cannot be:
    # the restore is looked for again, as if the save had come first (none is left), and no
    # restore is counted as failed.
    server = start_server(**TWO_SLOTS)
    settings = disk_settings(server, tmp_path, disk={"budget_mib": 1, **SAVED_ON_THE_PATH})
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        first = conversation(1)
        answer = await complete(client, url, first)
        await evict_with_others(client, url, range(100, 102))
        assert archived(app[ARCHIVES].blocking) == [("default", PROMPT_TOKENS + 3)]

        disk = tier(app)
        committed = asyncio.Event()
        restore_file = disk.store.restore_file

        async def making(*args: Any) -> Any:
            await asyncio.wait_for(committed.wait(), 20)  # the save's room is made first
            return await restore_file(*args)

        disk.store.commit = then_set(disk.store.commit, committed)  # type: ignore[method-assign]
        disk.store.restore_file = making  # type: ignore[method-assign]
        again = await complete(client, url, next_turn(first, answer, 2))

        counters = await proxy_counters(client, url)
        assert counters.get('cacheproxy_archive_restores_total{outcome="failed"}', 0) == 0
        assert counters.get(RESTORED, 0) == 0
        # the slot's text was archived in the first conversation's place
        store = app[ARCHIVES].blocking
        [archive] = store.list()
        assert store.tokens(archive.id)[:PROMPT_TOKENS] != first
        assert again["timings"]["cache_n"] < PROMPT_TOKENS


async def test_a_restore_given_back_is_given_back_before_the_drain(
    start_server: StartServer, tmp_path: Path
) -> None:
    """The restore's file is still being made when its request ends (its save failed) and the
    proxy stops: the stop waits for the file to be made and given back before it drains the
    slots (no file made for the server is left lent). The file is made only once the stop is
    under way (a spy on the first step of the stop lets it go)."""
    server = start_server(**TWO_SLOTS)
    # whole files: an archive cut into blocks in the background meanwhile or not would make
    # its restore's file, or lend its own, as the cut's pace on the machine decides
    disk = {"recheck_interval_s": 60, "blocks": False, **SAVED_ON_THE_PATH}
    settings = disk_settings(server, tmp_path, disk=disk)
    stopping = asyncio.Event()
    given_back_at_drain: list[int] = []
    with remountable(server.slot_save_path) as mount:
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
            first = conversation(1)
            answer = await complete(client, url, first)
            await evict_with_others(client, url, range(100, 102))

            disk, layer = tier(app), app[CACHE]
            lent, given_back = record_lending(disk, made_after=stopping)
            drain = disk.drain

            async def draining(*args: Any) -> Any:
                given_back_at_drain.append(len(given_back))
                return await drain(*args)

            disk.drain = draining  # type: ignore[method-assign]
            layer.unpinned.wait_settled = then_set(layer.unpinned.wait_settled, stopping)  # type: ignore[method-assign]
            mount.read_only()  # the save fails: the readied restore is not sent
            again = await complete(client, url, next_turn(first, answer, 2))
            assert again["timings"]["cache_n"] < PROMPT_TOKENS  # not restored
            assert lent == given_back == []  # its file is still to be made
        mount.writable()
    assert given_back_at_drain == [1]
    assert len(given_back) == 1 and lent == given_back


async def test_a_next_turn_on_the_slot_holding_its_conversation_looks_up_no_archive(
    start_server: StartServer, tmp_path: Path
) -> None:
    # no archive could give it more than its slot does: no restore is readied for it (no task,
    # no lookup); a prompt the slot does not hold gets one
    server = start_server(**TWO_SLOTS)
    async with (
        serving(disk_settings(server, tmp_path)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        restores = tier(app)._restores
        readied: list[int] = []
        ready = restores.ready

        def readying(lease: Any, attached: Any, tenant: str) -> Any:
            readied.append(len(lease.prompt))
            return ready(lease, attached, tenant)

        restores.ready = readying  # type: ignore[method-assign]
        first = conversation(1)
        answer = await complete(client, url, first)
        assert readied == [len(first)]  # a slot holding none of it

        again = await complete(client, url, next_turn(first, answer, 2))
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3  # its slot served it
        assert readied == [len(first)]
