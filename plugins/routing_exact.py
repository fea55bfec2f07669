"""The default routing policy: the idle slot with the cheapest expected prefill, by exact prefix.

Cost of a slot, in milliseconds: the prompt tokens it leaves to decode, at the upstream's measured
prefill speed, slowed by the requests already running there (a server shares its compute among
its slots, so a busy upstream is not chosen only because it holds a prefix), plus a charge for
the tokens it would overwrite (`loss_weight` of their prefill cost: they may be asked for again).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from cacheproxy.routing import (
    QueueUntilFree,
    RoutePlan,
    RouteRequest,
    SlotView,
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
        slots: Sequence[SlotView],
        upstreams: Sequence[UpstreamView],
    ) -> RoutePlan:
        healthy = [slot for slot in slots if upstreams[slot.upstream].healthy]
        idle = _victim_candidates([s for s in healthy if not s.busy], upstreams)
        best_idle = min(idle, key=lambda s: self._cost_ms(request, s, upstreams), default=None)

        if request.may_wait and self.options.max_wait_s > 0:
            wait = self._worth_waiting(request, healthy, best_idle, upstreams)
            if wait is not None:
                return wait
        if best_idle is None:
            return QueueUntilFree()
        return UseSlot(best_idle.upstream, best_idle.slot_id)

    def _cost_ms(
        self, request: RouteRequest, slot: SlotView, upstreams: Sequence[UpstreamView]
    ) -> tuple:
        upstream = upstreams[slot.upstream]
        per_token = upstream.prefill_ms_per_token * (1 + upstream.in_flight)
        prefill = (request.n_prompt_tokens - slot.reuse) * per_token
        overwrite = self.options.loss_weight * slot.lost * upstream.prefill_ms_per_token
        session = SESSION_BONUS_MS if request.session and slot.session == request.session else 0.0
        # ties: the least recently used slot, then the lowest upstream and slot id
        return (prefill + overwrite - session, slot.last_used, slot.upstream, slot.slot_id)

    def _worth_waiting(
        self,
        request: RouteRequest,
        slots: Sequence[SlotView],
        best_idle: SlotView | None,
        upstreams: Sequence[UpstreamView],
    ) -> WaitForSlot | None:
        busy = [slot for slot in slots if slot.busy and slot.reuse > 0]
        if not busy:
            return None
        best_busy = max(busy, key=lambda s: (s.reuse, -s.upstream, -s.slot_id))
        idle_reuse = best_idle.reuse if best_idle else 0
        upstream = upstreams[best_busy.upstream]
        saved_ms = (best_busy.reuse - idle_reuse) * upstream.prefill_ms_per_token
        remaining_s = max(upstream.expected_request_s - best_busy.busy_for_s, MIN_REMAINING_S)
        if best_idle is not None and remaining_s * 1000 >= saved_ms:
            return None
        return WaitForSlot(best_busy.upstream, best_busy.slot_id, self.options.max_wait_s)


def _victim_candidates(idle: list[SlotView], upstreams: Sequence[UpstreamView]) -> list[SlotView]:
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
