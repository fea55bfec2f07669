"""Saving a slot into a new archive of its owner: room reserved within its quota, the file
written by llama-server (`POST /slots/{id}?action=save`), the archive committed to the index.

A request that evicts a slot waits for the file only. Its commit is queued in the store's
worker the moment the server has answered, so every store call made after it (a lookup, a
listing, another save) finds the archive, and it runs while the request is restored and sent;
the request's answer waits for it before it is given (`Prepared.saving`, slots/stages.py), so
what a request evicted is archived, or known not to be, once the request has its answer. A save
awaited whole (a move, the shutdown drain) waits for the commit too.

Until its commit is queued, a save is under way (`written`): a request of the same tenant whose
prompt it would serve (an agent's next turn, sent the moment its slot was given to another
conversation) waits for it before its restore is looked up, rather than find no archive and
prefill what is being saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from cacheproxy.disk.archive_types import (
    Archive,
    ArchiveError,
    ArchiveRefused,
    Committed,
    Match,
    QuotaExceeded,
    Reservation,
    new_file_name,
)
from cacheproxy.disk.attached import (
    AttachedUpstream,
    DiskUnavailable,
    Saving,
    StoreCall,
    filed_under,
)
from cacheproxy.disk.blocks import MIN_ARCHIVE_TOKENS
from cacheproxy.disk.save_costs import SaveCosts, others_busy
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.ops.held_tasks import HeldTasks
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.settings import DiskTierSettings
from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.rates import Smoothed
from cacheproxy.upstreams.slot_table import SlotContent, UpstreamSlots

log = logging.getLogger(__name__)

EVICTED_REMEMBERED = 1024  # ids of archives evicted for room, the latest ones

Quotas = Callable[[str], tuple[int | None, int | None]]  # tenant id -> (bytes, archives)


@dataclass(frozen=True)
class Written:
    """A slot's file as llama-server wrote it for a reservation, not yet an archive."""

    reservation: Reservation
    answer: dict  # the server's answer to the save
    started: float  # perf_counter when the save began (its room reserved)
    slot_id: int
    attached: AttachedUpstream


