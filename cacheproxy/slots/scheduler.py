"""Hands slots to requests: one request per slot, bounded per-tenant queues, the policy's choice.

The proxy never pins a slot that is busy: llama-server would defer the task, and, with its RAM
cache on, snapshot and possibly overwrite the running slot's KV while deferring. So a slot is
leased to one request at a time, and a request that finds no slot waits here, not upstream.

Waiting requests are kept per tenant and ordered by the fair queue (fair_queue.py): it decides
whose request goes next, the routing policy which slot it gets. A tenant may keep only so many
requests waiting (`TenantQueueFull`, 429), and all tenants together `max_queue` (`Overloaded`,
503); when the whole queue is full, the tenant with the most waiting gives way to one with fewer.
A waiter may take an idle slot only within its tenant's share of the slots while other tenants
are active (slot_share.py): a flooding tenant never takes the slot another's next request needs.

The scheduler is the one writer of slot state: who holds a slot, what it holds, its lease. The
executor and the disk tier read it (through leases, which they cannot change) and hand their
findings back through the methods below: a finished request's outcome, the disk tier's
preparation of a slot, a whole upstream's report, a correction from `GET /slots`.

It stays one module (over 500 lines): every way a slot is taken, refused and given back (a
request, a whole upstream, a probe, a background save) changes the same busy flags and the same
queue, and must wake the same dispatch; split, each part would reach into the others' state.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cacheproxy.slots.chunked_prefill import in_chunks, yields_to
from cacheproxy.slots.fair_queue import EQUAL_SHARE, FairQueue, Share
from cacheproxy.slots.routing import (
    QueueUntilFree,
    RouteRequest,
    RoutingPolicy,
    SlotCandidate,
    UpstreamView,
    UseSlot,
    WaitForSlot,
)
from cacheproxy.slots.slot_share import TenantSlots, may_take
from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.ram_shadow import RamPrediction
from cacheproxy.upstreams.rates import MIN_PREFILL_SAMPLE_TOKENS
from cacheproxy.upstreams.slot_table import (
    NO_REUSE,
    UNKNOWN,
    Lease,
    ReuseBounds,
    SlotContent,
    SlotState,
    Smoothed,
    TaskOutcome,
    UpstreamSlots,
    branch_point,
    written_slots,
)

# a tenant's last requests that reused a text count most in how often its requests continue one
LINEAGE_WEIGHT = 0.1


class Overloaded(Exception):
    """The queue is full: the client should come back later (503 with Retry-After)."""


class TenantQueueFull(Exception):
    """The tenant has as many requests waiting as it may: it should come back later (429 with
    Retry-After); other tenants are not affected."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoUpstream(Exception):
    """Every upstream went away while the request waited."""


@dataclass(frozen=True)
class UpstreamLease:
    """Every slot of one upstream, held by a request whose slot use cannot be pinned."""

    table: UpstreamSlots
    queued_s: float
    tenant: str
    # every slot holds this tenant's text or nothing: the server may reuse whatever it picks
    clean: bool
    # the slots holding anyone else's text, and what they hold (the disk tier may archive it)
    foreign: tuple[Lease, ...] = ()


@dataclass(eq=False)
class _Waiter:
    prompt: list[int]
    tenant: str
    session: str | None
    cache_prompt: bool
    exclusive: bool
    arrived: float
    public_prefix_length: int = 0  # the prompt starts with an admin's public prefix this long
    opaque: bool = False  # the prompt's ids are not known
    future: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    wait_deadline: float | None = None  # set while waiting for one busy slot
    patient: bool = True  # False: never wait for a busy slot (its siblings may hold it)
    share: Share = EQUAL_SHARE  # frozen: one default serves every waiter, none is built
    slot_id: int | None = None  # the slot the client named (`id_slot`), when it may choose

    def may_wait(self, now: float) -> bool:
        return self.patient and (self.wait_deadline is None or now < self.wait_deadline)


@dataclass
class Verdict:
    """How a finished request compared with the table's prediction."""

    predicted: ReuseBounds
    cache_n: int | None

    @property
    def checked(self) -> bool:
        return self.cache_n is not None

    @property
    def matched(self) -> bool:
        return self.cache_n is not None and self.predicted.holds(self.cache_n)


