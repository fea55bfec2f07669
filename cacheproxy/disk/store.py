"""The disk tier's storage: archived slot states as files in one folder, indexed in SQLite or
PostgreSQL (`cacheproxy.db`; several proxies may share a PostgreSQL index and one folder).

Each archive is a llama-server slot save file (`slot_file.py`) named by an opaque id, plus a row
holding its tenant, its exact token ids and a compatibility fingerprint. No HTTP here: the
caller asks llama-server to write `reservation.path` (its `--slot-save-path` must be this
folder) and to read `archive.path`; the store only decides and remembers.

Two faces of one store:

- `ArchiveIndex`, blocking: for the command line and anything else without an event loop. It is
  safe to share between threads (one lock around one connection). Its parts, each a module of
  one job: the schema and the opened index (`archive_schema`), the lookups and listings
  (`archive_reads`), the quota transactions (`archive_quotas`), recovery and repair
  (`archive_repair`), what they hold and which leave for room (`archive_room`), archives as
  blocks of KV cells (`archive_blocks`); the values and errors they share are in
  `archive_types`, the packed tokens and block hashes in `blocks`.
- `ArchiveStore`, what the service holds (one per process): the same calls as coroutines, each
  run in the store's own worker thread, as Datasette's `Database.execute_fn` runs its own, so
  neither the index nor the folder is ever touched on the event loop and no caller hops threads.
  One worker: the index has one connection, used one operation at a time, so calls are taken
  in the order they were made (queued when awaited; `commit`, `release` and `touch` when
  called, so that work a request need not wait for can run beside it, and anything asked
  after it still finds it done). Lookups (`find`, a restore's, on a request's path) run on a
  thread and a connection of their own, once the commits asked before them are done, not
  queued behind the worker's other work. Work on files that takes long runs beside it, each
  index call of it under the index's lock: cutting saved archives into blocks (one at a time,
  in the order saved), and putting restores together from blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from cacheproxy.disk.archive_blocks import Conversion
from cacheproxy.disk.archive_reads import archive_listing
from cacheproxy.disk.archive_restore_files import ArchiveRestoreFiles
from cacheproxy.disk.archive_types import (
    Archive,
    Committed,
    FoundRoom,
    Match,
    RecoveryReport,
    Reservation,
    RestoreFile,
    Sharing,
    Usage,
    unlink_files,
)
from cacheproxy.disk.eviction import EvictionPolicy
from cacheproxy.disk.slot_file import SlotFileHeader, SlotKvLayout, read_kv_layout, read_slot_file
from cacheproxy.settings import MIB, Settings

T = TypeVar("T")

# restores put together from blocks at once (each reads its blocks and writes one file)
RESTORE_WORKERS = 2


class ArchiveIndex(ArchiveRestoreFiles):
    """The archive store, blocking: archived slot states in `directory`, indexed in `database`
    (a SQLite file or a PostgreSQL URL). Opening it migrates the schema.

    `eviction` chooses which archives leave when a quota or `budget_bytes` is hit;
    `min_free_bytes`: room a save must leave free on the folder's file system beyond the
    state's expected size; `shared`: several proxies write the folder and the index;
    `blocks`: saved archives are cut into blocks (`convert`; the async store does it);
    `checked_blocks`: the blocks whose files have not changed since their checksums matched.
    """

    @classmethod
    def from_settings(cls, settings: Settings, eviction: EvictionPolicy) -> ArchiveIndex:
        """The folder and index `settings` name, with their budget and limits."""
        return cls(
            settings.archive_directory(),
            settings.archive_database(),
            eviction,
            settings.disk.budget_mib * MIB,
            busy_timeout_s=settings.disk.busy_timeout_s,
            min_free_bytes=int(settings.disk.min_free_mib * MIB),
            shared=settings.cluster.enabled,  # other proxies' reservations judged by age alone
            blocks=settings.disk.blocks,
            whole_copies=settings.disk.whole_copies,
        )


class ArchiveStore:
    """The archive store as the service uses it: `ArchiveIndex`'s calls as coroutines, run in
    the store's worker thread. Open it with `ArchiveStore.open`; `blocking` is the index itself
    (for tests, and for reads where no event loop waits)."""

    def __init__(
        self,
        index: ArchiveIndex,
        worker: ThreadPoolExecutor,
        lookups: ArchiveIndex,
        looking_up: ThreadPoolExecutor,
    ) -> None:
        self.blocking = index
        self._worker = worker
        self._lookups = lookups  # the index on a connection of its own, in `looking_up`
        self._looking_up = looking_up
        # commits queued and not yet done, with their tenants
        self._commits: dict[asyncio.Future[Committed], str] = {}
        self._cutting = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="archive-blocks", initializer=lowest_cpu_priority
        )
        self._assembling = ThreadPoolExecutor(
            max_workers=RESTORE_WORKERS, thread_name_prefix="archive-restores"
        )
        self.conversions_pending = 0  # archives waiting to be cut into blocks, or being cut
        # set by whoever could not run `recover` at start-up; the disk tier runs it once it can
        self.recovery_pending = False

    @classmethod
    async def open(cls, open_index: Callable[[], ArchiveIndex]) -> ArchiveStore:
        """The store of the index `open_index` opens, in the store's worker thread (connecting
        and migrating wait on the database too)."""
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive-store")
        looking_up = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive-lookups")
        try:
            index = await _in_thread(worker, open_index)
            try:
                lookups = await _in_thread(looking_up, index.lookups)
            except BaseException:
                await _in_thread(worker, index.close)
                raise
        except BaseException:
            worker.shutdown(wait=False)
            looking_up.shutdown(wait=False)
            raise
        return cls(index, worker, lookups, looking_up)

    async def close(self) -> None:
        """Close the index once the file work under way is done (the cuts not begun are left
        for the next start: their archives stay whole files until then)."""
        try:
            for files in (self._cutting, self._assembling):
                await self._run(functools.partial(files.shutdown, cancel_futures=True))
            await _in_thread(self._looking_up, self._lookups.close)
            await self._run(self.blocking.close)
        finally:
            self._looking_up.shutdown(wait=False)
            self._worker.shutdown(wait=False)

    async def _run(self, call: Callable[..., T], *args: Any) -> T:
        return await _in_thread(self._worker, call, *args)

    # -- where things are (no I/O) -------------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self.blocking.directory

    @property
    def database(self) -> str:
        """The index as messages name it (a URL without its password)."""
        return self.blocking.database

    @property
    def quarantine_directory(self) -> Path:
        return self.blocking.quarantine_directory

    def path_for(self, file_name: str) -> Path:
        return self.blocking.path_for(file_name)

    @property
    def spare_bytes(self) -> int | None:
        """The folder's spare room as the index last counted it, for a save, a cut or a restore
        (`ArchiveIndex.spare_bytes`)."""
        return self.blocking.spare_bytes

    # -- lookups and listings ------------------------------------------------------------------

    async def find(self, tenant_id: str, fingerprint: str, tokens: Sequence[int]) -> Match | None:
        """The tenant's archive sharing the longest prefix with `tokens` (`ArchiveIndex.find`),
        among those committed by then and those whose commits were asked before (only the
        tenant's own are waited for: no other's work decides how long its lookup takes)."""
        earlier = [commit for commit, owner in self._commits.items() if owner == tenant_id]
        if earlier:
            await asyncio.wait(earlier)
        find = self._lookups.find
        return await _in_thread(self._looking_up, find, tenant_id, fingerprint, tokens)

    async def intact(self, archive: Archive, tokens: Sequence[int]) -> bool:
        """Whether the archive's file is still the one saved (`ArchiveIndex.intact`)."""
        return await self._run(self.blocking.intact, archive, tokens)

    async def usage_by_tenant(self) -> dict[str, Usage]:
        return await self._run(self.blocking.usage_by_tenant)

    async def usage_and_sharing(self) -> tuple[dict[str, Usage], dict[str, Sharing]]:
        """Both, in one turn of the worker (the gauges after every save read them)."""
        blocking = self.blocking
        return await self._run(lambda: (blocking.usage_by_tenant(), blocking.sharing_by_tenant()))

    async def listing(self, tenant_id: str | None = None) -> dict[str, Any]:
        """Archives, oldest first, with their totals and the budget (`archive_listing`)."""
        return await self._run(archive_listing, self.blocking, tenant_id)

    # -- saving: reserve, let llama-server write the file, commit (or abort) -------------------

    async def find_and_reserve(
        self,
        tenant_id: str,
        fingerprint: str,
        tokens: Sequence[int],
        room_for: Callable[[Match | None], int | None],
        quota_bytes: int | None,
        quota_archives: int | None,
        file_name: str | None = None,
    ) -> FoundRoom:
        """`ArchiveIndex.find_and_reserve`, in one turn of the worker (`room_for` runs there)."""
        call = self.blocking.find_and_reserve
        return await self._run(
            call, tenant_id, fingerprint, tokens, room_for, quota_bytes, quota_archives, file_name
        )

    async def reserve(
        self,
        tenant_id: str,
        expected_bytes: int,
        quota_bytes: int | None,
        quota_archives: int | None,
    ) -> Reservation:
        return await self._run(
            self.blocking.reserve, tenant_id, expected_bytes, quota_bytes, quota_archives
        )

    def commit(
        self,
        reservation: Reservation,
        tokens: Sequence[int] | None,
        actual_bytes: int,
        fingerprint: str,
    ) -> asyncio.Future[Committed]:
        """Queued in the worker when called, not when awaited: whatever the store is asked
        after this call finds the archive (a save's commit runs beside its request)."""
        call = self.blocking.commit
        committing = _submit(self._worker, call, reservation, tokens, actual_bytes, fingerprint)
        # a lookup of the tenant's asked from now on waits for it (`find`)
        self._commits[committing] = reservation.tenant_id
        committing.add_done_callback(self._commits.pop)
        return committing

    async def abort(self, reservation: Reservation) -> None:
        await self._run(self.blocking.abort, reservation)

    # -- blocks: saved archives cut, restores put together -------------------------------------

    @property
    def cuts_blocks(self) -> bool:
        return self.blocking.blocks

    async def convert(self, archive_id: str) -> Conversion | None:
        """Cut a saved archive into blocks (`ArchiveIndex.convert`), after those saved before."""
        self.conversions_pending += 1
        try:
            return await _in_thread(self._cutting, self.blocking.convert, archive_id)
        finally:
            self.conversions_pending -= 1

    async def unconverted(self) -> list[str]:
        return await self._run(self.blocking.unconverted)

    async def restore_file(
        self,
        archive: Archive,
        archive_tokens: Sequence[int],
        n_tokens: int,
        from_copy: bool = False,
    ) -> RestoreFile | None:
        """A file for llama-server to restore `n_tokens` of the archive from
        (`ArchiveIndex.restore_file`); give it back with `release`."""
        return await _in_thread(
            self._assembling,
            self.blocking.restore_file,
            archive,
            archive_tokens,
            n_tokens,
            from_copy,
        )

    async def checked(self, restore: RestoreFile) -> bool:
        """Whether the blocks `restore` was put together from are intact
        (`ArchiveIndex.checked`: the check runs meanwhile, this waits for it). A whole file
        was checked before it was lent: no turn in a thread, which the restore waits for."""
        if not restore.temporary:
            return True
        return await _in_thread(self._assembling, self.blocking.checked, restore)

    def release(self, restore: RestoreFile) -> asyncio.Future[None]:
        """Queued in the worker when called (as `commit`): run beside the request."""
        return _submit(self._worker, self.blocking.release, restore)

    async def unlink(self, paths: Iterable[Path]) -> int:
        """Remove files the store released (`paths_to_unlink`); a missing one is fine. None to
        remove (most saves): no turn in the worker's queue, which a save waits for."""
        paths = tuple(paths)
        if not paths:
            return 0
        return await self._run(unlink_files, paths)

    # -- upkeep --------------------------------------------------------------------------------

    def touch(self, archive_id: str) -> asyncio.Future[bool]:
        """Queued in the worker when called (as `commit`): run beside the request."""
        return _submit(self._worker, self.blocking.touch, archive_id)

    async def remove(self, archive_id: str) -> bool:
        return await self._run(self.blocking.remove, archive_id)

    async def drop_copy(self, archive_id: str) -> bool:
        return await self._run(self.blocking.drop_copy, archive_id)

    # -- attaching an upstream: its probe files and its fingerprint ----------------------------

    async def slot_file(self, file_name: str) -> SlotFileHeader | None:
        """The header of the slot file `file_name` in the folder; None if there is none.
        Raises SlotFileError for a file that is not a slot file."""
        return await self._run(_slot_file_header, self.path_for(file_name))

    async def kv_layout(self, file_name: str) -> SlotKvLayout:
        """The KV layout of the slot file `file_name` in the folder (`read_kv_layout`)."""
        return await self._run(read_kv_layout, self.path_for(file_name))

    async def discard(self, file_name: str) -> None:
        """Remove a file that was never an archive (a probe), if the folder lets it."""
        await self._run(_unlink_quietly, self.path_for(file_name))

    async def note_fingerprint(self, fingerprint: str, facts: Mapping[str, Any]) -> None:
        await self._run(self.blocking.note_fingerprint, fingerprint, facts)

    async def relabel(self, old: str, new: str, fits: Callable[[Path], bool]) -> int:
        """Index under `new` the archives under `old` whose file `fits` (called in the worker
        thread: it may read the file)."""
        return await self._run(self.blocking.relabel, old, new, fits)

    # -- health --------------------------------------------------------------------------------

    async def check(self) -> None:
        """Raise OSError or a database error unless a save could work now."""
        await self._run(self.blocking.check)

    async def recover(self) -> RecoveryReport:
        """Make the index and the folder agree again (`ArchiveIndex.recover`)."""
        return await self._run(self.blocking.recover)

    async def verify(self) -> None:
        """Raise ArchiveIndexUnusable unless the index file is intact."""
        await self._run(self.blocking.verify)


def lowest_cpu_priority() -> None:
    """Run the calling thread at the lowest CPU priority (on Linux nice is a thread's own): the
    cuts into blocks are background work, which must yield the cores to the server beside the
    proxy and to the event loop. Elsewhere nothing changes (a thread id is no process id
    there)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


async def _in_thread(worker: ThreadPoolExecutor, call: Callable[..., T], *args: Any) -> T:
    return await _submit(worker, call, *args)


def _submit(worker: ThreadPoolExecutor, call: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    # the call sees the context variables of the code that submits it, as on the loop
    context = contextvars.copy_context()
    loop = asyncio.get_running_loop()
    return loop.run_in_executor(worker, functools.partial(context.run, call, *args))


def _slot_file_header(path: Path) -> SlotFileHeader | None:
    if not path.exists():
        return None
    return read_slot_file(path)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only folder keeps the probe: recover skips it
        path.unlink()
