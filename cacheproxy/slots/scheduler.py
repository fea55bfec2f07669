"""Hands slots to requests: one request per slot, bounded per-tenant queues, the policy's choice.

The proxy never pins a slot that is busy: llama-server would defer the task, and, with its RAM
cache on, snapshot and possibly overwrite the running slot's KV while deferring. So a slot is
leased to one request at a time, and a request that finds no slot waits here, not upstream;
except that, with the RAM cache known off, one request of a slot's tenant that keeps its running
prompt may be sent behind it, to wait at the server (line_up.py).

Waiting requests are kept per tenant and ordered by the fair queue (fair_queue.py): it decides
whose request goes next, the routing policy which slot it gets, from what it sees of each slot
(slot_views.py). The queue is bounded per tenant and in total (queue_bounds.py). A waiter may
take an idle slot only within its tenant's share of the slots while other tenants are active
(slot_share.py, kept by share_pacing.py): a flooding tenant never takes the slot another's next
request needs.

The scheduler is the one writer of slot state: who holds a slot, what it holds, its lease. The
executor and the disk tier read it (through leases, which they cannot change) and hand their
findings back through the methods below: a finished request's outcome, the disk tier's
preparation of a slot, a whole upstream's report, a correction from `GET /slots`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from cacheproxy.disk.policy import WHOLE_STATE_SLACK
from cacheproxy.ops.held_tasks import HeldTasks
from cacheproxy.slots import slot_records
from cacheproxy.slots.fair_queue import EQUAL_SHARE, FairQueue, Share
from cacheproxy.slots.grants import grant, group_picks
from cacheproxy.slots.lease_outcome import ContinueRates, Verdict, learn_timings
from cacheproxy.slots.lease_terms import foreign_leases, relet
from cacheproxy.slots.line_up import (
    ArchivesFrom,
    EitherOrder,
    LinedUp,
    Running,
    either_order,
    held_after,
    hull,
    line_up_target,
    may_be_followed,
    may_line_up,
    nothing_archived,
    running_reuse_either_way,
)
from cacheproxy.slots.queue_bounds import make_room, retry_after_s
from cacheproxy.slots.queued_ahead import QueuedAhead
from cacheproxy.slots.routing import (
    RouteRequest,
    RoutingPolicy,
    UseSlot,
    WaitForSlot,
)
from cacheproxy.slots.share_pacing import SharePacing
from cacheproxy.slots.slot_hints import named_by
from cacheproxy.slots.slot_views import (
    SlotKey,
    any_healthy,
    any_idle_slot,
    cleanest_idle_upstream,
    named_slot_plan,
    owner_of,
    reuse_on,
    slot_candidates,
    tables_of,
    upstream_views,
)
from cacheproxy.slots.waiter import FindRestorable, UpstreamLease, Waiter
from cacheproxy.upstreams.adapters import Requested
from cacheproxy.upstreams.ram_shadow import RamPrediction
from cacheproxy.upstreams.slot_table import (
    UNANSWERED,
    UNKNOWN,
    Lease,
    ReuseBounds,
    SlotState,
    TaskOutcome,
    UpstreamSlots,
    branch_point,
)
from cacheproxy.upstreams.slots_report import written_slots

log = logging.getLogger(__name__)


class NoUpstream(Exception):
    """Every upstream went away while the request waited."""


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
        on_waited: Callable[[str, float], None] = lambda reason, seconds: None,
        line_up: bool = False,
        on_lined_up: Callable[[], None] = lambda: None,
        archives_from: ArchivesFrom | None = None,
    ) -> None:
        self.tables = list(tables)
        # told, as each waiter is served, why it waited last and how long it waited in all
        self.on_waited = on_waited
        # a request may be sent behind its tenant's running one, to wait at the server
        self.line_up = line_up
        self.on_lined_up = on_lined_up  # told of each request lined up
        # by upstream index, the fewest tokens of a slot the disk tier archives at eviction
        self.archives_from = archives_from or nothing_archived
        # by id of the slot: the leased requests others may be lined up behind, and the
        # request lined up behind each (one at a time); by id of its provisional lease, the
        # lined-up request until the stages take its handover
        self._running: dict[int, Running] = {}
        # by id of the slot: leased requests that may be followed once they are sent (`sent`),
        # not before: one lined up behind could reach the server first, and run on the slot
        # before the disk tier's save or restore there (what it saved would be that one's)
        self._unsent: dict[int, tuple[Running, Waiter, Lease]] = {}
        # by id of the slot: a lined-up request handed the slot, and the orders the server
        # may have run it and the one it followed in (settled by its answer)
        self._either: dict[int, EitherOrder] = {}
        self._behind: dict[int, LinedUp] = {}
        self._provisional: dict[int, LinedUp] = {}
        self.open_tenant = open_tenant  # who everyone is while no tenants are configured
        self.policy = policy
        self.max_queue = max_queue
        # a tenant's own bound on waiting requests, unless its request brings one (None: none)
        self.max_queue_per_tenant = max_queue_per_tenant
        self.clock = clock
        self._queue: FairQueue[Waiter] = FairQueue(fair_share, batch_factor)
        self._timer: asyncio.TimerHandle | None = None
        # the waiters given a bounded wait for a busy slot (some may have left the queue): the
        # timer looks at these, not at every waiter, on each dispatch
        self._bounded: list[Waiter] = []
        # the slot share's records: who holds each leased slot until when, who was active when
        # read through `self.clock`: one clock for both (a test sets it to move time on)
        self._pacing = SharePacing(
            self._queue, lambda: self.clock(), share_window_s, chunked_prefill
        )
        self._continues = ContinueRates()
        self._lookups = HeldTasks()  # the disk tier's, for waiters

    @property
    def queued(self) -> int:
        """Requests waiting for a slot: in the queue, or lined up at the server."""
        return len(self._queue) + len(self._behind)

    def queued_for(self, tenant: str) -> int:
        return self._queue.waiting(tenant) + self._lined_up_for(tenant)

    def _lined_up_for(self, tenant: str) -> int:
        """The tenant's requests lined up at the server, not yet started (one a slot at most)."""
        return sum(lined.waiter.tenant == tenant for lined in self._behind.values())

    def continue_chance(self, tenant: str | None) -> float:
        """How often `tenant`'s requests lately continued the whole text they reused rather
        than branched off it (1 until any reused one)."""
        return self._continues.chance(tenant)

    def exact_continue_chance(self, tenant: str | None) -> float:
        """The same, counting only the requests that left out at most one of its tokens."""
        return self._continues.exact_chance(tenant)

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
        tables: frozenset[int] | None = None,
        restorable: FindRestorable | None = None,
        generates_at_most: int | None = None,
        lora: Requested = None,
    ) -> Lease:
        """A slot for `prompt`. `patient=False` takes the best idle slot, never waiting for a
        busy one: the tasks of one split request must run side by side, not wait for each other
        to reuse the prompt they share. `share` places it among the tenants (weight, class);
        `queue_bound` is the tenant's own bound on waiting requests (None: the scheduler's);
        `slot_id`: the slot the client named, waited for rather than chosen (the caller checked
        that one of the upstreams has it); `tables`: the upstreams it may be placed on, those
        serving the model it names (None: any); `restorable`: the disk tier's lookup of the
        tenant's archive for the prompt, asked if the request would wait for a busy slot;
        `generates_at_most`: its task's bound on the tokens it generates (None: none known);
        `lora`: the LoRA scales its body names (None: the servers' global ones)."""
        self._admit(tenant, queue_bound)
        waiter = Waiter(prompt, tenant, session, cache_prompt, False, self.clock())
        waiter.public_prefix_length = public_prefix_length
        waiter.patient, waiter.share, waiter.slot_id = patient, share or EQUAL_SHARE, slot_id
        waiter.tables, waiter.find_restorable = tables, restorable
        waiter.generates_at_most, waiter.lora = generates_at_most, lora
        return await self._await(self._enqueue(waiter))

    async def acquire_group(
        self,
        prompt: list[int],
        tenant: str,
        count: int,
        session: str | None = None,
        cache_prompt: bool = True,
        public_prefix_length: int = 0,
        share: Share | None = None,
        queue_bound: int | None = None,
        tables: frozenset[int] | None = None,
        lora: Requested = None,
    ) -> list[Lease]:
        """`count` slots for `prompt`, all at once (grants.py): one waiter in its tenant's
        queue, held to its share for all of them, a grant each; impatient, as `acquire`;
        `tables` and `lora` as there."""
        self._admit(tenant, queue_bound)
        waiter = Waiter(prompt, tenant, session, cache_prompt, False, self.clock())
        waiter.public_prefix_length = public_prefix_length
        waiter.patient, waiter.share, waiter.count = False, share or EQUAL_SHARE, count
        waiter.tables, waiter.lora = tables, lora
        return await self._await(self._enqueue(waiter))

    async def acquire_opaque(
        self,
        tenant: str,
        session: str | None = None,
        share: Share | None = None,
        queue_bound: int | None = None,
        tables: frozenset[int] | None = None,
        lora: Requested = None,
    ) -> Lease:
        """One slot for a task whose prompt ids are not known (`/infill`): the policy sees an
        empty prompt, so it picks the slot whose loss costs least, unless a slot of the
        tenant's last served the same `session` (for infill, a key of how its prompt starts),
        which the server will then mostly reuse."""
        self._admit(tenant, queue_bound)
        waiter = Waiter([], tenant, session, True, False, self.clock(), opaque=True)
        waiter.share, waiter.tables, waiter.lora = share or EQUAL_SHARE, tables, lora
        return await self._await(self._enqueue(waiter))

    async def acquire_upstream(
        self,
        tenant: str,
        share: Share | None = None,
        queue_bound: int | None = None,
        tables: frozenset[int] | None = None,
        lora: Requested = None,
    ) -> UpstreamLease:
        self._admit(tenant, queue_bound)
        waiter = Waiter([], tenant, None, False, True, self.clock())
        waiter.share, waiter.tables, waiter.lora = share or EQUAL_SHARE, tables, lora
        return await self._await(self._enqueue(waiter))

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
                exactly = held - predicted.low <= WHOLE_STATE_SLACK
                self._lineage_seen(lease, branch_point(held, predicted.low), predicted.low, exactly)
            return lease
        lease.slot.branch = branch  # its text now comes from the archive, or from nothing
        if not isolate:
            self._lineage_seen(lease, branch, predicted.low)
        return relet(lease, predicted, isolate)

    def _lineage_seen(
        self, lease: Lease, branched: int | None, reused: int, exactly: bool | None = None
    ) -> None:
        """The leased request reused `reused` tokens of a text and branched off it at
        `branched` (None: it continued all of it; `exactly`: leaving out at most one of its
        tokens, None: not known): one more sample of how its tenant's requests use what they
        reuse."""
        tenant = lease.slot.tenant
        if reused <= 0 or tenant is None or lease.opaque:
            return
        self._continues.seen(tenant, continued=branched is None, exactly=exactly)

    async def chunk_turn(self, lease: Lease, remaining: int) -> None:
        """Wait, before the next chunk of the leased prompt, while another tenant within its
        share has a prompt being computed (the chunk would be computed beside it); then mark the
        `remaining` tokens as being computed, so the tenant starts no other prompt meanwhile."""
        rate_s = lease.table.prefill_ms_per_token.value / 1000
        await self._pacing.chunk_turn(lease.slot, remaining, rate_s, self.tables)

    def prefill_ended(self, lease: Lease) -> None:
        """The leased request's first token came (its stream's first event): its prompt is
        computed, whatever the estimate said. A tenant held to one prompt at a time may start
        its next, and chunks paused for this one go on."""
        if self._pacing.prefill_ended(lease.slot) and self._queue:
            self._dispatch()

    def chunk_done(self, lease: Lease, computed: int) -> None:
        """A chunk ended: the leased slot holds exactly the prompt's first `computed` tokens,
        computed under the request's LoRA scales (its chunks name them)."""
        lease.slot.hold(lease.prompt[:computed])
        lease.slot.adapters = lease.adapters

    def chunks_done(self, lease: Lease) -> Lease:
        """The chunks ended: the slot is being filled with the whole prompt again, as leased,
        and the request reuses what they computed, the tenant's own text (no isolation)."""
        lease.slot.hold(list(lease.prompt), UNKNOWN)
        lease.slot.adapters = lease.adapters
        return relet(lease, lease.predicted, isolate=False)

    def release(self, lease: Lease, outcome: TaskOutcome) -> Verdict:
        """Record what the slot now holds, free it (to the request lined up behind it, if
        any), and serve whoever waits."""
        if self._drop_lined_up(lease):
            return Verdict(lease.predicted, None)  # given back unsent: it never took the slot
        now = self.clock()
        predicted = lease.predicted
        if (lined := self._behind.get(id(lease.slot))) is not None:
            predicted = running_reuse_either_way(lease, lined)  # it may have run first
        self._not_followed(lease)
        slot_records.released(lease, outcome, now)
        if (either := self._either.pop(id(lease.slot), None)) is not None:
            predicted = hull(predicted, either.swapped)  # it may have been read first
            if outcome.ok and outcome.cache_n is not None:
                held = held_after(lease.slot, either, outcome.cache_n)
                if held is not None:
                    slot_records.ran_last(lease.slot, *held)
        prefill_end = self._pacing.given_back(lease.slot, now)
        learn_timings(lease.table, lease.slot.lease_started, now, prefill_end, outcome)
        self._hand_over(lease, now)
        self._dispatch()
        return Verdict(predicted, None if outcome.cut else outcome.cache_n)

    def sent(self, lease: Lease) -> None:
        """The leased request is on its way to the server: others of its tenant may be lined
        up behind it from now on (line_up.py), if its lease, as prepared, still allows it."""
        unsent = self._unsent.pop(id(lease.slot), None)
        if unsent is None:
            return  # not one to follow, or lined up itself (followed once handed the slot)
        running, waiter, granted = unsent
        if lease is not granted:  # the disk tier restored or emptied the slot first
            running = replace(running, before=None)
        if may_be_followed(lease, waiter):
            self._running[id(lease.slot)] = running
            if self._queue:
                self._dispatch()

    def _not_followed(self, lease: Lease) -> None:
        """Nobody more is lined up behind the leased request."""
        self._running.pop(id(lease.slot), None)
        self._unsent.pop(id(lease.slot), None)

    def take_handover(self, lease: Lease) -> asyncio.Future[Lease] | None:
        """For a provisional lease (a request lined up behind a running one, line_up.py): the
        lease its request runs on, once the running one is given back; None for any other
        lease. Asked once, as the request's stages start on it."""
        lined = self._provisional.pop(id(lease), None)
        return None if lined is None else lined.handover

    def cut(self, lease: Lease) -> bool:
        """The leased request was cut before its answer ended: nobody is lined up behind it
        any more (its slot is read to learn what it computed). True when one already is: the
        slot, taken by that one as soon as the server lets go, cannot be read for it."""
        self._not_followed(lease)
        return id(lease.slot) in self._behind

    def _drop_lined_up(self, lease: Lease) -> bool:
        """Give back a provisional lease whose request never went out (True), if it is one:
        the slot's, if it was handed over meanwhile, as a request that did not run."""
        lined = self._provisional.pop(id(lease), None)
        if lined is None:
            return False
        if lined.handover.done():
            self.release(lined.handover.result(), UNANSWERED)
        else:
            del self._behind[id(lease.slot)]
            lined.handover.cancel()
        return True

    def _hand_over(self, lease: Lease, now: float) -> None:
        """The slot `lease` held is free: grant it to the request lined up behind it (already
        at the server), as to a waiter, on what the slot now holds. Whatever the request given
        back did there, the slot holds only their tenant's text (line_up.py)."""
        lined = self._behind.pop(id(lease.slot), None)
        if lined is None:
            return
        waiter, table, slot = lined.waiter, lease.table, lease.slot
        slot_records.handed_over(slot, waiter.tenant, table.scales_of(waiter.lora))
        reuse = reuse_on(slot, waiter, slot.shared_with(waiter.prompt), own=True)
        either = either_order(lined, slot, reuse)  # the server may have read it first
        key = (table.index, slot.slot_id)
        plan = UseSlot(table.index, slot.slot_id)
        granted = self._grant(waiter, plan, {key: reuse}, {}, now, sent=True)
        self._either[id(slot)] = either
        if granted.chunked:  # it went out whole
            granted = replace(granted, chunked=False)
        lined.handover.set_result(granted)

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
            written = changed.get(slot.slot_id)
            slot_records.released_whole(slot, lease.tenant, written, slot.slot_id in erased, now)
            self._pacing.given_back(slot, now)
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
            slot_records.probed(slot, erased)
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

    def _admit(self, tenant: str, queue_bound: int | None) -> None:
        """Room for one more waiter of `tenant`, or its refusal (raised), or another's
        (queue_bounds.py)."""
        bound = queue_bound if queue_bound is not None else self.max_queue_per_tenant
        # a request lined up at the server waits for a slot as much as one in the queue
        lined_up = (self._lined_up_for(tenant), len(self._behind))
        gives_way = make_room(self._queue, tenant, bound, self.max_queue, self.tables, lined_up)
        if gives_way is not None:
            pushed_out, refusal = gives_way
            self._queue.remove(pushed_out)
            pushed_out.future.set_exception(refusal)

    def _enqueue(self, waiter: Waiter) -> Waiter:
        self._pacing.arrived(waiter.tenant, waiter.arrived, waiter.share)
        self._queue.push(waiter, waiter.tenant, waiter.share, waiter.slots_wanted)
        self._dispatch()
        if not waiter.future.done() and waiter.waiting_for is None:
            waiter.waiting_for = "slots_busy"  # not even planned: no slot it may take was idle
        return waiter

    def retry_after_s(self, waiting: int) -> int:
        """Seconds until about `waiting` more requests have been served (queue_bounds.py)."""
        return retry_after_s(self.tables, waiting)

    async def _await(self, waiter: Waiter):  # noqa: ANN202 - a Lease or an UpstreamLease
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
                granted = waiter.future.result()
                for lease in granted if isinstance(granted, list) else [granted]:
                    self._abandon(lease)
            self._dispatch()
            raise

    def _abandon(self, lease: Lease | UpstreamLease) -> None:
        """A lease whose request never went out: a pinned slot was relabelled and filled in
        the table, so what it holds is unknown here; an upstream's slots were left as they were."""
        now = self.clock()
        if isinstance(lease, UpstreamLease):
            for slot in lease.table.slots:
                slot.busy = False
                self._pacing.given_back(slot, now)
            return
        if self._drop_lined_up(lease):
            return
        self._not_followed(lease)
        self._either.pop(id(lease.slot), None)
        slot_records.abandoned(lease)
        self._pacing.given_back(lease.slot, now)
        self._hand_over(lease, now)

    def _dispatch(self) -> None:
        """Serve waiters in the fair queue's order, as far as slots allow.

        A waiter that cannot be served now (it waits for one busy slot, or its tenant is at
        its share while others are active) is passed over, so the tenants after it are served
        meanwhile; after each grant the order is asked again, since the tenant served has
        moved back."""
        if not self._queue and self._timer is None:
            return
        now = self.clock()
        if self.tables and not any_healthy(self.tables):
            self._fail_all(NoUpstream("no upstream is reachable"))
            return
        passed_over: set[int] = set()  # serving others only takes slots: still unservable
        awaited = QueuedAhead()  # busy slots the waiters ahead wait for: a wait lasts theirs
        held_back = False  # a waiter was kept within its tenant's share
        served = True
        # with every slot busy nobody can be served: the queue is not even put in order (a
        # request arriving at a saturated proxy, or one that takes the last idle slot)
        while served and self._queue and any_idle_slot(self.tables):
            served = False
            # a grant changes who is below their share: ask again after each
            beyond_share: set[str] = set()
            for waiter in self._queue.order():
                if id(waiter) in passed_over or waiter.tenant in beyond_share:
                    continue
                if waiter.future.done():
                    self._queue.remove(waiter)
                    continue
                # a split request's tasks are held to it too, all of a prompt's at once
                if not waiter.exclusive and not self._pacing.within_share(
                    waiter.tenant, now, self.tables, waiter.slots_wanted
                ):
                    beyond_share.add(waiter.tenant)
                    held_back = True
                    waiter.waiting_for = "share"
                    continue
                if waiter.exclusive:
                    # a barrier: later requests must not starve it of a whole upstream. It is
                    # its tenant's turn, and the wait ends when the running requests do.
                    served = self._serve_exclusive(waiter, now)
                    break
                if self._serve(waiter, now, awaited):
                    served = True
                    break
                passed_over.add(id(waiter))
                if waiter.count is not None:
                    # slots free one at a time: its tenant's later requests must not take
                    # each as it frees, or the ones it waits for would never all be idle
                    beyond_share.add(waiter.tenant)
        if self._queue and self._followable() and not any_idle_slot(self.tables):
            self._line_up_waiters(now)
        self._arm_timer(now, self._pacing.expiry(now) if held_back else None)

    def _line_up_waiters(self, now: float) -> None:
        """With every slot busy, line up the waiters at the head of the queue as far as they
        may be (line_up.py): one that may not keeps its turn, and nobody after it passes it
        (a stream of requests lined up one behind the other would keep it from every slot)."""
        for waiter in self._queue.order():
            if waiter.future.done():
                continue
            if not self._followable() or not self._lined_up(waiter, now):
                return

    def _fail_all(self, error: Exception) -> None:
        for waiter in self._queue:
            if not waiter.future.done():
                waiter.future.set_exception(error)
            self._queue.remove(waiter)

    def _serve(self, waiter: Waiter, now: float, awaited: QueuedAhead) -> bool:
        """Lease the policy's slot (a group's slots) to `waiter`; False when it must wait (a
        wait for one busy slot is added to `awaited`)."""
        tables = tables_of(self.tables, waiter.tables)  # those serving its model
        if tables is None:  # none of them in service
            waiter.future.set_exception(NoUpstream("no upstream serving its model is reachable"))
            self._queue.remove(waiter)
            return False
        if waiter.cache_prompt and waiter.prompt:
            # slots whose ids only a hint tells (a takeover): the prompt may name them
            for slot, count in named_by(tables, waiter.prompt, waiter.tenant, self.open_tenant):
                slot_records.named(slot, waiter.prompt, count)
        views, slots, predictions = slot_candidates(
            tables,
            waiter,
            self._pacing.holders,
            self.open_tenant,
            now,
            awaited.seconds(waiter.tenant, self.tables),
            self.archives_from,
        )
        if waiter.count is not None:
            picks = group_picks(self.policy, self.tables, waiter, views)
            if picks is None:
                return False
            leases = [self._grant(waiter, pick, slots, predictions, now) for pick in picks]
            self._served(waiter, now)
            waiter.future.set_result(leases)
            return True
        request = RouteRequest(
            len(waiter.prompt), waiter.session, waiter.may_wait(now), waiter.restorable
        )
        plan = named_slot_plan(tables, waiter.slot_id)
        if plan is None:
            plan = self.policy.plan(request, views, upstream_views(self.tables))
        if isinstance(plan, UseSlot):
            # a policy that names a busy slot is ignored, never obeyed; one being saved in the
            # background goes to a waiter as soon as the save ends
            if self.tables[plan.upstream].slots[plan.slot_id].busy:
                waiter.waiting_for = "saving"
                return False
            lease = self._grant(waiter, plan, slots, predictions, now)
            self._served(waiter, now)
            waiter.future.set_result(lease)
            return True
        if isinstance(plan, WaitForSlot):
            if self._lined_up(waiter, now, self.tables[plan.upstream].slots[plan.slot_id]):
                return True
            waiter.waiting_for = "busy_slot_chosen" if waiter.slot_id is None else "named_slot"
            if waiter.slot_id is None:
                self._look_up_archive(waiter)
            awaited.waits(plan, waiter.tenant, len(waiter.prompt), views, self.tables)
            if waiter.wait_deadline is None:
                waiter.wait_deadline = now + plan.max_wait_s
                self._bounded.append(waiter)
            return False
        if self._lined_up(waiter, now):
            return True
        waiter.waiting_for = "slots_busy"
        return False  # QueueUntilFree: planned again when a slot is released

    def _look_up_archive(self, waiter: Waiter) -> None:
        """Ask the disk tier, once, what its tenant's archive holds of the waiter's prompt: an
        idle slot it is restored into may beat the wait (planned again once it answers)."""
        find, waiter.find_restorable = waiter.find_restorable, None
        if find is None:
            return
        task = self._lookups.start(find(), "slots.archive-lookup")
        task.add_done_callback(functools.partial(self._archive_found, waiter))

    def _archive_found(self, waiter: Waiter, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if (error := task.exception()) is not None:
            log.warning("archive lookup for a waiting request failed: %r", error)
            return
        if task.result() and not waiter.future.done():
            waiter.restorable = task.result()
            self._dispatch()

    def _grant(
        self,
        waiter: Waiter,
        plan: UseSlot,
        bounds: dict[SlotKey, ReuseBounds],
        predictions: dict[SlotKey, RamPrediction],
        now: float,
        sent: bool = False,
    ) -> Lease:
        """Lease the planned slot to `waiter`; `sent`: its request is at the server already (a
        request lined up, handed the slot)."""
        key = (plan.upstream, plan.slot_id)
        table = self.tables[plan.upstream]
        slot = table.slots[plan.slot_id]
        owner = owner_of(slot, waiter.tenant, self.open_tenant)
        chances = (self.continue_chance(owner), self.exact_continue_chance(owner))
        lease = grant(
            waiter, table, slot, owner, chances, bounds[key], predictions.get(key),
            self._pacing, self.tables, now,
        )  # fmt: skip
        slot_records.granted(
            slot, waiter.tenant, waiter.session, waiter.prompt, now, lease.adapters
        )
        if self.line_up and may_be_followed(lease, waiter):
            running = Running(waiter.tenant, table, slot, waiter.generates_at_most, lease.previous)
            if sent:
                self._running[id(slot)] = running
            else:
                self._unsent[id(slot)] = (running, waiter, lease)
        return lease

    def _followable(self) -> bool:
        """Whether a running request has nobody lined up behind it yet."""
        return any(key not in self._behind for key in self._running)

    def _lined_up(self, waiter: Waiter, now: float, only: SlotState | None = None) -> bool:
        """Serve `waiter` on a provisional lease behind a running request of its tenant, where
        line_up.py allows one (`only`: behind the one on that slot); False when it does not."""
        if (
            not self._followable()
            or not may_line_up(waiter)
            or not self._pacing.alone(waiter.tenant, now)  # the next slot freed may be another's
            or self._pacing.in_chunks(waiter, now, self.tables)
        ):
            return False
        free = (
            running
            for key, running in self._running.items()
            if key not in self._behind and (only is None or running.slot is only)
        )
        target = line_up_target(waiter, free, self.archives_from)
        if target is None:
            return False
        slot = target.slot
        # provisional: what it will reuse is known once the running one ends (`_hand_over`)
        predicted, queued_s = slot.reuse_bounds(waiter.prompt), now - waiter.arrived
        previous = slot.content(waiter.tenant)
        adapters = target.table.scales_of(waiter.lora)
        lease = Lease(
            target.table, slot, waiter.prompt, predicted, queued_s, False, previous,
            adapters=adapters, names_scales=waiter.lora is not None,
        )  # fmt: skip
        lined = LinedUp(waiter, lease, asyncio.get_running_loop().create_future(), target)
        self._behind[id(slot)] = self._provisional[id(lease)] = lined
        self._served(waiter, now)
        self.on_lined_up()
        waiter.future.set_result(lease)
        return True

    def _serve_exclusive(self, waiter: Waiter, now: float) -> bool:
        """A whole idle upstream, one whose slots hold only the waiter's text or nothing if
        there is one (the server may then reuse whatever slot it picks)."""
        tables = tables_of(self.tables, waiter.tables)  # those serving its model
        if tables is None:  # none of them in service
            waiter.future.set_exception(NoUpstream("no upstream serving its model is reachable"))
            self._queue.remove(waiter)
            return False
        table = cleanest_idle_upstream(tables, waiter.tenant, self.open_tenant, waiter.lora)
        if table is None:
            waiter.waiting_for = "whole_upstream"
            return False
        foreign = foreign_leases(
            table, waiter.tenant, self.open_tenant, now - waiter.arrived, waiter.lora
        )
        for slot in table.slots:
            slot_records.taken(slot, now)
            self._pacing.leased(slot, waiter.tenant, now)  # its prompts are not known
        self._served(waiter, now)
        waiter.future.set_result(
            UpstreamLease(table, now - waiter.arrived, waiter.tenant, not foreign, foreign)
        )
        return True

    def _served(self, waiter: Waiter, now: float) -> None:
        self._queue.served(waiter)
        if waiter.waiting_for is not None:  # else served as it arrived: it did not wait
            self.on_waited(waiter.waiting_for, now - waiter.arrived)

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
            deadlines += [until for _, until in self._pacing.holders.values() if until > now]
        if share_expiry is not None:
            deadlines.append(share_expiry)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        future = [deadline for deadline in deadlines if deadline > now]
        if future:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(min(future) - now, self._dispatch)