@dataclass(eq=False)
class UnderWay:
    """A save whose commit is not queued yet: whose text, and when it is queued (or given up)."""

    owner: str
    fingerprint: str
    tokens: Sequence[int]
    queued: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Saves:
    """Saves of slots into archives, their commits held until done (`wait_committed`); store
    calls go through the tier's off-on switch (`guarded`)."""

    def __init__(
        self,
        store: ArchiveStore,
        client: UpstreamClient,
        settings: DiskTierSettings,
        metrics: ProxyMetrics,
        quotas: Quotas,
        costs: SaveCosts,
        guarded: StoreCall,
        archived: Callable[[Archive], None],
    ) -> None:
        self.store = store
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.quotas = quotas
        self.costs = costs
        self.guarded = guarded
        self.archived = archived  # told of every archive committed (to cut it, to charge it)
        # archives lately evicted for room or replaced by a save: a restore readied beside that
        # save may have chosen one (gone, not damaged)
        self.evicted_for_room: OrderedDict[str, None] = OrderedDict()
        self._committing = HeldTasks()  # commits, and files written beside a lookup removed
        self._under_way: set[UnderWay] = set()
        # a save's turn of the store's worker (lookup and room), as its request waits for it
        self.lookup_ms = Smoothed(0.0, prior=True)
        self._writing_beside = 0  # bytes the server is writing beside lookups, not yet reserved

    async def save(
        self, table: UpstreamSlots, slot_id: int, content: SlotContent, attached: AttachedUpstream
    ) -> Archive | None:
        """Save the slot into a new archive of `content.owner`, within its quota, and wait for
        its commit. Raises DiskUnavailable when the folder or the index failed (before the
        server wrote the file, the slot is unchanged)."""
        saving = await self.start(table, slot_id, content, attached)
        return None if saving is None else await asyncio.shield(saving)

    async def start(
        self, table: UpstreamSlots, slot_id: int, content: SlotContent, attached: AttachedUpstream
    ) -> Saving | None:
        """Have the server write the slot's file within the owner's quota and queue its commit:
        the task committing it, or None when no file was written. Raises DiskUnavailable when
        the folder or the index failed (the slot is unchanged)."""
        owner = content.owner
        fingerprint = filed_under(attached, table, content.adapters)
        if owner is None or fingerprint is None:
            return None
        started = time.perf_counter()
        quota_bytes, quota_archives = self.quotas(owner)
        expected = self._expected_bytes(content, attached)
        with self._saving(owner, fingerprint, content):
            try:
                reservation = await self.guarded(
                    self.store.reserve(owner, expected, quota_bytes, quota_archives)
                )
            except ArchiveError as exc:  # larger than a quota allows, or than the free disk
                self._no_room(table, slot_id, exc)
                return None
            return await self._send(
                table, slot_id, content, attached, fingerprint, reservation, started
            )

    async def start_if(
        self,
        table: UpstreamSlots,
        slot_id: int,
        content: SlotContent,
        attached: AttachedUpstream,
        worth: Callable[[int], bool],
        write_beside: bool = False,
    ) -> Saving | None:
        """`start`, if `worth(archived)` holds, `archived` being how many of the content's first
        tokens an archive of its owner holds: the lookup, the choice and the room in one turn of
        the store's worker, which a save on a request's path waits for once instead of twice
        (`worth` runs in that thread: it must be pure). A content not exactly known is looked up
        as none held. `write_beside`: the server writes the file meanwhile, under the name the
        room is then reserved for (`policy.write_beside_lookup`); a write the lookup turns down
        is removed once the server is done with it."""
        owner = content.owner
        fingerprint = filed_under(attached, table, content.adapters)
        if owner is None or fingerprint is None:
            return None
        if content.unknown_tail != 0:
            return await self.start(table, slot_id, content, attached) if worth(0) else None
        started = time.perf_counter()
        quota_bytes, quota_archives = self.quotas(owner)
        expected = self._expected_bytes(content, attached)

        def room_for(match: Match | None) -> int | None:
            return expected if worth(0 if match is None else match.n_common) else None

        with self._saving(owner, fingerprint, content):
            file_name = new_file_name()
            writing = None
            if write_beside:
                writing = asyncio.create_task(
                    self._post_save(table, slot_id, attached, file_name), name="disk.save-write"
                )
                writing.add_done_callback(self._retrieve)
                self._writing_beside += expected
            try:
                found = await self.guarded(
                    self.store.find_and_reserve(
                        owner,
                        fingerprint,
                        content.known,
                        room_for,
                        quota_bytes,
                        quota_archives,
                        file_name,
                    )
                )
            except BaseException:
                self._discard(writing, file_name)
                raise
            finally:
                if writing is not None:  # reserved now, or to be removed
                    self._writing_beside -= expected
            self.lookup_ms.add((time.perf_counter() - started) * 1000)
            if writing is not None:
                kept = "discarded" if found.reservation is None else "kept"
                self.metrics.child(self.metrics.archive_writes_beside, kept).inc()
            if found.reservation is None:
                self._discard(writing, file_name)
                if found.refused is not None:
                    self._no_room(table, slot_id, found.refused)
                return None
            return await self._send(
                table, slot_id, content, attached, fingerprint, found.reservation, started, writing
            )

    def beside_room(self) -> tuple[float, int | None]:
        """What a write beside the lookup is weighed on (`policy.write_beside_lookup`): a save's
        turn of the store's worker, as measured, and the room the archive folder has to spare
        as the index last counted it, less the writes beside lookups not yet reserved (None:
        not counted yet)."""
        spare = self.store.spare_bytes
        return self.lookup_ms.value, None if spare is None else spare - self._writing_beside

    async def written(
        self, owner: str, fingerprint: str, prompt: Sequence[int], beyond: int
    ) -> None:
        """Once the saves under way of `owner`'s text that would give `prompt`
        `MIN_ARCHIVE_TOKENS` more than `beyond` tokens have queued their commits (a lookup then
        finds their archives) or given up: no longer than the server's write, which the request
        that evicted the text waits for too. Only the owner's own saves are waited for: no
        request's wait depends on another tenant's text."""
        pending = [
            save.queued
            for save in self._under_way
            if save.owner == owner
            and save.fingerprint == fingerprint
            and common_prefix_length(save.tokens, prompt) >= beyond + MIN_ARCHIVE_TOKENS
        ]
        if pending:
            self.metrics.archive_saves_awaited.inc()
            await asyncio.wait(pending)

    @contextlib.contextmanager
    def _saving(self, owner: str, fingerprint: str, content: SlotContent) -> Iterator[None]:
        """The save of `content` under way (`written`) until its commit is queued or it gives
        up. Only its known tokens are compared with a prompt (an answer's ids the proxy was not
        given are not): what the archive holds is at least that."""
        save = UnderWay(owner, fingerprint, content.known)
        self._under_way.add(save)
        try:
            yield
        finally:
            self._under_way.discard(save)
            save.queued.set_result(None)

    async def wait_committed(self, timeout_s: float | None) -> None:
        """Commits under way finish (stopping: before the drain and the store's close), for
        `timeout_s` at most."""
        await self._committing.wait(timeout_s)

    @staticmethod
    def _retrieve(task: asyncio.Task) -> None:
        """A commit's or a write's failure, seen by whoever awaits it (an awaited save, the
        request) if anyone does: never reported as not retrieved."""
        if not task.cancelled():
            task.exception()

    @staticmethod
    def _expected_bytes(content: SlotContent, attached: AttachedUpstream) -> int:
        return max(int(content.n_tokens_at_least * attached.bytes_per_token.value), 1)

    def _no_room(self, table: UpstreamSlots, slot_id: int, exc: ArchiveError) -> None:
        log.info("not archiving slot %d of %s: %s", slot_id, table.upstream.base_url, exc)
        self.metrics.child(self.metrics.archive_saves, "over_quota").inc()

    async def _send(
        self,
        table: UpstreamSlots,
        slot_id: int,
        content: SlotContent,
        attached: AttachedUpstream,
        fingerprint: str,
        reservation: Reservation,
        started: float,
        writing: asyncio.Task[dict] | None = None,
    ) -> Saving | None:
        """The server asked to write the reserved file (`writing`: asked already), and its
        commit queued: the task committing it, or None when no file was written."""
        written = await self._write(table, slot_id, attached, reservation, started, writing)
        if written is None:
            return None
        tokens = content.known if content.unknown_tail == 0 else None
        if tokens is not None and written.answer.get("n_saved") != len(tokens):
            tokens = None  # the slot held something else: trust the file
        try:
            n_written = int(written.answer["n_written"])
        except (KeyError, TypeError, ValueError) as exc:
            await self._dropped(written, exc)
            return None
        # queued now: whatever the store is asked after this finds the archive
        commit = self.store.commit(written.reservation, tokens, n_written, fingerprint)
        saving = self._committing.start(self._commit(written, commit), "disk.save-commit")
        saving.add_done_callback(self._retrieve)
        return saving

    async def _write(
        self,
        table: UpstreamSlots,
        slot_id: int,
        attached: AttachedUpstream,
        reservation: Reservation,
        started: float,
        writing: asyncio.Task[dict] | None,
    ) -> Written | None:
        """The reserved file written by the server (`writing`: the write asked already, the
        files of the archives that left for room removed meanwhile); None when it was not (the
        room given back)."""
        self._remember_gone(reservation.evicted_ids)
        try:
            await self.guarded(self.store.unlink(reservation.paths_to_unlink))
            if writing is None:
                answer = await self._post_save(table, slot_id, attached, reservation.file_name)
            else:
                answer = await self._written_beside(writing, table, slot_id, attached, reservation)
        except DiskUnavailable:
            self.metrics.child(self.metrics.archive_saves, "failed").inc()
            await self._quietly(self.guarded(self.store.abort(reservation)))
            self._discard(writing, reservation.file_name)  # the server may still write it
            raise
        # the server's answer was unusable (no store error is among these)
        except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            log.warning("archiving slot %d of %s failed: %r", slot_id, table.upstream.base_url, exc)
            self.metrics.child(self.metrics.archive_saves, "failed").inc()
            await self.guarded(self.store.abort(reservation))
            if isinstance(exc, aiohttp.ClientResponseError) and exc.status >= 500:
                # llama-server could not write the file: if our folder is at fault, turn off
                await self.guarded(self.store.check())
            return None
        return Written(reservation, answer, started, slot_id, attached)

    async def _post_save(
        self, table: UpstreamSlots, slot_id: int, attached: AttachedUpstream, file_name: str
    ) -> dict:
        """The server's answer to writing the slot into `file_name`, its cost noted."""
        posted = time.perf_counter()
        busy_before = others_busy(table, slot_id)
        answer = await self.client.post_json(
            table.upstream, f"/slots/{slot_id}?action=save", {"filename": file_name}
        )
        elapsed_ms = (time.perf_counter() - posted) * 1000
        self.costs.server_ran(
            table,
            slot_id,
            "save",
            answer,
            elapsed_ms,
            busy_before,
            attached.save_overhead_ms,
            attached.batch_wait_ms,
        )
        return answer

    async def _written_beside(
        self,
        writing: asyncio.Task[dict],
        table: UpstreamSlots,
        slot_id: int,
        attached: AttachedUpstream,
        reservation: Reservation,
    ) -> dict:
        """The server's answer to a write begun beside the lookup. One it could not finish is
        asked again if archives left to make room for it: on a full file system it began
        before their files were gone."""
        try:
            return await writing
        except aiohttp.ClientResponseError as exc:
            if exc.status < 500 or not reservation.paths_to_unlink:
                raise
        return await self._post_save(table, slot_id, attached, reservation.file_name)

    def _discard(self, writing: asyncio.Task[dict] | None, file_name: str) -> None:
        """A write begun beside the lookup and not kept: its file removed once the server is
        done with it (removed before, it would be written again after). Nobody waits for it
        but the shutdown (`wait_committed`)."""
        if writing is None:
            return
        path = self.store.path_for(file_name)

        async def remove() -> None:
            await asyncio.wait([writing])  # a failed write leaves at most part of a file
            await self._quietly(self.guarded(self.store.unlink([path])))

        self._committing.start(remove(), "disk.save-discard")

    async def _commit(self, written: Written, commit: Awaitable[Committed]) -> Archive | None:
        """The archive of `written` once its queued `commit` is done; None if not kept.
        Raises DiskUnavailable when the index failed (the reservation is given back)."""
        slot_id = written.slot_id
        try:
            committed = await self.guarded(commit)
        except ArchiveRefused as exc:  # too short, or media: commit released the reservation
            log.info("slot %d not archived: %s", slot_id, exc)
            self.metrics.child(self.metrics.archive_saves, "refused").inc()
            return None
        except QuotaExceeded as exc:  # over quota once its true size was known
            log.info("archive of slot %d dropped: %s", slot_id, exc)
            self.metrics.child(self.metrics.archive_saves, "over_quota").inc()
            return None
        except ArchiveError as exc:  # the file is not what the table said, or it came too late
            log.warning("archive of slot %d dropped: %s", slot_id, exc)
            self.metrics.child(self.metrics.archive_saves, "failed").inc()
            return None
        except DiskUnavailable:  # the tier has turned itself off
            self.metrics.child(self.metrics.archive_saves, "failed").inc()
            await self._quietly(self.guarded(self.store.abort(written.reservation)))
            raise
        self._remember_gone((*committed.replaced_ids, *committed.evicted_ids))
        await self._quietly(self.guarded(self.store.unlink(committed.paths_to_unlink)))
        archive = committed.archive
        attached = written.attached
        if archive.n_tokens:
            attached.bytes_per_token.add(archive.bytes / archive.n_tokens)
        with contextlib.suppress(KeyError, TypeError, ValueError):  # no timings: no sample
            attached.save_bytes_per_ms.add(
                archive.bytes / float(written.answer["timings"]["save_ms"]),
                self.settings.remeasure_s,
            )
        self.metrics.child(self.metrics.archive_saves, "saved").inc()
        self.metrics.archive_saved_bytes.inc(archive.bytes)
        self.metrics.archive_save_seconds.observe(time.perf_counter() - written.started)
        self.archived(archive)
        return archive

    async def _dropped(self, written: Written, exc: Exception) -> None:
        """A file written but not usable as the server described it: given back."""
        log.warning("archiving slot %d failed: %r", written.slot_id, exc)
        self.metrics.child(self.metrics.archive_saves, "failed").inc()
        await self.guarded(self.store.abort(written.reservation))

    def _remember_gone(self, archive_ids: tuple[str, ...]) -> None:
        for archive_id in archive_ids:
            self.evicted_for_room[archive_id] = None
        while len(self.evicted_for_room) > EVICTED_REMEMBERED:
            self.evicted_for_room.popitem(last=False)

    async def _quietly(self, work: Awaitable[object]) -> None:
        """Upkeep whose failure must not change what the request gets (the tier turns off)."""
        with contextlib.suppress(DiskUnavailable):
            await work