class SlotScheduler:
    def __init__(
        self,
        tables: Sequence[UpstreamSlots],
        policy: RoutingPolicy,
        max_queue: int,
        clock: Callable[[], float] = time.monotonic,
        open_tenant: str = "default",
        fair_share: bool = True,
        max_queue_per_tenant: int | None = None,
        batch_factor: float = 0.5,
        share_window_s: float = 5.0,
        chunked_prefill: bool = True,
    ) -> None:
        self.tables = list(tables)
        self.open_tenant = open_tenant  # who everyone is while no tenants are configured
        self.policy = policy
        self.max_queue = max_queue
        # a tenant's own bound on waiting requests, unless its request brings one (None: none)
        self.max_queue_per_tenant = max_queue_per_tenant
        self.clock = clock
        self._queue: FairQueue[_Waiter] = FairQueue(fair_share, batch_factor)
        self._timer: asyncio.TimerHandle | None = None
        # the waiters given a bounded wait for a busy slot (some may have left the queue): the
        # timer looks at these, not at every waiter, on each dispatch
        self._bounded: list[_Waiter] = []
        # the slot share (fair share only): who holds each leased slot (by id of the slot) and
        # until when its prompt is expected to be computed, and when each tenant last had a
        # request arrive or end, with its last share
        self.share_window_s = share_window_s
        self._holders: dict[int, tuple[str, float]] = {}
        self._last_active: dict[str, tuple[float, Share]] = {}
        self.chunked_prefill = chunked_prefill  # see `Lease.chunked`
        self._chunk_pauses: list[asyncio.Future[None]] = []  # woken when a slot is given back
        # per tenant: how often its requests continued the whole text they reused, lately
        self._continues: dict[str, Smoothed] = {}

    @property
    def queued(self) -> int:
        return len(self._queue)

    def queued_for(self, tenant: str) -> int:
        return self._queue.waiting(tenant)

    def continue_chance(self, tenant: str | None) -> float:
        """How often `tenant`'s requests lately continued the whole text they reused rather
        than branched off it (1 until any reused one)."""
        measured = self._continues.get(tenant) if tenant is not None else None
        return 1.0 if measured is None else measured.value

    async def acquire(
        self,
        prompt: list[int],
        tenant: str,
        session: str | None = None,
        cache_prompt: bool = True,
        public_prefix_length: int = 0,
        patient: bool = True,
        share: Share | None = None,
        queue_bound: int | None = None,
        slot_id: int | None = None,
    ) -> Lease:
        """A slot for `prompt`. `patient=False` takes the best idle slot, never waiting for a
        busy one: the tasks of one split request must run side by side, not wait for each other
        to reuse the prompt they share. `share` places it among the tenants (weight, class);
        `queue_bound` is the tenant's own bound on waiting requests (None: the scheduler's);
        `slot_id`: the slot the client named, waited for rather than chosen (the caller checked
        that one of the upstreams has it)."""
        waiter = self._enqueue(
            prompt,
            tenant,
            session,
            cache_prompt,
            exclusive=False,
            shareable=public_prefix_length,
            patient=patient,
            share=share,
            queue_bound=queue_bound,
            slot_id=slot_id,
        )
        return await self._await(waiter)

    async def acquire_opaque(
        self,
        tenant: str,
        session: str | None = None,
        share: Share | None = None,
        queue_bound: int | None = None,
    ) -> Lease:
        """One slot for a task whose prompt ids are not known (`/infill`): the policy sees an
        empty prompt, so it picks the slot whose loss costs least, unless a slot of the
        tenant's last served the same `session` (for infill, a key of how its prompt starts),
        which the server will then mostly reuse."""
        waiter = self._enqueue(
            [],
            tenant,
            session,
            True,
            exclusive=False,
            opaque=True,
            share=share,
            queue_bound=queue_bound,
        )
        return await self._await(waiter)

    async def acquire_upstream(
        self, tenant: str, share: Share | None = None, queue_bound: int | None = None
    ) -> UpstreamLease:
        waiter = self._enqueue(
            [], tenant, None, False, exclusive=True, share=share, queue_bound=queue_bound
        )
        return await self._await(waiter)

    def prepared(
        self, lease: Lease, predicted: ReuseBounds, isolate: bool, branch: int | None = None
    ) -> Lease:
        """The disk tier's decision about the leased slot (it restored an archive into it, or
        emptied it): what the server will now reuse there, and whether it must reuse nothing;
        `branch`: where the request branched off the archive it restored (`SlotState.branch`).
        The returned lease is the one to release."""
        if predicted == lease.predicted and isolate == lease.isolate:
            # the disk tier changed nothing (the common case): the lease stands
            if not isolate:
                held = lease.previous.n_tokens_at_least
                self._lineage_seen(lease, branch_point(held, predicted.low), predicted.low)
            return lease
        lease.slot.branch = branch  # its text now comes from the archive, or from nothing
        if not isolate:
            self._lineage_seen(lease, branch, predicted.low)
        return self._relet(lease, predicted, isolate)

    def _relet(self, lease: Lease, predicted: ReuseBounds, isolate: bool) -> Lease:
        """The lease with these bounds and isolation (itself when they are its own)."""
        if predicted == lease.predicted and isolate == lease.isolate:
            return lease
        # built field by field: dataclasses.replace costs several times more
        return Lease(
            lease.table,
            lease.slot,
            lease.prompt,
            predicted,
            lease.queued_s,
            isolate,
            lease.previous,
            lease.opaque,
            lease.chunked,
        )

    def _lineage_seen(self, lease: Lease, branched: int | None, reused: int) -> None:
        """The leased request reused `reused` tokens of a text and branched off it at
        `branched` (None: it continued all of it): one more sample of how its tenant's
        requests use what they reuse."""
        tenant = lease.slot.tenant
        if reused <= 0 or tenant is None or lease.opaque:
            return
        seen = self._continues.setdefault(tenant, Smoothed(1.0, LINEAGE_WEIGHT))
        seen.add(1.0 if branched is None else 0.0)

    async def chunk_turn(self, lease: Lease, remaining: int) -> None:
        """Wait, before the next chunk of the leased prompt, while another tenant within its
        share has a prompt being computed (the chunk would be computed beside it); then mark the
        `remaining` tokens as being computed, so the tenant starts no other prompt meanwhile."""
        slot = lease.slot
        tenant = self._holders.get(id(slot), (slot.tenant or "", 0.0))[0]
        rate_s = lease.table.prefill_ms_per_token.value / 1000
        while True:
            now = self.clock()
            pause = self._chunk_pause(tenant, now)
            # still this tenant's one prompt in its prefill while it pauses
            self._holders[id(slot)] = (tenant, now + pause + remaining * rate_s)
            if pause <= 0:
                return
            # until the prompt is expected to be computed, or sooner if its request ends
            woken = asyncio.get_running_loop().create_future()
            self._chunk_pauses.append(woken)
            try:
                await asyncio.wait_for(woken, pause)
            except TimeoutError:
                pass
            finally:
                if woken in self._chunk_pauses:
                    self._chunk_pauses.remove(woken)

    def prefill_ended(self, lease: Lease) -> None:
        """The leased request's first token came (its stream's first event): its prompt is
        computed, whatever the estimate said. A tenant held to one prompt at a time may start
        its next, and chunks paused for this one go on."""
        held = self._holders.get(id(lease.slot))
        now = self.clock()
        if held is None:
            return
        # kept even when the estimate passed earlier: the time after the prompt is measured
        # from here (`release`)
        self._holders[id(lease.slot)] = (held[0], now)
        if held[1] <= now:
            return
        self._wake_chunk_pauses()
        if self._queue:
            self._dispatch()

    def chunk_done(self, lease: Lease, computed: int) -> None:
        """A chunk ended: the leased slot holds exactly the prompt's first `computed` tokens."""
        lease.slot.hold(lease.prompt[:computed])

    def chunks_done(self, lease: Lease) -> Lease:
        """The chunks ended: the slot is being filled with the whole prompt again, as leased,
        and the request reuses what they computed, the tenant's own text (no isolation)."""
        lease.slot.hold(list(lease.prompt), UNKNOWN)
        return self._relet(lease, lease.predicted, isolate=False)

    def _chunk_pause(self, tenant: str, now: float) -> float:
        """Seconds until the first prompt of another tenant within its share is expected to
        be computed, when one is being computed (0: none)."""
        if not self._queue.fair or not yields_to(tenant, self._active_tenants(now), self._total()):
            return 0.0
        ends = [until for other, until in self._holders.values() if other != tenant and until > now]
        return min(ends, default=now) - now

    def _total(self) -> int:
        return sum(len(table.slots) for table in self.tables if table.healthy)

    def release(self, lease: Lease, outcome: TaskOutcome) -> Verdict:
        """Record what the slot now holds, free it, and serve whoever waits."""
        slot, table = lease.slot, lease.table
        if lease.opaque:
            slot.forget(outcome.tokens_cached if outcome.ok else None)
        else:
            slot.record(lease.prompt, outcome)
        table.shadow_unclaim(slot.slot_id)  # sent and replayed, or never sent
        if not outcome.ok:
            # refused before it ran, cut half-way, or failed inside: whether the slot still holds
            # its previous owner's text or some of this request's cannot be told, so it is
            # nobody's (labelled the requester's, its next request would reuse the other's)
            slot.tenant = slot.session = None
        slot.busy = False
        slot.last_used = self.clock()
        prefill_end = self._holders.get(id(slot), ("", math.inf))[1]
        self._give_back(slot, slot.last_used)
        if outcome.ok:
            table.request_s.add(slot.last_used - slot.lease_started)
            if prefill_end <= slot.last_used:
                table.after_prefill_s.add(slot.last_used - prefill_end)
            if outcome.prompt_n and outcome.prompt_n >= MIN_PREFILL_SAMPLE_TOKENS:
                if outcome.prompt_ms:
                    table.prefill_ms_per_token.add(outcome.prompt_ms / outcome.prompt_n)
                    # its prompt ended before the tokens it generated
                    prompt_end = slot.last_used - (outcome.predicted_ms or 0.0) / 1000
                    table.prefill_throughput.add(prompt_end, outcome.prompt_ms, outcome.prompt_n)
        self._dispatch()
        return Verdict(lease.predicted, outcome.cache_n)

    def release_upstream(
        self,
        lease: UpstreamLease,
        before: list[dict] | None,
        after: list[dict] | None,
        erased: Sequence[int] = (),
    ) -> None:
        """Free an upstream held whole by `lease.tenant`. Only the slots the request may have
        written change hands: those `GET /slots` shows with another task or another length
        after than before (`after` and `before`; None: not read). A slot that cannot be told
        apart is nobody's, its content unknown. `erased` were emptied before the request ran."""
        now = self.clock()
        changed = written_slots(before, after)
        for slot in lease.table.slots:
            slot.busy = False
            self._give_back(slot, now)
            if slot.slot_id in erased:
                slot.hold([])
                slot.tenant = slot.session = None
            written = changed.get(slot.slot_id)
            if written is False:
                continue  # the server ran nothing there: what it held, and whose, is unchanged
            slot.last_used = now
            slot.session = None
            if written is None:
                slot.tenant = None
                slot.forget()
            else:
                slot.tenant = lease.tenant
                slot.forget(written)
        self._dispatch()

    def take_for_probe(self, table: UpstreamSlots, count: int) -> list[SlotState] | None:
        """`count` idle slots of `table`, kept from requests while the monitor probes them;
        None when there are not that many idle."""
        taken = [slot for slot in table.slots if not slot.busy][:count]
        if len(taken) < count:
            return None
        for slot in taken:
            slot.busy = True
        return taken

    def return_from_probe(self, slots: list[SlotState], erased: set[int] | None) -> None:
        """Give probed slots back, nobody's: the ids in `erased` are empty again, the others
        hold what the probe left (None: the probe stopped half-way, nothing is known)."""
        for slot in slots:
            slot.busy = False
            slot.tenant = slot.session = None
            if erased is None:
                slot.forget()
            elif slot.slot_id in erased:
                slot.hold([])
        self._dispatch()

    def take_for_save(self, table: UpstreamSlots, slot: SlotState, version: int) -> bool:
        """Keep an idle slot from requests while the disk tier saves it in the background,
        unless it changed since `version`, a request waits, or one runs on the upstream (the
        server runs nothing else while it saves: a request must never wait for more than the
        one save under way when it came). A request that wants the slot meanwhile waits for
        this one save, then gets it."""
        if slot.version != version or self._queue or any(s.busy for s in table.slots):
            return False
        slot.busy = slot.saving = True
        return True

    def return_from_save(self, slot: SlotState) -> None:
        """Give back a slot taken by `take_for_save`: saving changed nothing in it."""
        slot.busy = slot.saving = False
        self._dispatch()

    def lend_for_move(self, slot: SlotState) -> bool:
        """Keep an idle slot from requests, its content unchanged, while the disk tier saves it
        for a request on another upstream (a move); False when it is busy."""
        if slot.busy:
            return False
        slot.busy = True
        return True

    def return_from_move(self, slot: SlotState) -> None:
        """Give back a slot lent by `lend_for_move`: saving changed nothing in it."""
        slot.busy = False
        self._dispatch()

    def upstream_changed(self) -> None:
        """A table was corrected or an upstream came back: plan again for whoever waits."""
        self._dispatch()

    # -- queue ---------------------------------------------------------------------------

    def _enqueue(
        self,
        prompt: list[int],
        tenant: str,
        session: str | None,
        cache_prompt: bool,
        exclusive: bool,
        shareable: int = 0,
        opaque: bool = False,
        patient: bool = True,
        share: Share | None = None,
        queue_bound: int | None = None,
        slot_id: int | None = None,
    ) -> _Waiter:
        self._admit(tenant, queue_bound if queue_bound is not None else self.max_queue_per_tenant)
        waiter = _Waiter(
            prompt, tenant, session, cache_prompt, exclusive, self.clock(), shareable, opaque
        )
        waiter.patient = patient  # before the dispatch below plans for it
        waiter.share = share or Share()
        waiter.slot_id = slot_id
        self._last_active[tenant] = (waiter.arrived, waiter.share)
        self._queue.push(waiter, tenant, waiter.share)
        self._dispatch()
        return waiter

    def _admit(self, tenant: str, bound: int | None) -> None:
        """Room for one more waiter of `tenant`, or the refusal: its own bound first (429,
        never anyone else's), then the total (503), unless a tenant with more waiting gives
        way: the newest of the longest queue is refused instead (429), so one tenant filling
        the whole queue cannot turn others away."""
        waiting = self._queue.waiting(tenant)
        if bound is not None and waiting >= bound:
            raise TenantQueueFull(
                f"this tenant already has {waiting} requests waiting for a slot (its limit)",
                self.retry_after_s(waiting),
            )
        if len(self._queue) < self.max_queue:
            return
        longest = self._queue.newest_of_longest() if self._queue.fair else None
        if longest is None or self._queue.waiting(longest[0]) <= waiting + 1:
            raise Overloaded(f"{len(self._queue)} requests are already waiting for a slot")
        other, pushed_out = longest
        self._queue.remove(pushed_out)
        others_waiting = self._queue.waiting(other)
        pushed_out.future.set_exception(
            TenantQueueFull(
                f"this tenant has {others_waiting + 1} requests waiting, the most of any while"
                " the queue is full: its newest gave way to another tenant's",
                self.retry_after_s(others_waiting),
            )
        )

    def retry_after_s(self, waiting: int) -> int:
        """Seconds until about `waiting` more requests have been served, one request's time at
        least: each slot frees every expected request time (1 s before any was measured)."""
        slots = sum(len(table.slots) for table in self.tables if table.healthy) or 1
        times = [t.request_s.value for t in self.tables if t.healthy and t.request_s.value]
        request_s = max(times, default=1.0)
        return max(1, math.ceil(request_s), math.ceil(waiting * request_s / slots))

    async def _await(self, waiter: _Waiter):  # noqa: ANN202 - a Lease or an UpstreamLease
        try:
            return await waiter.future
        except asyncio.CancelledError:
            # the client left while queued, or just as it was served: give the slot back
            if waiter in self._queue:
                self._queue.remove(waiter)
            elif (
                waiter.future.done()
                and not waiter.future.cancelled()
                and waiter.future.exception() is None  # refused (gave way): nothing to give back
            ):
                self._abandon(waiter.future.result())
            self._dispatch()
            raise

    def _abandon(self, lease: Lease | UpstreamLease) -> None:
        """A lease whose request never went out: a pinned slot was relabelled and filled in
        the table, so what it holds is unknown here; an upstream's slots were left as they were."""
        now = self.clock()
        if isinstance(lease, UpstreamLease):
            for slot in lease.table.slots:
                slot.busy = False
                self._give_back(slot, now)
            return
        lease.slot.busy = False
        lease.slot.forget()
        lease.table.shadow_unclaim(lease.slot.slot_id)
        self._give_back(lease.slot, now)

    def _dispatch(self) -> None:
        """Serve waiters in the fair queue's order, as far as slots allow.

        A waiter that cannot be served now (it waits for one busy slot, or its tenant is at
        its share while others are active) is passed over, so the tenants after it are served
        meanwhile; after each grant the order is asked again, since the tenant served has
        moved back."""
        if not self._queue and self._timer is None:
            return
        now = self.clock()
        if self.tables and not self._any_healthy():
            self._fail_all(NoUpstream("no upstream is reachable"))
            return
        passed_over: set[int] = set()  # serving others only takes slots: still unservable
        held_back = False  # a waiter was kept within its tenant's share
        served = True
        # with every slot busy nobody can be served: the queue is not even put in order (a
        # request arriving at a saturated proxy, or one that takes the last idle slot)
        while served and self._queue and self._any_idle_slot():
            served = False
            # a grant changes who is below their share: ask again after each
            beyond_share: set[str] = set()
            for waiter in self._queue.order():
                if id(waiter) in passed_over or waiter.tenant in beyond_share:
                    continue
                if waiter.future.done():
                    self._queue.remove(waiter)
                    continue
                # the share is judged for a split request's first task: its siblings (never
                # patient) run beside it, as they must (see `acquire`)
                held_to_share = waiter.patient and not waiter.exclusive
                if held_to_share and not self._within_share(waiter.tenant, now):
                    beyond_share.add(waiter.tenant)
                    held_back = True
                    continue
                if waiter.exclusive:
                    # a barrier: later requests must not starve it of a whole upstream. It is
                    # its tenant's turn, and the wait ends when the running requests do.
                    served = self._serve_exclusive(waiter, now)
                    break
                if self._serve(waiter, now):
                    served = True
                    break
                passed_over.add(id(waiter))
        self._arm_timer(now, self._share_expiry(now) if held_back else None)

    def _any_healthy(self) -> bool:
        for table in self.tables:  # a plain loop: asked at every dispatch
            if table.healthy:
                return True
        return False

    def _any_idle_slot(self) -> bool:
        # plain loops: asked several times a dispatch, twice a request (a generator costs more)
        for table in self.tables:
            if table.healthy:
                for slot in table.slots:
                    if not slot.busy:
                        return True
        return False

    # -- slot share ----------------------------------------------------------------------------

    def _give_back(self, slot: SlotState, now: float) -> None:
        """`slot` is no longer leased: its holder was active until now."""
        tenant, _ = self._holders.pop(id(slot), (None, 0.0))
        if tenant is not None and tenant in self._last_active:
            self._last_active[tenant] = (now, self._last_active[tenant][1])
        if self._chunk_pauses:
            self._wake_chunk_pauses()  # a prompt the chunks paused for may be done

    def _wake_chunk_pauses(self) -> None:
        for woken in self._chunk_pauses:
            if not woken.done():
                woken.set_result(None)
        self._chunk_pauses.clear()

    def _active_tenants(self, now: float) -> dict[str, TenantSlots]:
        """The tenants holding a slot, waiting, or active within the window, and what they hold."""
        holding = Counter(tenant for tenant, _ in self._holders.values())
        prefilling = Counter(tenant for tenant, until in self._holders.values() if until > now)
        waiting = self._queue.tenants()
        for tenant, (at, _) in list(self._last_active.items()):
            if now - at >= self.share_window_s and tenant not in holding and tenant not in waiting:
                del self._last_active[tenant]  # gone quiet: forget it
        return {
            tenant: TenantSlots(
                share.weight, holding[tenant], share.max_concurrent, prefilling[tenant]
            )
            for tenant, (_, share) in self._last_active.items()
        }

    def _within_share(self, tenant: str, now: float) -> bool:
        """Whether a request of `tenant` may take an idle slot (slot_share.py); always under the
        global FIFO, which knows no shares."""
        if not self._queue.fair:
            return True
        if len(self._last_active) == 1 and tenant in self._last_active and self._any_idle_slot():
            # the tenant alone in the window (it is in it: it waits): every idle slot is its
            # to take (`may_take`), and nothing in the window is old enough to forget but it
            return True
        healthy = [slot for table in self.tables if table.healthy for slot in table.slots]
        idle = sum(not slot.busy for slot in healthy)
        return may_take(tenant, self._active_tenants(now), idle, len(healthy))

    def _in_chunks(self, waiter: _Waiter, now: float) -> bool:
        """Whether the waiter's prompt is to be computed in chunks (chunked_prefill.py): its
        ids are known and may be reused, and its tenant holds its share while others are active."""
        if (
            not self.chunked_prefill
            or not self._queue.fair
            or len(self._last_active) <= 1  # alone: never (and nothing to compute)
            or waiter.opaque
            or not waiter.cache_prompt
            or not waiter.patient
        ):
            return False
        return in_chunks(waiter.tenant, self._active_tenants(now), self._total())

    def _share_expiry(self, now: float) -> float | None:
        """When the first tenant active only recently (nothing held or waiting) leaves the
        window, or the first prompt being computed is expected to be done: a tenant held back
        for either may then take more."""
        busy = {tenant for tenant, _ in self._holders.values()} | self._queue.tenants()
        ends = [
            at + self.share_window_s
            for tenant, (at, _) in self._last_active.items()
            if tenant not in busy
        ]
        ends += [until for _, until in self._holders.values() if until > now]
        return min(ends, default=None)

    @staticmethod
    def _prefill_until(table: UpstreamSlots, waiter: _Waiter, reused: int, now: float) -> float:
        """When the server is expected to have computed the waiter's prompt, at the rate it
        computed prompts lately (beside others: so rather late than early)."""
        to_compute = max(len(waiter.prompt) - reused, 0)
        return now + to_compute * table.prefill_ms_per_token.value / 1000

    def _fail_all(self, error: Exception) -> None:
        for waiter in self._queue:
            if not waiter.future.done():
                waiter.future.set_exception(error)
            self._queue.remove(waiter)

    def _serve(self, waiter: _Waiter, now: float) -> bool:
        """Lease the policy's slot to `waiter`; False when it must wait."""
        views, slots, predictions = self._views(waiter, now)
        request = RouteRequest(len(waiter.prompt), waiter.session, waiter.may_wait(now))
        plan = self._named_slot_plan(waiter.slot_id)
        if plan is None:
            plan = self.policy.plan(request, views, self._upstream_views())
        if isinstance(plan, UseSlot):
            table = self.tables[plan.upstream]
            slot = table.slots[plan.slot_id]
            # a policy that names a busy slot is ignored, never obeyed; one being saved in the
            # background goes to a waiter as soon as the save ends
            if slot.busy:
                return False
            predicted = slots[(plan.upstream, plan.slot_id)]
            owner = self._owner(slot, waiter)
            isolate = not slot.empty and predicted.high == 0 and owner != waiter.tenant
            if waiter.opaque and not isolate:
                # its own text (or nothing): the server may reuse any of it, none of it known
                predicted = ReuseBounds(0, slot.n_ctx)
            chunked = self._in_chunks(waiter, now)  # judged before this grant counts
            if waiter.cache_prompt and not waiter.opaque and not isolate:
                # before the row changes (the placement's prediction, made on the same row)
                table.shadow_claim(
                    slot.slot_id, waiter.prompt, predictions.get((plan.upstream, plan.slot_id))
                )
            previous = slot.content(owner, self.continue_chance(owner))
            # a request that continues what the slot holds is the conversation's next turn
            continues = predicted.low > 0 and not isolate
            slot.turns = slot.turns + 1 if continues else 1
            # the lineage stays a branching one while its requests branch where it did
            branched = (
                branch_point(previous.n_tokens_at_least, predicted.low) if continues else None
            )
            slot.branch = slot.branch if branched is not None and branched == slot.branch else None
            slot.busy = True
            slot.version += 1
            slot.lease_started = now
            self._holders[id(slot)] = (
                waiter.tenant,
                self._prefill_until(table, waiter, predicted.low, now),
            )
            slot.tenant = waiter.tenant
            slot.session = waiter.session
            # from now on the slot is being filled with this prompt: whoever considers waiting
            # for it must compare against that, not against what it held before
            slot.hold(list(waiter.prompt), UNKNOWN)
            self._queue.served(waiter)
            waiter.future.set_result(
                Lease(
                    table,
                    slot,
                    waiter.prompt,
                    predicted,
                    now - waiter.arrived,
                    isolate,
                    previous,
                    waiter.opaque,
                    chunked,
                )
            )
            return True
        if isinstance(plan, WaitForSlot) and waiter.wait_deadline is None:
            waiter.wait_deadline = now + plan.max_wait_s
            self._bounded.append(waiter)
        elif isinstance(plan, QueueUntilFree):
            pass
        return False

    def _named_slot_plan(self, slot_id: int | None) -> UseSlot | QueueUntilFree | None:
        """The slot a client named, on the first healthy upstream that has it, once it is idle
        (llama-server too defers a task pinned to a busy slot); None: none was named."""
        if slot_id is None:
            return None
        for table in self.tables:
            if table.healthy and any(slot.slot_id == slot_id for slot in table.slots):
                busy = table.slots[slot_id].busy
                return QueueUntilFree() if busy else UseSlot(table.index, slot_id)
        return QueueUntilFree()

    def _serve_exclusive(self, waiter: _Waiter, now: float) -> bool:
        """A whole idle upstream, one whose slots hold only the waiter's text or nothing if
        there is one (the server may then reuse whatever slot it picks)."""
        idle = [
            table
            for table in self.tables
            if table.healthy and not any(slot.busy for slot in table.slots)
        ]
        if not idle:
            return False
        table = min(idle, key=lambda t: len(self._foreign(waiter, t)))
        foreign = tuple(
            Lease(
                table,
                slot,
                [],
                ReuseBounds(0, 0),
                now - waiter.arrived,
                isolate=True,
                previous=SlotContent(slot.known, slot.unknown_tail, self._owner(slot, waiter)),
            )
            for slot in self._foreign(waiter, table)
        )
        for slot in table.slots:
            slot.busy = True
            slot.version += 1
            slot.lease_started = now
            self._holders[id(slot)] = (waiter.tenant, now)  # its prompts are not known
        self._queue.served(waiter)
        waiter.future.set_result(
            UpstreamLease(table, now - waiter.arrived, waiter.tenant, not foreign, foreign)
        )
        return True

    def _foreign(self, waiter: _Waiter, table: UpstreamSlots) -> list[SlotState]:
        """The slots of `table` that hold text the waiter's tenant may not reuse."""
        return [slot for slot in table.slots if not slot.empty and not self._owns(waiter, slot)]

    def _views(
        self, waiter: _Waiter, now: float
    ) -> tuple[
        list[SlotCandidate],
        dict[tuple[int, int], ReuseBounds],
        dict[tuple[int, int], RamPrediction],
    ]:
        """Each slot as the policy sees it, the reuse predicted there, and what the RAM-cache
        shadow predicted where it was asked."""
        views, bounds, predictions = [], {}, {}
        prompt = waiter.prompt
        for table in self.tables:
            ram = table.ram_shadow is not None and waiter.cache_prompt and not waiter.opaque
            for slot in table.slots:
                own = self._owner(slot, waiter) == waiter.tenant  # worked out once a slot
                shared = common_prefix_length(slot.known, prompt)
                reuse = self._reuse(slot, waiter, shared, own)
                # the server's RAM cache serves the tenant's own slots
                reuse, lost, found = table.placement(slot, prompt, shared, reuse, ram and own)
                bounds[(table.index, slot.slot_id)] = reuse
                if found is not None:
                    predictions[(table.index, slot.slot_id)] = found
                expected = reuse.low
                busy = slot.busy and not slot.saving  # being saved: free in a moment, all kept
                remaining_s, prefill_left_s = None, 0.0
                if busy and own:
                    remaining_s, prefill_left_s = self._time_left(table, slot, waiter, now)
                if waiter.opaque and self._same_opaque_prompt(waiter, slot, own):
                    # its ids are unknown, but it starts as the one the slot holds: the server
                    # will reuse about all of it, and nothing worth keeping is lost
                    expected, lost = slot.n_tokens or 0, 0
                views.append(
                    SlotCandidate(
                        upstream=table.index,
                        slot_id=slot.slot_id,
                        busy=busy,
                        empty=slot.empty,
                        reuse=expected,
                        lost=lost,
                        last_used=slot.last_used,
                        busy_for_s=now - slot.lease_started if busy else 0.0,
                        session=slot.session,
                        remaining_s=remaining_s,
                        prefill_left_s=prefill_left_s,
                    )
                )
        return views, bounds, predictions

    def _time_left(
        self, table: UpstreamSlots, slot: SlotState, waiter: _Waiter, now: float
    ) -> tuple[float | None, float]:
        """How long the request running on a busy slot holding the waiter's tenant's own text
        is expected to hold it, and to compute its prompt: its prompt's end (its first streamed
        event, or the estimate from the measured rate), then the upstream's measured time after
        a prompt. None and 0 when another tenant's request runs there: a wait for another
        tenant's slot must not depend on what that tenant sent."""
        held = self._holders.get(id(slot))
        if held is None or held[0] != waiter.tenant:
            return None, 0.0
        prefill_end = held[1]
        return prefill_end + table.after_prefill_s.value - now, max(prefill_end - now, 0.0)

    def _same_opaque_prompt(self, waiter: _Waiter, slot: SlotState, own: bool) -> bool:
        """An opaque prompt whose affinity key (its start, see `acquire_opaque`) is the one the
        slot last served, for the same tenant (`own`: the slot holds its text)."""
        return (
            waiter.opaque
            and waiter.cache_prompt
            and waiter.session is not None
            and slot.session == waiter.session
            and own
        )

    def _owns(self, waiter: _Waiter, slot: SlotState) -> bool:
        """Whether the slot's text is the waiter's tenant's own.

        A slot whose writer is unknown (it held something before the proxy started) belongs
        to nobody, except in single-user mode, where everything is the open tenant's.
        """
        return self._owner(slot, waiter) == waiter.tenant

    def _owner(self, slot: SlotState, waiter: _Waiter) -> str | None:
        """Whose text the slot holds, as far as `waiter` may know: its writer, or in single-user
        mode (the waiter is the open tenant) the open tenant."""
        if slot.tenant is None and waiter.tenant == self.open_tenant:
            return self.open_tenant
        return slot.tenant

    def _reuse(self, slot: SlotState, waiter: _Waiter, shared: int, own: bool) -> ReuseBounds:
        """What the server will reuse of the waiter's prompt on `slot`, which shares `shared`
        tokens with it (`own`: the slot holds the waiter's tenant's text)."""
        if not waiter.cache_prompt:
            return NO_REUSE
        bounds = slot.reuse_bounds(waiter.prompt, shared)
        if own:
            return bounds
        # Another tenant's slot: only tokens of a public prefix may be shared, and only when
        # the server's reuse is known to stop inside it (else it must reuse nothing at all).
        if bounds.low == bounds.high and 0 < bounds.high <= waiter.public_prefix_length:
            return bounds
        return NO_REUSE

    def _upstream_views(self) -> list[UpstreamView]:
        return [
            UpstreamView(
                index=table.index,
                in_flight=_in_flight(table),
                prefill_ms_per_token=table.server_ms_per_token(),
                expected_request_s=table.request_s.value,
                ram_cache=table.ram_cache,
                healthy=table.healthy,
            )
            for table in self.tables
        ]

    def _arm_timer(self, now: float, share_expiry: float | None = None) -> None:
        """Plan again when the first bounded wait for a busy slot runs out, or when the slot
        share may let a held-back tenant in (`share_expiry`)."""
        if not self._bounded and share_expiry is None and self._timer is None:
            return  # nothing to plan for, nothing armed: the common dispatch
        if self._bounded:
            self._bounded = [waiter for waiter in self._bounded if waiter in self._queue]
        deadlines = [w.wait_deadline for w in self._bounded if w.wait_deadline is not None]
        if self._bounded:
            # a waiter may wait for a prompt being computed (see the routing policy): plan
            # again when one is expected to be, if no first streamed event tells sooner
            deadlines += [until for _, until in self._holders.values() if until > now]
        if share_expiry is not None:
            deadlines.append(share_expiry)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        future = [deadline for deadline in deadlines if deadline > now]
        if future:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(min(future) - now, self._dispatch)


def _in_flight(table: UpstreamSlots) -> int:
    """Requests running on the upstream (a slot being saved in the background is not one)."""
    running = 0
    for slot in table.slots:  # a plain loop: asked for every upstream at every placement
        if slot.busy and not slot.saving:
            running += 1
    return running
