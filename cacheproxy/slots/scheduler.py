"""Hands slots to requests: one request per slot, a bounded FIFO queue, the policy's choice.

The proxy never pins a slot that is busy: llama-server would defer the task, and, with its RAM
cache on, snapshot and possibly overwrite the running slot's KV while deferring. So a slot is
leased to one request at a time, and a request that finds no slot waits here, not upstream.

The scheduler is the one writer of slot state: who holds a slot, what it holds, its lease. The
executor and the disk tier read it (through leases, which they cannot change) and hand their
findings back through the methods below: a finished request's outcome, the disk tier's
preparation of a slot, a whole upstream's report, a correction from `GET /slots`.

It stays one module (a little over 500 lines) because it is that one writer: leases, the queue
and its dispatch change the same slots under one invariant (a slot is leased to one request at
a time), which split across modules would have several writers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from cacheproxy.slots.routing import (
    QueueUntilFree,
    RouteRequest,
    RoutingPolicy,
    SlotCandidate,
    UpstreamView,
    UseSlot,
    WaitForSlot,
)
from cacheproxy.slots.table import (
    UNKNOWN,
    ReuseBounds,
    SlotContent,
    SlotState,
    TaskOutcome,
    UpstreamSlots,
    written_slots,
)


class Overloaded(Exception):
    """The queue is full: the client should come back later (503 with Retry-After)."""


class NoUpstream(Exception):
    """Every upstream went away while the request waited."""


@dataclass(frozen=True)
class Lease:
    """A slot held by one request, from routing until its response has been read; changed only
    by the scheduler, as a new lease (`prepared`)."""

    table: UpstreamSlots
    slot: SlotState
    prompt: list[int]
    predicted: ReuseBounds
    queued_s: float
    isolate: bool  # the slot holds another tenant's text: the server must not reuse any of it
    # what the slot held before this request: the disk tier may archive it before it is lost
    previous: SlotContent = field(default_factory=lambda: SlotContent([], 0, None))
    # the prompt's ids are not known (`prompt` is empty): the slot will hold the tenant's text,
    # as many tokens as the server reports, none of them named
    opaque: bool = False


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
    ) -> None:
        self.tables = list(tables)
        self.open_tenant = open_tenant  # who everyone is while no tenants are configured
        self.policy = policy
        self.max_queue = max_queue
        self.clock = clock
        self._queue: list[_Waiter] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def acquire(
        self,
        prompt: list[int],
        tenant: str,
        session: str | None = None,
        cache_prompt: bool = True,
        public_prefix_length: int = 0,
        patient: bool = True,
        slot_id: int | None = None,
    ) -> Lease:
        """A slot for `prompt`. `patient=False` takes the best idle slot, never waiting for a
        busy one: the tasks of one split request must run side by side, not wait for each other
        to reuse the prompt they share. `slot_id`: the slot the client named, waited for
        rather than chosen (the caller checked that one of the upstreams has it)."""
        waiter = self._enqueue(
            prompt,
            tenant,
            session,
            cache_prompt,
            exclusive=False,
            shareable=public_prefix_length,
            patient=patient,
            slot_id=slot_id,
        )
        return await self._await(waiter)

    async def acquire_opaque(self, tenant: str, session: str | None = None) -> Lease:
        """One slot for a task whose prompt ids are not known (`/infill`): the policy sees an
        empty prompt, so it picks the slot whose loss costs least, unless a slot of the
        tenant's last served the same `session` (for infill, a key of how its prompt starts),
        which the server will then mostly reuse."""
        waiter = self._enqueue([], tenant, session, True, exclusive=False, opaque=True)
        return await self._await(waiter)

    async def acquire_upstream(self, tenant: str) -> UpstreamLease:
        waiter = self._enqueue([], tenant, None, False, exclusive=True)
        return await self._await(waiter)

    def prepared(self, lease: Lease, predicted: ReuseBounds, isolate: bool) -> Lease:
        """The disk tier's decision about the leased slot (it restored an archive into it, or
        emptied it): what the server will now reuse there, and whether it must reuse nothing.
        The returned lease is the one to release."""
        return replace(lease, predicted=predicted, isolate=isolate)

    def release(self, lease: Lease, outcome: TaskOutcome) -> Verdict:
        """Record what the slot now holds, free it, and serve whoever waits."""
        slot, table = lease.slot, lease.table
        if lease.opaque:
            slot.forget(outcome.tokens_cached if outcome.ok else None)
        else:
            slot.record(lease.prompt, outcome)
        if not outcome.ok:
            # refused before it ran, cut half-way, or failed inside: whether the slot still holds
            # its previous owner's text or some of this request's cannot be told, so it is
            # nobody's (labelled the requester's, its next request would reuse the other's)
            slot.tenant = slot.session = None
        slot.busy = False
        slot.last_used = self.clock()
        if outcome.ok:
            table.request_s.add(slot.last_used - slot.lease_started)
            if outcome.prompt_n and outcome.prompt_ms:
                table.prefill_ms_per_token.add(outcome.prompt_ms / outcome.prompt_n)
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
        slot_id: int | None = None,
    ) -> _Waiter:
        if len(self._queue) >= self.max_queue:
            raise Overloaded(f"{len(self._queue)} requests are already waiting for a slot")
        waiter = _Waiter(
            prompt, tenant, session, cache_prompt, exclusive, self.clock(), shareable, opaque
        )
        waiter.patient = patient  # before the dispatch below plans for it
        waiter.slot_id = slot_id
        self._queue.append(waiter)
        self._dispatch()
        return waiter

    async def _await(self, waiter: _Waiter):  # noqa: ANN202 - a Lease or an UpstreamLease
        try:
            return await waiter.future
        except asyncio.CancelledError:
            # the client left while queued, or just as it was served: give the slot back
            if waiter in self._queue:
                self._queue.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self._abandon(waiter.future.result())
            self._dispatch()
            raise

    def _abandon(self, lease: Lease | UpstreamLease) -> None:
        """A lease whose request never went out: a pinned slot was relabelled and filled in
        the table, so what it holds is unknown here; an upstream's slots were left as they were."""
        if isinstance(lease, UpstreamLease):
            for slot in lease.table.slots:
                slot.busy = False
            return
        lease.slot.busy = False
        lease.slot.forget()

    def _dispatch(self) -> None:
        """Serve waiters in arrival order, as far as slots allow."""
        if not self._queue and self._timer is None:
            return
        now = self.clock()
        if self.tables and not any(table.healthy for table in self.tables):
            self._fail_all(NoUpstream("no upstream is reachable"))
            return
        for waiter in list(self._queue):
            if waiter.future.done():
                self._queue.remove(waiter)
                continue
            if not self._any_idle_slot():
                break  # nobody can be served: planning again for each waiter would be wasted
            if waiter.exclusive:
                if not self._serve_exclusive(waiter, now):
                    break  # a barrier: later requests must not starve it of a whole upstream
                continue
            self._serve(waiter, now)
        self._arm_timer(now)

    def _any_idle_slot(self) -> bool:
        return any(not slot.busy for table in self.tables if table.healthy for slot in table.slots)

    def _fail_all(self, error: Exception) -> None:
        for waiter in self._queue:
            if not waiter.future.done():
                waiter.future.set_exception(error)
        self._queue.clear()

    def _serve(self, waiter: _Waiter, now: float) -> None:
        views, slots = self._views(waiter, now)
        request = RouteRequest(len(waiter.prompt), waiter.session, waiter.may_wait(now))
        plan = self._named_slot_plan(waiter.slot_id)
        if plan is None:
            plan = self.policy.plan(request, views, self._upstream_views())
        if isinstance(plan, UseSlot):
            table = self.tables[plan.upstream]
            slot = table.slots[plan.slot_id]
            if slot.busy:  # a policy that names a busy slot is ignored, never obeyed
                return
            predicted = slots[(plan.upstream, plan.slot_id)]
            isolate = not slot.empty and predicted.high == 0 and not self._owns(waiter, slot)
            if waiter.opaque and not isolate:
                # its own text (or nothing): the server may reuse any of it, none of it known
                predicted = ReuseBounds(0, slot.n_ctx)
            previous = SlotContent(slot.known, slot.unknown_tail, self._owner(slot, waiter))
            slot.busy = True
            slot.version += 1
            slot.lease_started = now
            slot.tenant = waiter.tenant
            slot.session = waiter.session
            # from now on the slot is being filled with this prompt: whoever considers waiting
            # for it must compare against that, not against what it held before
            slot.hold(list(waiter.prompt), UNKNOWN)
            self._queue.remove(waiter)
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
                )
            )
        elif isinstance(plan, WaitForSlot) and waiter.wait_deadline is None:
            waiter.wait_deadline = now + plan.max_wait_s
        elif isinstance(plan, QueueUntilFree):
            pass

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
        self._queue.remove(waiter)
        waiter.future.set_result(
            UpstreamLease(table, now - waiter.arrived, waiter.tenant, not foreign, foreign)
        )
        return True

    def _foreign(self, waiter: _Waiter, table: UpstreamSlots) -> list[SlotState]:
        """The slots of `table` that hold text the waiter's tenant may not reuse."""
        return [slot for slot in table.slots if not slot.empty and not self._owns(waiter, slot)]

    def _views(
        self, waiter: _Waiter, now: float
    ) -> tuple[list[SlotCandidate], dict[tuple[int, int], ReuseBounds]]:
        views, bounds = [], {}
        for table in self.tables:
            for slot in table.slots:
                shared = slot.shared_with(waiter.prompt)
                reuse = self._reuse(slot, waiter, shared)
                bounds[(table.index, slot.slot_id)] = reuse
                expected, lost = reuse.low, slot.tokens_lost_to(waiter.prompt, shared)
                if self._same_opaque_prompt(waiter, slot):
                    # its ids are unknown, but it starts as the one the slot holds: the server
                    # will reuse about all of it, and nothing worth keeping is lost
                    expected, lost = slot.n_tokens or 0, 0
                views.append(
                    SlotCandidate(
                        upstream=table.index,
                        slot_id=slot.slot_id,
                        busy=slot.busy,
                        empty=slot.empty,
                        reuse=expected,
                        lost=lost,
                        last_used=slot.last_used,
                        busy_for_s=now - slot.lease_started if slot.busy else 0.0,
                        session=slot.session,
                    )
                )
        return views, bounds

    def _same_opaque_prompt(self, waiter: _Waiter, slot: SlotState) -> bool:
        """An opaque prompt whose affinity key (its start, see `acquire_opaque`) is the one the
        slot last served, for the same tenant."""
        return (
            waiter.opaque
            and waiter.cache_prompt
            and waiter.session is not None
            and slot.session == waiter.session
            and self._owns(waiter, slot)
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

    def _reuse(self, slot: SlotState, waiter: _Waiter, shared: int) -> ReuseBounds:
        if not waiter.cache_prompt:
            return ReuseBounds(0, 0)
        bounds = slot.reuse_bounds(waiter.prompt, shared)
        if self._owns(waiter, slot):
            return bounds
        # Another tenant's slot: only tokens of a public prefix may be shared, and only when
        # the server's reuse is known to stop inside it (else it must reuse nothing at all).
        if bounds.low == bounds.high and 0 < bounds.high <= waiter.public_prefix_length:
            return bounds
        return ReuseBounds(0, 0)

    def _upstream_views(self) -> list[UpstreamView]:
        return [
            UpstreamView(
                index=table.index,
                in_flight=sum(slot.busy for slot in table.slots),
                prefill_ms_per_token=table.prefill_ms_per_token.value,
                expected_request_s=table.request_s.value,
                ram_cache=table.ram_cache,
                healthy=table.healthy,
            )
            for table in self.tables
        ]

    def _arm_timer(self, now: float) -> None:
        """Plan again when the first bounded wait for a busy slot runs out."""
        deadlines = [w.wait_deadline for w in self._queue if w.wait_deadline is not None]
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        future = [deadline for deadline in deadlines if deadline > now]
        if future:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(min(future) - now, self._dispatch)
