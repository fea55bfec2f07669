"""A small state is written by the server while the store looks up what an archive holds of it
and reserves its room (`disk/policy.py` `write_beside_lookup`), not after: the request that
evicted it waits for the longer of the two. A real llama-server (-np 1) and a real archive index.

The lookup is made slow for real, as a loaded index's worker is: the first save's turn is held
for a moment, so the tier measures a lookup far longer than the tiny model's write. To see the
write happen during a later lookup, that lookup (the real one, wrapped) waits in the worker
thread for the file it reserves room for: only a server already writing it makes it appear.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.http.app_keys import ARCHIVES, SETTINGS
from tests.support import databases
from tests.support.completions import complete
from tests.support.disk_tier import SAVED_ON_THE_PATH, conversation, disk_settings
from tests.support.metrics import sample
from tests.support.servers import StartServer, serving
from tests.support.waiting import wait_for

SLOW_LOOKUP_S = 0.3  # the first save's turn of the worker: far beyond a tiny state's write
DISK = {"always_save": True, **SAVED_ON_THE_PATH}


class WatchedLookups:
    """The index's save lookup wrapped: the first is slow, each later one waits (at most a
    minute) for the file it reserves room for, until `done` (the drain at the proxy's stop
    saves without writing beside). `seen`: whether that file was there, lookup by lookup."""

    def __init__(self, index: ArchiveIndex, folder: Path) -> None:
        self.folder = folder
        self.seen: list[bool] = []
        self.watching = True
        find_and_reserve = index.find_and_reserve

        def watched(*args: Any) -> Any:  # in the store's worker thread
            file_name = args[-1]
            if not self.seen:
                time.sleep(SLOW_LOOKUP_S)
                self.seen.append(False)
            elif self.watching:
                deadline = time.monotonic() + 60
                while not (folder / file_name).exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.seen.append((folder / file_name).exists())
            return find_and_reserve(*args)

        index.find_and_reserve = watched  # type: ignore[method-assign]

    def done(self) -> list[bool]:
        self.watching = False
        return self.seen


def slot_files(folder: Path) -> set[str]:
    return {path.name for path in folder.glob("a_*.slot")}


@contextlib.asynccontextmanager
async def one_slot_proxy(
    start_server: StartServer, tmp_path: Path
) -> AsyncIterator[tuple[str, Any, aiohttp.ClientSession, WatchedLookups]]:
    """A proxy in front of a one-slot llama-server, its save lookups watched."""
    server = start_server(parallel=1, ctx_size=4096)
    settings = disk_settings(server, tmp_path, disk=DISK)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        yield url, app, client, WatchedLookups(app[ARCHIVES].blocking, Path(server.slot_save_path))


async def test_a_small_state_is_written_while_its_room_is_reserved(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with one_slot_proxy(start_server, tmp_path) as (url, app, client, lookups):
        index, folder = app[ARCHIVES].blocking, lookups.folder
        for seed in (1, 2, 3):  # each evicts the one before from the only slot
            await complete(client, url, conversation(seed))
        # the first save measured a slow lookup; the second was written during its own
        assert lookups.done() == [False, True]
        assert sample(app, "cacheproxy_archive_writes_beside_lookup_total", outcome="kept") == 1
        assert sample(app, "cacheproxy_archive_saves_total", outcome="saved") == 2
        archives = index.list()
        assert sorted(archive.n_tokens for archive in archives) == [603, 603]
        assert slot_files(folder) == {archive.file_name for archive in archives}


async def test_a_write_the_lookup_turns_down_is_removed(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with one_slot_proxy(start_server, tmp_path) as (url, app, client, lookups):
        index, folder = app[ARCHIVES].blocking, lookups.folder
        held = conversation(1)
        await complete(client, url, held)
        await complete(client, url, conversation(2))  # saves the first (a slow lookup)
        # the first comes back, restored and answered as before (greedy): its slot then holds
        # what its archive holds, which the next eviction's lookup finds
        await complete(client, url, held)
        await complete(client, url, conversation(3))
        assert lookups.done() == [False, True, True]  # the last two written while looked up
        assert sample(app, "cacheproxy_archive_saves_total", outcome="covered") >= 1
        discarded = sample(
            app, "cacheproxy_archive_writes_beside_lookup_total", outcome="discarded"
        )
        assert discarded == 1

        def only_archives_files() -> bool:
            return slot_files(folder) == {archive.file_name for archive in index.list()}

        await wait_for(only_archives_files, "the file written for nothing is removed")
        # no room was reserved for it
        database = app[SETTINGS].archive_database()
        assert databases.query(database, "SELECT id FROM reservations") == []
