"""Restoring an archive into a leased slot, when it pays: exactly the prefix the request
reuses, put together from the archive's blocks (or the whole file of an archive kept whole),
handed to llama-server (`POST /slots/{id}?action=restore`) and removed once it has read it.
The blocks' checksums are checked while the server reads the file; a damaged block empties the
slot again before the request runs, which is then prefilled.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from cacheproxy.disk.archive_types import Archive, Match, RestoreFile
from cacheproxy.disk.attached import (
    AttachedUpstream,
    DiskUnavailable,
    Saving,
    StoreCall,
    filed_under,
)
from cacheproxy.disk.blocks import MIN_ARCHIVE_TOKENS
from cacheproxy.disk.policy import (
    BRANCHED,
    Restorable,
    RestoreCosts,
    restore_cost_ms,
    restore_is_whole,
    restore_pays,
    restore_read,
    restore_seen,
)
from cacheproxy.disk.save_costs import SaveCosts, others_busy
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.ops.held_tasks import HeldTasks
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.settings import DiskTierSettings
from cacheproxy.upstreams.adapters import Requested, Scales
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.slot_table import Lease, ReuseBounds, UpstreamSlots, branch_point

log = logging.getLogger(__name__)

# the tenant's archive sharing the longest prefix with the tokens, under a fingerprint
FindArchive = Callable[[str, str, Sequence[int]], Awaitable[Match | None]]
# (tenant, fingerprint, prompt, tokens the slot gives): returns once the tenant's saves under way
# that would give the prompt a block more than that can be found by a lookup (`Saves.written`)
SavesWritten = Callable[[str, str, Sequence[int], int], Awaitable[None]]


@dataclass(frozen=True)
class Prepared:
    """What the slot holds once the disk tier is done with it, as the request will find it."""

    predicted: ReuseBounds
    isolate: bool
    action: str  # "restore", "restore_failed" or "" (nothing restored)
    branch: int | None = None  # where the request branched off the archive restored, if it did
    saving: Saving | None = None  # the commit of what the slot held, under way (`saves.py`)

    @classmethod
    def as_leased(cls, lease: Lease) -> Prepared:
        """The slot as the scheduler leased it: the disk tier changed nothing."""
        return cls(lease.predicted, lease.isolate, "")


@dataclass(frozen=True)
class Ready:
    """A restore decided on, its file made (None: it could not be: damaged, gone, no room)."""

    match: Match
    reuse: int  # the prompt tokens the server may reuse once it is restored
    made: RestoreFile | None


def restored_bytes(archive: Archive, n_tokens: int, costs: RestoreCosts) -> tuple[int, bool]:
    """What a restore of `n_tokens` of the archive reads, and whether that is put together from
    blocks first: its file or whole copy, or that prefix of it (`policy.restore_read`)."""
    kept = (archive.blocks, archive.whole_copy)
    return restore_read(archive.bytes, archive.n_tokens, n_tokens, kept, costs)


def read_copy(archive: Archive, made: RestoreFile) -> bool:
    """Whether the file the server was given is the block archive's whole copy (lent, not put
    together)."""
    return archive.blocks and not made.temporary


def restore_may_pay(lease: Lease) -> bool:
    """Whether an archive could give the leased request `MIN_ARCHIVE_TOKENS` more of its prompt
    than the slot will: when not (a conversation's next turn on its own slot, a short prompt),
    no archive is looked up."""
    return reusable_of_prompt(lease) - reused_of_slot(lease) >= MIN_ARCHIVE_TOKENS


def reused_of_slot(lease: Lease) -> int:
    """What the request reuses of the slot as it is."""
    return 0 if lease.isolate else lease.predicted.low


def reusable_of_prompt(lease: Lease) -> int:
    """What the server may reuse of the leased prompt (`reusable_of`)."""
    return reusable_of(lease.prompt)


def reusable_of(prompt: Sequence[int]) -> int:
    """What the server may reuse of a prompt: all but its last token, always decoded."""
    return max(len(prompt) - 1, 0)


def scales_to_set(lease: Lease) -> Scales | None:
    """The LoRA scales the leased slot must be given before a restore, or None: llama-server
    clears a slot for a task naming other scales than the slot's last task (a restore leaves
    them as they were), so for a request naming its scales, a slot whose last task ran under
    others (or under ones not known) is run a task under them first. A request naming none
    (the global scales) keeps what the slot holds, whatever its last task ran under."""
    if not lease.table.adapters or not lease.names_scales or lease.adapters is None:
        return None
    return None if lease.previous.adapters == lease.adapters else lease.adapters


# the token of the task that gives a slot its scales (`Restores._set_scales`): one of two ids
# every vocabulary has, the one the prompt does not start with
PRIME_TOKENS = (1, 2)


class PrimeFailed(Exception):
    """The task giving a slot its scales before a restore failed: the slot may hold its token."""


class Restores:
    """The tier's restores; store calls go through its off-on switch (`guarded`)."""

    def __init__(
        self,
        store: ArchiveStore,
        client: UpstreamClient,
        settings: DiskTierSettings,
        metrics: ProxyMetrics,
        costs: SaveCosts,
        guarded: StoreCall,
        find: FindArchive,
        written: SavesWritten,
    ) -> None:
        self.store = store
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.costs = costs
        self.guarded = guarded
        self.find = find
        self.written = written
        self._upkeep = HeldTasks()  # after restores

    async def choice(
        self, lease: Lease, attached: AttachedUpstream, tenant: str, count: bool
    ) -> tuple[Match, int, bool] | None:
        """The tenant's archive worth restoring into the leased slot, how many prompt tokens
        the server may reuse, and whether its whole copy is read (`restored_bytes`); None: none
        is. `count`: in the restore figures (not when asked before the save that comes
        first)."""
        if not restore_may_pay(lease):
            return None
        # archives of text computed under the request's LoRA scales (None: they are not known)
        fingerprint = filed_under(attached, lease.table, lease.adapters)
        if fingerprint is None:
            return None
        live, reusable = reused_of_slot(lease), reusable_of_prompt(lease)
        # an archive of this very text may be being saved from the slot it was just evicted from
        await self.written(tenant, fingerprint, lease.prompt, live)
        match = await self.find(tenant, fingerprint, lease.prompt)
        if match is None:
            return None
        reuse = min(match.n_common, reusable)
        gain = reuse - live
        if gain < MIN_ARCHIVE_TOKENS:
            return None  # the slot already holds about as much of the prompt
        costs = self.costs.rates(lease.table, attached, lease.slot.slot_id).restore_costs()
        read, assembled = restored_bytes(match.archive, reuse, costs)
        if not self._whole(attached, match.archive, reuse, assembled):
            if count:
                self.metrics.child(self.metrics.archive_restores, BRANCHED).inc()
                attached.restore_yield = restore_seen(attached.restore_yield, BRANCHED)
            return None
        if not restore_pays(gain, read, costs, assembled):
            if not attached.restore_bytes_per_ms.stale(self.settings.remeasure_s):
                if count:
                    self.metrics.child(self.metrics.archive_restores, "not_worth").inc()
                return None
            # the rate that said no is old: the disk may be fast again, and only a restore
            # can tell (at most one such request per `remeasure_s` pays the old rate)
            if count:
                self.metrics.child(self.metrics.archive_restores, "remeasure").inc()
        return match, reusable, match.archive.blocks and not assembled

    async def offered(
        self,
        tenant: str,
        prompt: Sequence[int],
        tables: Sequence[UpstreamSlots],
        attached: Mapping[int, AttachedUpstream],
        lora: Requested = None,
    ) -> dict[int, Restorable]:
        """By upstream index, the tenant's archive an attached upstream would restore for
        `prompt` into a slot holding none of it, and what that costs there now (one lookup per
        fingerprint). For the routing policy, which weighs it against what each slot holds;
        `choice` decides again once a slot is leased. Empty when the store fails (the tier
        turns itself off). `lora`: the LoRA scales the request's body names."""
        reusable = reusable_of(prompt)
        found: dict[str, Match | None] = {}
        offers: dict[int, Restorable] = {}
        for table in tables:
            upstream = attached.get(table.index)
            if upstream is None or not table.healthy:
                continue
            fingerprint = filed_under(upstream, table, table.scales_of(lora))
            if fingerprint is None:
                continue
            if fingerprint not in found:
                try:
                    found[fingerprint] = await self.find(tenant, fingerprint, prompt)
                except DiskUnavailable:
                    return {}
            match = found[fingerprint]
            tokens = 0 if match is None else min(match.n_common, reusable)
            if match is None or tokens < MIN_ARCHIVE_TOKENS:
                continue
            costs = self.costs.measured(table, upstream).restore_costs()
            read, assembled = restored_bytes(match.archive, tokens, costs)
            if self._whole(upstream, match.archive, tokens, assembled):
                offers[table.index] = Restorable(tokens, restore_cost_ms(read, costs, assembled))
        return offers

    @staticmethod
    def _whole(attached: AttachedUpstream, archive: Archive, reuse: int, assembled: bool) -> bool:
        """Whether a restore of `reuse` tokens of `archive` gives the server's own answer (a
        prefix put together holds those alone, a whole file all of it:
        `policy.restore_is_whole`)."""
        gap = 0 if assembled else archive.n_tokens - reuse
        return restore_is_whole(gap, attached.state_after_kv)

    async def ready(self, lease: Lease, attached: AttachedUpstream, tenant: str) -> Ready | None:
        """The restore the leased slot should get, its file made for the server (`restore`
        sends it); None: none pays. Nothing here touches the slot, so it may run while the slot
        is still being saved. Raises DiskUnavailable as the store calls do."""
        choice = await self.choice(lease, attached, tenant, count=True)
        if choice is None:
            return None
        match, reusable, from_copy = choice
        reuse = min(match.n_common, reusable)
        archive, tokens = match.archive, match.tokens
        made = await self.guarded(self.store.restore_file(archive, tokens, reuse, from_copy))
        return Ready(match, reuse, made)

    async def discard(self, ready: Ready | None) -> None:
        """Give back a file made for a restore that will not be sent."""
        if ready is not None and ready.made is not None:
            await self._quietly(self.guarded(self.store.release(ready.made)))

    async def restore(self, lease: Lease, attached: AttachedUpstream, ready: Ready) -> Prepared:
        """Restore what the request reuses of `ready`'s archive into the leased slot. Raises
        DiskUnavailable only before the server reads a file."""
        archive, slot, reuse, made = ready.match.archive, lease.slot, ready.reuse, ready.made
        if made is None:
            # checked before the server reads it: the slot keeps what it holds
            log.warning(
                "archive %s not restored: damaged or replaced on disk (dropped), or no room to"
                " put it together from its blocks",
                archive.id,
            )
            self.metrics.child(self.metrics.archive_restores, "failed").inc()
            return Prepared(lease.predicted, lease.isolate, "restore_failed")
        started = time.perf_counter()
        busy_before = others_busy(lease.table, slot.slot_id)
        answered = started
        try:
            try:
                await self._set_scales(lease)
                answer = await self.client.post_json(
                    lease.table.upstream,
                    f"/slots/{slot.slot_id}?action=restore",
                    {"filename": made.file_name},
                )
                answered = time.perf_counter()
            finally:
                # the blocks' checksums were checked while the server read the file
                intact = await self._intact(made)
                self._beside(self.store.release(made), "disk.restore-release")
        except PrimeFailed as exc:
            log.warning("archive %s not restored: %s", archive.id, exc)
            self.metrics.child(self.metrics.archive_restores, "failed").inc()
            # it may hold the task's one token: not the prompt's first (see `_set_scales`)
            return Prepared(ReuseBounds(0, 0), lease.isolate, "restore_failed")
        except aiohttp.ClientResponseError as exc:
            if exc.status != 400:
                raise
            # llama-server cleared the slot: the request runs cold, and the file is unusable (a
            # block archive's whole copy, maybe dropped by another proxy meanwhile, goes alone:
            # its blocks are checked apart)
            what = "whole copy of archive" if read_copy(archive, made) else "archive"
            log.warning("%s %s could not be restored (%s): dropped", what, archive.id, exc.message)
            return await self._failed(archive, made, lease, erase=False)
        if not intact:
            # the slot holds what a damaged block gave it: emptied before the request runs
            log.warning("archive %s restored from a damaged block: dropped", archive.id)
            return await self._failed(archive, made, lease, erase=True)
        restored = answer.get("n_restored")
        if restored != made.n_tokens:
            # the file held other tokens than its row says: nothing of it may be trusted
            log.warning(
                "archive %s held %s tokens, not %d: dropped", archive.id, restored, made.n_tokens
            )
            return await self._failed(archive, made, lease, erase=True)
        # the round trip around the server's read
        elapsed_ms = (answered - started) * 1000
        server_ms = self.costs.server_ran(
            lease.table,
            slot.slot_id,
            "restore",
            answer,
            elapsed_ms,
            busy_before,
            attached.restore_overhead_ms,
            attached.batch_wait_ms,
        )
        if server_ms > 0:
            attached.restore_bytes_per_ms.add(made.bytes / server_ms, self.settings.remeasure_s)
        if made.made_ms > 0:
            attached.assemble_bytes_per_ms.add(made.bytes / made.made_ms)
            self.metrics.archive_assembled_bytes.inc(made.bytes)
            self.metrics.archive_assemble_seconds.observe(made.made_ms / 1000)
        self._beside(self.store.touch(archive.id), "disk.restore-touch")
        self.metrics.child(self.metrics.archive_restores, "restored").inc()
        self.metrics.archive_restored_bytes.inc(made.bytes)
        # putting the file together counts, even when it ran beside the slot's save
        self.metrics.archive_restore_seconds.observe(
            time.perf_counter() - started + made.made_ms / 1000
        )
        branch = branch_point(archive.n_tokens, reuse)
        return Prepared(ReuseBounds(reuse, reuse), isolate=False, action="restore", branch=branch)

    async def _set_scales(self, lease: Lease) -> None:
        """Give the leased slot the request's LoRA scales where a restore needs it
        (`scales_to_set`): a one-token task under them, computed afresh, whose token is not the
        prompt's first, so that the request reuses nothing of it if no restore follows."""
        scales = scales_to_set(lease)
        if scales is None:
            return
        token = PRIME_TOKENS[0] if lease.prompt[0] != PRIME_TOKENS[0] else PRIME_TOKENS[1]
        try:
            await self.client.complete_on(
                lease.table.upstream, lease.slot.slot_id, [token], cache_prompt=False, lora=scales
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            what = f"its slot could not be given the request's LoRA scales: {exc!r}"
            raise PrimeFailed(what) from exc

    async def _failed(
        self, archive: Archive, made: RestoreFile, lease: Lease, erase: bool
    ) -> Prepared:
        """The archive dropped (its whole copy alone, when that was the file `made`: its blocks
        are checked apart), the slot emptied if need be (`erase`): the request runs cold."""
        self.metrics.child(self.metrics.archive_restores, "failed").inc()
        drop = self.store.drop_copy if read_copy(archive, made) else self.store.remove
        await self._quietly(self.guarded(drop(archive.id)))
        if erase:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await self.client.erase(lease.table.upstream, lease.slot.slot_id)
        return Prepared(ReuseBounds(0, 0), isolate=erase, action="restore_failed")

    async def _intact(self, made: RestoreFile) -> bool:
        """Whether the blocks `made` was put together from matched their checksums (a whole
        file was checked before it was lent); False too when they could not be read."""
        try:
            return await self.guarded(self.store.checked(made))
        except DiskUnavailable:
            return False

    def _beside(self, call: Awaitable[object], name: str) -> None:
        """Upkeep after the server's read, queued in the store already: it changes nothing the
        request gets, so the request goes on meanwhile; held until done (`wait_upkept`)."""
        self._upkeep.start(self._quietly(self.guarded(call)), name)

    async def wait_upkept(self, timeout_s: float | None) -> None:
        """Upkeep under way finishes (stopping), for `timeout_s` at most."""
        await self._upkeep.wait(timeout_s)

    async def _quietly(self, work: Awaitable[object]) -> None:
        """Upkeep whose failure must not change what the request gets (the tier turns off)."""
        with contextlib.suppress(DiskUnavailable):
            await work
