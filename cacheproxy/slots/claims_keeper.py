"""Keeps the slot claims (cluster/slot_claims.py) true for the upstreams this proxy holds, so
that whoever holds one next knows whose text each of its slots holds.

The rule that makes a claim exact: a slot the database says holds tenant A's text is disowned
there, and the write committed, before anything that may put another tenant's text into it is
sent (`before_use`, awaited by the request between its lease and its first call upstream). A
request of A on A's slot (a conversation's next turn) writes nothing: whatever it leaves there,
cut or whole, is A's text. What a slot holds once a request has ended is written behind, from
the table: the tenant and a hint of the ids (their hashes, slots/slot_hints.py); at once when
that changes whose text the database says the slot holds, else (the same tenant's next
request: only the hint is new) by the next round, `FLUSH_S` at most later, with whatever else
changed meanwhile: a hash of the slot's ids and a write a request would otherwise cost. A proxy
that dies loses at most the writes under way and its last `FLUSH_S` of hints: the slots they
concern are then nobody's, or their hints old, never another tenant's.

One lock orders the writes: a disowning waits for a write of the same slot under way, so a
claim computed before a request took the slot can never land after the disowning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from cacheproxy.cluster.slot_claims import SlotClaim, SlotClaimStore
from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.errors import ApiError
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.supervise import repeat
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.slots.slot_hints import encode_hint, hint_of
from cacheproxy.slots.waiter import UpstreamLease
from cacheproxy.upstreams.slot_table import UNANSWERED, Lease, SlotState, UpstreamSlots

log = logging.getLogger(__name__)

# what a slot holds is written at once when its tenant changes, and every this often for the
# rest (a hint of the same tenant's ids, a table corrected from GET /slots, a whole upstream's
# request)
FLUSH_S = 0.25

SlotKey = tuple[str, int]  # (upstream URL, slot id)
UNREAD = object()  # a slot whose tenant in the database is not known here
DATABASE_FAULTS = (OSError, *DATABASE_ERRORS)  # what writing or reading the claims may raise


class SlotClaims:
    """The claims of the upstreams in `tables` (the monitor's list) this proxy holds."""

    def __init__(
        self,
        store: SlotClaimStore,
        tables: list[UpstreamSlots],
        metrics: ProxyMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.tables = tables
        self.metrics = metrics
        self.clock = clock
        # per slot, the tenant the database says holds its text (or will once a write under way
        # is committed): never one it does not say, so a disowning is never skipped
        self._durable: dict[SlotKey, str | None] = {}
        # per slot, the (tenant, version) last written: the writer skips what did not change
        self._written: dict[SlotKey, tuple[str | None, int]] = {}
        # per slot, the row last written (generation aside): a claim the database holds already
        # is not written again (the same text left by the same tenant, as a repeated request)
        self._rows: dict[SlotKey, SlotClaim] = {}
        self._lock = asyncio.Lock()
        self._owner_changed = asyncio.Event()  # a write that changes a slot's tenant is due
        # per busy slot, the lease whose prompt it holds since its first event (and the slot's
        # version then: written only while unchanged since)
        self._prefilled: dict[SlotKey, tuple[int, Lease]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """The writer, while the proxy runs."""
        self._task = asyncio.create_task(self._write_forever(), name="slot-claims-writer")

    async def stop(self) -> None:
        """Stop the writer, after a last write (the requests have ended, the drain is done)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self.flush()
        except DATABASE_FAULTS as exc:  # the next holder learns less
            log.warning("slot claims: the last write failed: %r", exc)

    def prefill_ended(self, lease: Lease) -> None:
        """The leased request's first event came: its slot holds its tenant's prompt now,
        whatever cuts the request (even one that took the slot from another tenant), so that
        is written before the request ends: at once when the database says the slot is another
        tenant's or nobody's, else by the next round (only the hint is new)."""
        slot = lease.slot
        key = (lease.table.upstream.base_url, slot.slot_id)
        self._prefilled[key] = (slot.version, lease)
        self._wake_if_owner_changes(key, slot.tenant)

    def changed(self, lease: Lease) -> None:
        """`lease`'s request ended: what its slot holds now is written, at once if that changes
        whose text the database says it holds (else by the next round)."""
        slot = lease.slot
        tenant = None if slot.empty else slot.tenant
        self._wake_if_owner_changes((lease.table.upstream.base_url, slot.slot_id), tenant)

    def _wake_if_owner_changes(self, key: SlotKey, tenant: str | None) -> None:
        if self._durable.get(key, UNREAD) != tenant:
            self._owner_changed.set()

    async def _write_forever(self) -> None:
        async def one_round() -> None:
            # a timeout scope, not `wait_for`: that wraps the wait in a task of its own; none
            # at all when an owner changed meanwhile
            if not self._owner_changed.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(FLUSH_S):
                        await self._owner_changed.wait()
            self._owner_changed.clear()
            await self.flush()

        await repeat("slot claims", one_round, pause_s=0, log=log, after_failure_s=FLUSH_S)

    # -- before a request writes into a slot ----------------------------------------------------

    async def before_use(
        self, lease: Lease | UpstreamLease, tenant: str, scheduler: SlotScheduler
    ) -> None:
        """Before anything is sent for a request of `tenant` on `lease` (a slot, or a whole
        upstream, whose server may write into any of its slots): disown the slots the database
        says hold another tenant's text. When that cannot be written, the lease is given back
        to `scheduler` unused and the request refused (503): its text must not go where a claim
        could pass it off as another's."""
        if isinstance(lease, Lease):
            table, slots = lease.table, (lease.slot,)
        else:
            table, slots = lease.table, tuple(lease.table.slots)
        url = table.upstream.base_url
        if not self._foreign(url, slots, tenant):
            return  # the common case: the tenant's own slot, or a slot nobody claims
        try:
            async with self._lock:
                stale = self._foreign(url, slots, tenant)
                if stale:
                    await self.store.adisown(url, stale, self.clock())
                    self.metrics.slot_claims_written.labels("disown").inc(len(stale))
                    for slot_id in stale:
                        self._durable[(url, slot_id)] = None
                        self._written.pop((url, slot_id), None)
                        self._rows.pop((url, slot_id), None)
        except BaseException as exc:
            if isinstance(lease, Lease):
                scheduler.release(lease, UNANSWERED)
            else:
                scheduler.release_upstream(lease, None, None)
            if not isinstance(exc, DATABASE_FAULTS):
                raise
            log.error("slot claims of %s could not be written: %r", url, exc)
            raise ApiError(
                503,
                "the proxy cannot record whose text its slots hold now (its database failed)",
                headers={"Retry-After": "1"},
            ) from exc

    def _foreign(self, url: str, slots: Sequence[SlotState], tenant: str) -> list[int]:
        durable = self._durable
        return [
            slot.slot_id
            for slot in slots
            if (owner := durable.get((url, slot.slot_id))) is not None and owner != tenant
        ]

    # -- after requests: what the slots hold, written behind ------------------------------------

    async def flush(self) -> None:
        """Write what changed in the idle slots of every healthy upstream held here."""
        async with self._lock:
            for table in self.tables:
                if not table.healthy or not table.upstream.held:
                    continue
                url = table.upstream.base_url
                changed, synced = self._claims_due(table, url)
                if not changed:
                    continue
                claims = [claim for claim, _ in changed]
                if await self.store.aclaim(url, claims, self.clock(), synced=synced):
                    self.metrics.slot_claims_written.labels("claim").inc(len(claims))
                    for claim, state in changed:
                        self._written[(url, claim.slot_id)] = state
                        self._rows[(url, claim.slot_id)] = claim

    def _claims_due(
        self, table: UpstreamSlots, url: str
    ) -> tuple[list[tuple[SlotClaim, tuple[str | None, int]]], bool]:
        """The claims of the idle slots changed since last written, each with the (tenant,
        version) it records; their tenants count as written from now on (see `_durable`). And
        whether their write must reach the disk before it counts: when one takes a slot from
        the tenant the database says holds it (or may: not read yet). A claim lost with the
        machine's power otherwise leaves its row naming the same tenant or nobody."""
        changed = []
        synced = False
        durable = self._durable
        for slot in table.slots:
            key = (url, slot.slot_id)
            if slot.busy:
                prefilled = self._prefilled.pop(key, None)
                if prefilled is not None and prefilled[0] == slot.version:
                    lease = prefilled[1]
                    claim = claim_of_prompt(slot, lease.prompt)
                    changed.append((claim, (None, -1)))  # rewritten when the request ends
                    synced = synced or durable.get(key, UNREAD) not in (None, slot.tenant)
                    durable[key] = slot.tenant
                continue  # else its request's end is written, not what it is being given
            state = (slot.tenant, slot.version)
            if self._written.get(key) == state:
                continue
            claim = claim_of(slot)
            if self._rows.get(key) == claim:  # what the database says already
                self._written[key] = state
                continue
            changed.append((claim, state))
            tenant = slot.tenant if not slot.empty else None
            synced = synced or durable.get(key, UNREAD) not in (None, tenant)
            durable[key] = tenant
        return changed, synced

    # -- a table read afresh ---------------------------------------------------------------------

    async def read(self, table: UpstreamSlots) -> dict[int, SlotClaim]:
        """What the database says of `table`'s slots (nothing when it cannot be read: then no
        slot is anybody's)."""
        try:
            return await self.store.aread(table.upstream.base_url)
        except DATABASE_FAULTS as exc:
            log.warning("slot claims of %s not read: %r", table.upstream.base_url, exc)
            return {}

    def adopted(self, table: UpstreamSlots, claims: dict[int, SlotClaim]) -> None:
        """`table` was built afresh, its slots' tenants taken from `claims` as the database holds
        them: these are what it says from now on; the writer records the table next."""
        url = table.upstream.base_url
        for slot in table.slots:
            claim = claims.get(slot.slot_id)
            self._durable[(url, slot.slot_id)] = None if claim is None else claim.tenant
            self._written.pop((url, slot.slot_id), None)
            self._rows.pop((url, slot.slot_id), None)


def claim_of_prompt(slot: SlotState, prompt: list[int]) -> SlotClaim:
    """The row recording a busy slot whose request's prompt is computed: its tenant's, holding
    that prompt (and some of what is generated after it)."""
    if not prompt:  # opaque: its ids are not known
        return SlotClaim(slot.slot_id, slot.tenant)
    hint = hint_of(prompt)
    return SlotClaim(slot.slot_id, slot.tenant, hint.n_tokens, encode_hint(hint))


def claim_of(slot: SlotState) -> SlotClaim:
    """The row recording what an idle slot holds: its tenant, and the hashes of the ids the
    table knows (or of those its hint named, while no prompt has named them here)."""
    if slot.empty:
        return SlotClaim(slot.slot_id, None)
    if slot.hint is not None:
        return SlotClaim(slot.slot_id, slot.tenant, slot.hint.n_tokens, encode_hint(slot.hint))
    if not slot.known:
        return SlotClaim(slot.slot_id, slot.tenant)
    hint = hint_of(slot.known)
    return SlotClaim(slot.slot_id, slot.tenant, hint.n_tokens, encode_hint(hint))
