"""The disk tier's I/O: archive a slot before it is overwritten, restore an archive when it pays.

llama-server writes and reads the files (`POST /slots/{id}?action=save|restore`) in its
`--slot-save-path`, which must be the archive store's folder (on several hosts, each host's
mount of one shared folder); the store decides names, quotas and matches in its index
(`cacheproxy.disk.store`, whose calls run in its own worker thread), and
`cacheproxy.disk.policy` decides what is worth it. Work happens on a slot the request has
leased, so no other request waits for it.

The tier degrades, never fails a request: an I/O or database error (a read-only or full folder,
a deleted folder, an index locked past the busy timeout) turns it off, requests run without
archiving or restoring, and the next request after `disk.recheck_interval_s` checks the folder
and the index again and turns it back on when they work.

Here: preparing a leased slot, and the off-on switch the work goes through. Beside it, going
through the same switch: saving (`saves`: the request waits for the server's write, the commit
runs beside it), restoring (`restores`), cutting saved archives into blocks in the
background (`conversions`), attaching an upstream (`attach`: probe, fingerprint), moving a
conversation between upstreams (`move`), the shutdown drain (`drain`), what they share
(`attached`); and what the tier asks: whether a slot's content is saved when a request takes
the slot (`evicted`), what the cost model is told (`save_costs`) and decides (`policy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.disk.archive_types import Archive, Match
from cacheproxy.disk.attach import Attacher
from cacheproxy.disk.attached import AttachedUpstream, DiskUnavailable, Saving, filed_under
from cacheproxy.disk.conversions import Conversions
from cacheproxy.disk.drain import DrainReport, drain_slots
from cacheproxy.disk.evicted import EvictedSaves, kept_in_slot, ram_cache_holds, ram_cache_keeps
from cacheproxy.disk.move import MoveSources, move_here, other_upstreams
from cacheproxy.disk.policy import CARRIED, LOST, Restorable, restore_seen, restores_carry
from cacheproxy.disk.restores import Prepared, Ready, Restores, restore_may_pay
from cacheproxy.disk.save_costs import SaveCosts, others_busy
from cacheproxy.disk.saves import Quotas, Saves
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.ops.held_tasks import HeldTasks
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.tracing import NO_TRACING, RequestTracer
from cacheproxy.settings import DiskTierSettings
from cacheproxy.upstreams.adapters import Requested
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.slot_table import (
    Lease,
    ReuseBounds,
    SlotContent,
    SlotState,
    UpstreamSlots,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class DiskTier:
    def __init__(
        self,
        store: ArchiveStore,
        client: UpstreamClient,
        settings: DiskTierSettings,
        metrics: ProxyMetrics,
        quotas: Quotas,
        on_archived: Callable[[str, int], None] | None = None,
        tracer: RequestTracer = NO_TRACING,
    ) -> None:
        self.store = store
        self.tracer = tracer
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.quotas = quotas
        self.on_archived = on_archived  # (tenant id, bytes): the usage ledger counts them
        self.attached: dict[int, AttachedUpstream] = {}
        self._off_until: float | None = None  # monotonic; None while the tier works
        self._off_reason = ""
        self._pending: set[int] = set()  # upstreams to attach once the tier works again
        # upstreams whose server process no archive is of use to (`_judge`)
        self._given_up: set[int] = set()
        self._recheck = asyncio.Lock()
        self._given_back = HeldTasks()  # files of readied restores not sent
        self._attacher = Attacher(store, client, settings, metrics, self._io)
        self.costs = SaveCosts(settings, metrics)  # what the save cost model is told
        self._conversions = Conversions(store, metrics, self._io)
        self._saves = Saves(
            store, client, settings, metrics, quotas, self.costs, self._io, self._archived
        )
        self._evicted = EvictedSaves(
            settings, metrics, self.costs, self._saves.start_if, self._saves.beside_room
        )
        self._restores = Restores(
            store, client, settings, metrics, self.costs, self._io, self._find, self._saves.written
        )
        if store.recovery_pending:
            # nothing may be saved before the index and the folder agree again
            self._off_reason = "start-up recovery could not run"
            self._off_until = time.monotonic()

    # -- health: off on any I/O or database error, back on once a check passes ----------------

    @property
    def available(self) -> bool:
        return self._off_until is None

    async def _io(self, call: Awaitable[T]) -> T:
        """Await a store call; an I/O or database error turns the tier off (DiskUnavailable)."""
        try:
            return await call
        except (OSError, *DATABASE_ERRORS) as exc:
            self._turn_off(exc)
            raise DiskUnavailable(str(exc)) from exc

    async def _find(self, tenant_id: str, fingerprint: str, tokens: Sequence[int]) -> Match | None:
        """The tenant's archive sharing the longest prefix with `tokens`, if any."""
        return await self._io(self.store.find(tenant_id, fingerprint, tokens))

    async def _quietly(self, work: Awaitable[object]) -> None:
        """Upkeep whose failure must not change what the request gets (the tier turns off)."""
        with contextlib.suppress(DiskUnavailable):
            await work

    def _turn_off(self, exc: BaseException) -> None:
        if self._off_until is None:
            log.warning(
                "disk tier off (archive folder %s, index %s): %r; requests run without archiving"
                " until a check every %.0f s passes",
                self.store.directory,
                self.store.database,
                exc,
                self.settings.recheck_interval_s,
            )
        self._off_reason = repr(exc)
        self._off_until = time.monotonic() + self.settings.recheck_interval_s

    async def usage_bytes(self) -> dict[str, int]:
        """Archive bytes by tenant."""
        usage = await self._io(self.store.usage_by_tenant())
        return {tenant_id: used for tenant_id, (used, _) in usage.items()}

    async def ready(self) -> bool:
        """Whether the tier works now; when off and due, check the folder and index again."""
        if self._off_until is None:
            return True
        if time.monotonic() < self._off_until:
            return False
        async with self._recheck:
            if self._off_until is None:
                return True
            try:
                await self.store.check()
                # whatever happened meanwhile (a deleted folder): the index follows the folder
                report = await self.store.recover()
                self.store.recovery_pending = False
            except (OSError, *DATABASE_ERRORS) as exc:
                self._off_reason = repr(exc)
                self._off_until = time.monotonic() + self.settings.recheck_interval_s
                return False
            self._off_until = None
            log.warning("disk tier back on (%s)", report if report.changed else "nothing to mend")
        return True

    # -- upstreams -----------------------------------------------------------------------------

    async def attach(self, table: UpstreamSlots, slot_id: int | None = None) -> bool:
        """Use the disk tier on `table`'s upstream if it saves into the archive folder, probing
        `slot_id` (default: an empty slot, or the first; no request may be running on it) for
        that and for the compatibility fingerprint (`attach.Attacher`). When the archive folder
        or index fails, the upstream is attached once the tier works again (`prepare`, on a slot
        the request leased).
        """
        self.attached.pop(table.index, None)
        self._pending.discard(table.index)
        self._given_up.discard(table.index)
        if await self.ready():
            try:
                await self._io(self.store.check())
            except DiskUnavailable:
                pass
        if not self.available:
            self._pending.add(table.index)
            log.warning(
                "disk tier off for %s until %s works (%s)",
                table.upstream.base_url,
                self.store.directory,
                self._off_reason,
            )
            return False
        try:
            attached = await self._attacher.attach(table, slot_id)
        except DiskUnavailable:
            self._pending.add(table.index)
            return False
        if attached is None:
            return False
        self.attached[table.index] = attached
        self._conversions.sweep_once()  # archives a restart left whole
        return True

    def detach(self, table: UpstreamSlots) -> None:
        self.attached.pop(table.index, None)

    def attach_again(self, table: UpstreamSlots) -> None:
        """Another server process on `table`'s upstream, its slots in use: nothing is archived
        from it or restored into it until it is attached afresh (its fingerprint taken again),
        on the slot the next request leases (`prepare`); one the tier gave up on (`_judge`)
        too: the new process may be of use."""
        given_up = table.index in self._given_up
        self._given_up.discard(table.index)
        if self.attached.pop(table.index, None) is not None or given_up:
            self._pending.add(table.index)

    def restore_answered(self, table: UpstreamSlots, cache_n: int) -> None:
        """A request ran on a slot of `table` the tier had restored into, and the server reused
        `cache_n` of its prompt (none: `_judge`)."""
        attached = self.attached.get(table.index)
        if attached is None:
            return
        outcome = CARRIED if cache_n > 0 else LOST
        attached.restore_yield = restore_seen(attached.restore_yield, outcome)
        if outcome == LOST:
            self.metrics.child(self.metrics.archive_restores, "recomputed").inc()
            self._judge(table, attached)

    def _judge(self, table: UpstreamSlots, attached: AttachedUpstream) -> None:
        """Where no archive is of use (`policy.restores_carry`: restores recomputed whole, as
        a sliding-window model's are without `--swa-full`, or requests that all branch off
        states restored whole or not at all), the upstream is served without the tier, nothing
        saved from it or restored into it, until its next process."""
        seen = attached.restore_yield
        if restores_carry(seen) or self.attached.get(table.index) is not attached:
            return
        del self.attached[table.index]
        self._given_up.add(table.index)
        log.warning(
            "disk tier off for %s until it restarts: no restore there was reused (%d recomputed"
            " whole by the server, %d not made: the request branched off a state restored whole"
            " or not at all); a sliding-window model needs --swa-full, and requests that continue"
            " its conversations (docs/disk-tier.md)",
            table.upstream.base_url,
            seen.lost,
            seen.branched,
        )

    def archives_from(self, table_index: int) -> int | None:
        """The fewest tokens a slot of upstream `table_index` must hold for the tier to archive
        it at eviction (`disk.min_tokens`); None where it archives nothing: an upstream that
        saves no slots into the archive folder (`prepare` leaves its slots as they are)."""
        if table_index in self.attached or table_index in self._pending:
            return self.settings.min_tokens
        return None

    # -- around a request on a slot --------------------------------------------------------------

    async def prepare(
        self,
        lease: Lease,
        tenant: str,
        cache_prompt: bool,
        sources: MoveSources | None = None,
    ) -> Prepared:
        """Archive what the leased slot held if it is worth keeping; then restore the tenant's
        best archive into it if that beats what the slot would reuse, after saving the
        conversation from an idle slot of another upstream of `sources` if that pays (a move)."""
        unchanged = Prepared.as_leased(lease)
        if not await self.ready():
            return unchanged
        if lease.table.index in self._pending:
            version = lease.slot.version
            await self.attach(lease.table, lease.slot.slot_id)
            if lease.slot.version != version:  # the probe could not give the slot back
                return Prepared(ReuseBounds(0, 0), isolate=True, action="")
        attached = self.attached.get(lease.table.index)
        if attached is None:
            return unchanged
        kept = kept_in_slot(lease)
        slot_id = lease.slot.slot_id
        attached.busy_when_placed.add(others_busy(lease.table, slot_id))
        # the restore's lookup and its file are made while the slot is saved (they read only
        # the archive); a move first may archive a better one, so with one it waits its turn
        restoring = cache_prompt and restore_may_pay(lease)  # else no archive can beat the slot
        ahead = None
        if sources is not None and not any(
            other_upstreams(lease, attached, sources, self.attached)
        ):
            sources = None  # nowhere to move from
        if restoring and sources is None:
            ahead = asyncio.create_task(
                self._restores.ready(lease, attached, tenant), name="disk.restore-ahead"
            )
        try:
            with self.tracer.span("disk.save"):
                saving = await self._save_evicted(
                    lease, tenant, cache_prompt, kept, attached, ahead
                )
        except BaseException as exc:
            self._give_back(ahead)
            if isinstance(exc, DiskUnavailable):
                return unchanged  # a save that failed changed nothing in the slot
            raise
        prepared = unchanged
        if restoring:
            prepared = await self._restore(lease, attached, tenant, sources, ahead)
            self._judge(lease.table, attached)  # the request may have branched off an archive
        # the answer waits for the commit (it runs meanwhile)
        return prepared if saving is None else dataclasses.replace(prepared, saving=saving)

    async def _restore(
        self,
        lease: Lease,
        attached: AttachedUpstream,
        tenant: str,
        sources: MoveSources | None,
        ahead: asyncio.Task[Ready | None] | None,
    ) -> Prepared:
        """The tenant's best archive restored into the leased slot, if it beats what the slot
        keeps (`ahead`: readied while the slot was saved); after a move from `sources`."""
        unchanged = Prepared.as_leased(lease)
        if sources is not None:
            # a failed move changes nothing here: the request still gets the best archive
            move = move_here(lease, attached, tenant, sources, self.attached, self._find, self.save)
            await self._quietly(move)
        try:
            with self.tracer.span("disk.restore") as stage:
                if ahead is None:
                    ready = await self._restores.ready(lease, attached, tenant)
                else:
                    try:
                        ready = await asyncio.shield(ahead)  # cancelled, it still gives back
                    except BaseException:
                        self._give_back(ahead)
                        raise
                    if ready is not None and ready.made is None:
                        if ready.match.archive.id in self._saves.evicted_for_room:
                            # it left to make room for a save (this slot's, maybe): look again
                            ready = await self._restores.ready(lease, attached, tenant)
                # from here the restore owns the file made for it, and gives it back
                prepared = unchanged
                if ready is not None:
                    prepared = await self._restores.restore(lease, attached, ready)
                stage.set(action=prepared.action or None)
                return prepared
        except DiskUnavailable:
            # raised only before the server reads a file: once it has, upkeep is best-effort
            return unchanged

    async def restorable(
        self,
        tenant: str,
        prompt: Sequence[int],
        tables: Sequence[UpstreamSlots],
        lora: Requested = None,
    ) -> dict[int, Restorable]:
        """By upstream index, the tenant's archive the tier would restore for `prompt` (its body
        naming the LoRA scales `lora`) there, and its cost (`Restores.offered`); none while the
        tier is off."""
        if not self.attached or not await self.ready():
            return {}
        return await self._restores.offered(tenant, prompt, tables, self.attached, lora)

    async def _save_evicted(
        self,
        lease: Lease,
        tenant: str,
        cache_prompt: bool,
        kept: int,
        attached: AttachedUpstream,
        ahead: asyncio.Task[Ready | None] | None,
    ) -> Saving | None:
        """Archive what the leased slot held if it is worth keeping (`ahead`: the restore
        being readied meanwhile, which the choice beside a server RAM cache depends on); once
        the server has written it, the commit under way."""
        slot_id = lease.slot.slot_id
        ram_keeps = ram_cache_keeps(lease, self.settings.min_tokens)
        if ram_keeps and cache_prompt and not ram_cache_holds(lease):
            # a restore overwrites the slot without the server copying it to RAM first
            # (server-context.cpp, SLOT_RESTORE): then only a copy there already counts
            if ahead is not None:
                ram_keeps = await asyncio.shield(ahead) is None
            else:
                restores = await self._restores.choice(lease, attached, tenant, count=False)
                ram_keeps = restores is None
        if ram_keeps:
            return await self._evicted.archive_beside_ram_cache(
                lease.table, slot_id, lease.previous, kept, attached
            )
        return await self._evicted.archive_if_worth(
            lease.table, slot_id, lease.previous, kept, attached, evicted_by=tenant
        )

    def _give_back(self, ahead: asyncio.Task[Ready | None] | None) -> None:
        """A readied restore that will not be sent: its file is given back once it is made
        (the making runs on a thread and is let finish)."""
        if ahead is None:
            return
        if ahead.done() and (ahead.cancelled() or ahead.exception() is not None):
            return

        async def give_back() -> None:
            with contextlib.suppress(Exception):
                await self._restores.discard(await ahead)

        self._given_back.start(give_back(), "disk.restore-given-back")

    async def wait_settled(self, timeout_s: float | None) -> None:
        """Commits of saves and upkeep after restores under way finish, and readied restores
        that were not sent give their files back (stopping: before the drain, so no file made
        for the server is left lent), for `timeout_s` at most."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        await self._saves.wait_committed(left())
        await self._restores.wait_upkept(left())
        await self._given_back.wait(left())

    async def wait_cut(self, timeout_s: float | None) -> None:
        """The archives saved so far, the drain's too, cut into blocks (stopping: after the
        drain), for `timeout_s` at most; those left stay whole files until the next start."""
        await self._conversions.wait(timeout_s)

    async def archived_prefix(
        self, table: UpstreamSlots, content: SlotContent, attached: AttachedUpstream
    ) -> int:
        """How many of `content`'s first tokens (held on `table`) an archive of its owner holds
        (0: none, or not exactly known)."""
        fingerprint = filed_under(attached, table, content.adapters)
        if content.unknown_tail != 0 or content.owner is None or fingerprint is None:
            return 0
        found = await self._find(content.owner, fingerprint, content.known)
        return 0 if found is None else found.n_common

    def _archived(self, archive: Archive) -> None:
        """A save committed: only what no archive of the tenant holds is kept (cut into blocks),
        and the usage ledger charges it."""
        self._conversions.cut(archive.id)
        if self.on_archived is not None:
            self.on_archived(archive.tenant_id, archive.bytes)

    async def save(
        self,
        table: UpstreamSlots,
        slot_id: int,
        content: SlotContent,
        attached: AttachedUpstream,
    ) -> Archive | None:
        """Save the slot into a new archive of `content.owner`, within its quota (`Saves.save`).

        Raises DiskUnavailable when the folder or the index failed."""
        return await self._saves.save(table, slot_id, content, attached)

    # -- shutdown ------------------------------------------------------------------------------

    async def drain(
        self,
        tables: list[UpstreamSlots],
        owner_of: Callable[[SlotState], str | None],
        deadline: float | None = None,
    ) -> DrainReport:
        """Archive every idle slot worth keeping (at shutdown, when no request runs), until
        `deadline` (`time.monotonic()`; None: no limit); what could not be archived is in the
        report (`drain.drain_slots`)."""
        if not await self.ready():
            log.warning("drain: the disk tier is off (folder or index failing): no slot archived")
            return DrainReport()
        return await drain_slots(
            tables,
            owner_of,
            deadline,
            self.attached,
            self.settings.min_tokens,
            self._evicted.archive_worth_keeping,
        )
