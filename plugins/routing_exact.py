"""The default routing policy: the idle slot with the cheapest expected prefill, by exact prefix.

Cost of a slot, in milliseconds: the prompt tokens it leaves to decode, at the upstream's measured
prefill speed, slowed by the requests already running there (a server shares its compute among
its slots, so a busy upstream is not chosen only because it holds a prefix), plus a charge for
the tokens it would overwrite (`loss_weight` of their prefill cost: they may be asked for again).
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
        best_idle = min(idle, key=lambda s: self._cost_ms(request, s, upstreams), default=None)
        wait = self._best_wait(request, healthy, idle, upstreams)
        if wait is not None and (
            best_idle is None or wait[0] < self._cost_ms(request, best_idle, upstreams)
        ):
            busy = wait[1]
            return WaitForSlot(busy.upstream, busy.slot_id, self.options.max_wait_s)
        if best_idle is None:
            return QueueUntilFree()
        return UseSlot(best_idle.upstream, best_idle.slot_id)

    def _cost_ms(
        self, request: RouteRequest, slot: SlotCandidate, upstreams: Sequence[UpstreamView]
    ) -> tuple:
        """Expected cost of serving the request on `slot` once it is free, then tie-breakers."""
        upstream = upstreams[slot.upstream]
        per_token = upstream.prefill_ms_per_token * (1 + upstream.in_flight)
        prefill = (request.n_prompt_tokens - slot.reuse) * per_token
        overwrite = self.options.loss_weight * slot.lost * upstream.prefill_ms_per_token
        session = SESSION_BONUS_MS if request.session and slot.session == request.session else 0.0
        # ties: the least recently used slot, then the lowest upstream and slot id
        return (prefill + overwrite - session, slot.last_used, slot.upstream, slot.slot_id)

    def _best_wait(
        self,
        request: RouteRequest,
        slots: Sequence[SlotCandidate],
        idle: Sequence[SlotCandidate],
        upstreams: Sequence[UpstreamView],
    ) -> tuple[tuple, SlotCandidate] | None:
        """The busy slot worth waiting for, if any, with the cost of waiting for it.

        Waiting for the slot that holds the prefix also spares another slot: taking an idle one
        would copy the prefix there and evict whatever that slot held. But never wait on a
        busier upstream while a less busy one has a slot free: that idles a whole server.
        """
        if not request.may_wait or self.options.max_wait_s <= 0:
            return None
        least_busy_with_room = min(
            (upstreams[slot.upstream].in_flight for slot in idle), default=None
        )
        options = []
        for slot in slots:
            if not slot.busy or slot.reuse == 0:
                continue
            upstream = upstreams[slot.upstream]
            if least_busy_with_room is not None and least_busy_with_room < upstream.in_flight:
                continue
            remaining_ms = 1000 * max(
                upstream.expected_request_s - slot.busy_for_s, MIN_REMAINING_S
            )
            cost = self._cost_ms(request, slot, upstreams)
            options.append(((remaining_ms + cost[0], *cost[1:]), slot))
        return min(options, key=lambda option: option[0], default=None)


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
