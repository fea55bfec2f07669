"""The default routing policy: the idle slot with the cheapest expected prefill, by exact prefix.

Cost of a slot, in milliseconds: the prompt tokens it leaves to decode, at what a token costs the
server (measured across its batches), once for this request and once for each request running
there (a server shares its compute among its slots: the prompt waits for theirs, and delays them
as long), plus a charge for the tokens it would overwrite (`loss_weight` of their prefill cost:
they may be asked for again). So a busy upstream is not chosen only because it holds a prefix,
and a shared prefix is not computed again beside the request computing or holding it when
waiting for that one costs less.

Waiting for a busy slot that holds more of the prompt costs the time until its request ends (the
scheduler's estimate from what that request is doing, when it is the requester's own), plus the
rest of the prompt there, computed beside one request fewer; against it, an idle slot of the same
server is priced knowing that request ends then all the same (computed beside it only until then),
so a wait pays only for more reuse, or for the idle slot's text it keeps. An empty idle slot is
credited with one such wait: the prompt computed there leaves one more slot holding the prefix
the busy one holds, which the next request sharing it finds idle rather than waits for (without
it, a shared system prompt held by two slots kept the others empty for good, every request
finding the wait a little cheaper than the copy). And a busy slot whose
prompt is still being computed is waited for while the wait for that prompt costs less than
computing the tokens it shares with this one again: a copy computed on an idle slot meanwhile would
share the server with it and end no sooner, and once that prompt is computed the choice is made
again, knowing more (the prefix computed once is what the wait is for).

A request about to wait is planned once more knowing the requester's own archive on disk
(`RouteRequest.restorable`): a slot's prefill is then the cheaper of computing what the slot does
not hold and restoring the archive before computing the rest. The disk tier restores it into
whichever slot the request gets, so a wait for a busy slot that holds less than the archive buys
nothing an idle slot does not give at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from cacheproxy.slots.routing import (
    QueueUntilFree,
    RoutePlan,
    RouteRequest,
    SlotCandidate,
    UpstreamView,
    UseSlot,
    WaitForSlot,
)

# A running request is assumed to need at least this much longer, however old it is.
MIN_REMAINING_S = 0.05
# A session's own slot wins a tie worth less than this many milliseconds.
SESSION_BONUS_MS = 1e-3


class ExactPrefixRouting:
    class Options(BaseModel):
        loss_weight: float = Field(0.25, ge=0, description="cost of an overwritten token")
        max_wait_s: float = Field(5.0, ge=0, description="longest wait for a busy slot")

    def __init__(self, options: Options, deps: object = None) -> None:
        self.options = options

    def plan(
        self,
        request: RouteRequest,
        slots: Sequence[SlotCandidate],
        upstreams: Sequence[UpstreamView],
    ) -> RoutePlan:
        healthy = [slot for slot in slots if upstreams[slot.upstream].healthy]
        idle = _victim_candidates([s for s in healthy if not s.busy], upstreams)
        best_idle, idle_cost = None, None  # each idle slot's cost worked out once
        for slot in idle:
            cost = self._cost_ms(request, slot, upstreams)
            if idle_cost is None or cost < idle_cost:
                best_idle, idle_cost = slot, cost
        busy = self._best_wait(request, healthy, idle, best_idle, idle_cost, upstreams)
        if busy is not None:
            return WaitForSlot(busy.upstream, busy.slot_id, self.options.max_wait_s)
        if best_idle is None:
            return QueueUntilFree()
        computing = self._prefill_worth_waiting_for(request, healthy, best_idle, upstreams)
        if computing is not None:
            return WaitForSlot(computing.upstream, computing.slot_id, self.options.max_wait_s)
        return UseSlot(best_idle.upstream, best_idle.slot_id)

    def _cost_ms(
        self,
        request: RouteRequest,
        slot: SlotCandidate,
        upstreams: Sequence[UpstreamView],
        running: int | None = None,
        one_ends_in_ms: float | None = None,
    ) -> tuple:
        """Expected cost of serving the request on `slot` once it is free, then tie-breakers;
        `running`: the requests running on its upstream then (None: as many as now), and
        `one_ends_in_ms`: when one of them is expected to end (None: none does meanwhile)."""
        upstream = upstreams[slot.upstream]
        running = upstream.in_flight if running is None else running
        per_token = upstream.prefill_ms_per_token
        prefill = _prefill_ms(
            request.n_prompt_tokens - slot.reuse, per_token, running, one_ends_in_ms
        )
        archived = request.restorable.get(slot.upstream)
        if archived is not None and archived.tokens > slot.reuse:
            rest = request.n_prompt_tokens - archived.tokens
            restored = archived.cost_ms + _prefill_ms(rest, per_token, running, one_ends_in_ms)
            prefill = min(prefill, restored)
        overwrite = self.options.loss_weight * slot.lost * per_token
        session = SESSION_BONUS_MS if request.session and slot.session == request.session else 0.0
        # ties: the least recently used slot, then the lowest upstream and slot id
        return (prefill + overwrite - session, slot.last_used, slot.upstream, slot.slot_id)

    def _best_wait(
        self,
        request: RouteRequest,
        slots: Sequence[SlotCandidate],
        idle: Sequence[SlotCandidate],
        best_idle: SlotCandidate | None,
        idle_cost: tuple | None,
        upstreams: Sequence[UpstreamView],
    ) -> SlotCandidate | None:
        """The busy slot worth waiting for, if any: the cheapest wait that costs less than the
        best idle slot.

        Waiting for the slot that holds the prefix also spares another slot: taking an idle one
        would copy the prefix there and evict whatever that slot held. But never wait on a
        busier upstream while a less busy one has a slot free: that idles a whole server. The
        requests queued ahead that wait for the same slot take it first: the wait lasts theirs.
        The idle slot of the same upstream is priced knowing the awaited request ends all the
        same: only until then is it computed beside that request. So a busy slot reusing no
        more than an idle one is never worth waiting for, but to keep the idle slot's text;
        and not for that either when the disk tier archives that text as it is overwritten
        (`archived`): a restore brings it back, as llama-server's RAM cache would.
        """
        if not request.may_wait or self.options.max_wait_s <= 0:
            return None
        least_busy_with_room = min(
            (upstreams[slot.upstream].in_flight for slot in idle), default=None
        )
        best: tuple[tuple, SlotCandidate] | None = None
        for slot in slots:
            if not slot.busy or slot.reuse == 0:
                continue
            if best_idle is not None and best_idle.archived and slot.reuse <= best_idle.reuse:
                continue  # it would only keep the idle slot's text, which the disk tier keeps
            upstream = upstreams[slot.upstream]
            if least_busy_with_room is not None and least_busy_with_room < upstream.in_flight:
                continue
            # the running request ends, the requests queued ahead for the slot hold it next,
            # then its rest is computed: beside one request fewer
            ends_ms = _remaining_ms(slot, upstream)
            cost = self._cost_ms(request, slot, upstreams, max(upstream.in_flight - 1, 0))
            wait_cost = (ends_ms + 1000 * slot.queued_ahead_s + cost[0], *cost[1:])
            if best_idle is not None and idle_cost is not None:
                idle_then = idle_cost
                if best_idle.upstream == slot.upstream:
                    idle_then = self._cost_ms(request, best_idle, upstreams, None, ends_ms)
                if best_idle.empty:
                    # computed there, the prefix the busy slot holds is held by one more slot:
                    # the next request sharing it finds that one idle and is spared the wait
                    idle_then = (idle_then[0] - ends_ms, *idle_then[1:])
                if not wait_cost < idle_then:
                    continue
            if best is None or wait_cost < best[0]:
                best = (wait_cost, slot)
        return None if best is None else best[1]

    def _prefill_worth_waiting_for(
        self,
        request: RouteRequest,
        slots: Sequence[SlotCandidate],
        best_idle: SlotCandidate,
        upstreams: Sequence[UpstreamView],
    ) -> SlotCandidate | None:
        """A busy slot of the best idle slot's upstream computing a prompt that shares more of
        this one, when waiting for that prompt to be computed costs less than computing the
        tokens it shares again on the idle slot (see the module's docstring); the one that
        spares most for its wait."""
        if not request.may_wait or self.options.max_wait_s <= 0:
            return None
        upstream = upstreams[best_idle.upstream]
        per_token = upstream.prefill_ms_per_token * (1 + upstream.in_flight)
        best, best_gain = None, 0.0
        for slot in slots:
            if not slot.busy or slot.prefill_left_s <= 0 or slot.upstream != best_idle.upstream:
                continue
            spared_ms = (slot.reuse - _reuse_with_archive(request, best_idle)) * per_token
            gain = spared_ms - 1000 * max(slot.prefill_left_s, MIN_REMAINING_S)
            if gain > best_gain:
                best, best_gain = slot, gain
        return best


def _prefill_ms(
    tokens: int, ms_per_token: float, running: int, one_ends_in_ms: float | None
) -> float:
    """Time to compute `tokens` beside `running` requests (a server shares its compute among
    its slots), beside one fewer from `one_ends_in_ms` on when that is given."""
    beside_all = tokens * ms_per_token * (1 + running)
    if one_ends_in_ms is None or running == 0 or beside_all <= one_ends_in_ms:
        return beside_all
    computed_meanwhile = one_ends_in_ms / (ms_per_token * (1 + running))
    return one_ends_in_ms + (tokens - computed_meanwhile) * ms_per_token * running


def _reuse_with_archive(request: RouteRequest, slot: SlotCandidate) -> int:
    """What `slot` lets the request reuse, the requester's archive restored there if longer."""
    archived = request.restorable.get(slot.upstream)
    return slot.reuse if archived is None else max(slot.reuse, archived.tokens)


def _remaining_ms(slot: SlotCandidate, upstream: UpstreamView) -> float:
    """How long the request running on a busy slot is expected to hold it: the scheduler's
    estimate when it has one, else the upstream's mean request time less what has passed."""
    remaining_s = slot.remaining_s
    if remaining_s is None:
        remaining_s = upstream.expected_request_s - slot.busy_for_s
    return 1000 * max(remaining_s, MIN_REMAINING_S)


def _victim_candidates(
    idle: list[SlotCandidate], upstreams: Sequence[UpstreamView]
) -> list[SlotCandidate]:
    """With a server RAM cache, pin a non-empty slot rather than an empty one.

    llama-server consults its RAM cache only when the pinned slot holds something (for an empty
    slot its keep ratio is 0/0, and NaN < 0.5 is false); a non-empty victim is saved to that cache
    first, so nothing is lost. Empty slots remain for when nothing else is idle.
    """
    nonempty_on = {slot.upstream for slot in idle if not slot.empty}
    return [
        slot
        for slot in idle
        if not (slot.empty and upstreams[slot.upstream].ram_cache and slot.upstream in nonempty_on)
    ]
