"""A grant: an idle slot leased to a waiting request on the terms its placement predicted; and the
idle slots a split request's prompt takes at once, all chosen before any is granted.

The scheduler alone calls these (it is the one writer of slot state, scheduler.py): what a grant
writes is the slot's lineage (lease_terms.py), the RAM-cache shadow's claim and the slot share's
record of the holder (share_pacing.py); the scheduler then writes the slot's record
(slot_records.py `granted`).

A prompt's tasks (`n` > 1) run side by side, as llama-server runs a prompt's completions: they
take their slots together or not at all, so a request never holds some of its slots while it
waits for the others (two such requests could each hold half of what both need). The routing
policy picks each slot in turn, as for an impatient request (it never waits for a busy slot),
the slots already picked counted busy; if it picks fewer than wanted, none is granted.
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheproxy.slots.lease_terms import lineage_after, reuse_terms
from cacheproxy.slots.routing import RouteRequest, RoutingPolicy, SlotCandidate, UseSlot
from cacheproxy.slots.share_pacing import SharePacing
from cacheproxy.slots.share_window import prefill_until
from cacheproxy.slots.slot_views import upstream_views
from cacheproxy.slots.waiter import Waiter
from cacheproxy.upstreams.ram_shadow import RamPrediction
from cacheproxy.upstreams.slot_table import Lease, ReuseBounds, SlotState, UpstreamSlots


def grant(
    waiter: Waiter,
    table: UpstreamSlots,
    slot: SlotState,
    owner: str | None,
    continues: tuple[float, float],
    bounds: ReuseBounds,
    prediction: RamPrediction | None,
    pacing: SharePacing,
    tables: Sequence[UpstreamSlots],
    now: float,
) -> Lease:
    """Lease idle `slot` (whose text is `owner`'s, whose requests continue what they reuse this
    often, and to its end: `SlotContent.continues`, `continues_exactly`) to `waiter`, the server
    expected to reuse `bounds` there (`prediction`: the RAM-cache shadow's, where it was
    asked)."""
    same_scales = table.same_scales(slot, waiter.lora)
    predicted, isolate = reuse_terms(slot, bounds, owner, waiter.tenant, waiter.opaque, same_scales)
    # the server picks the slot itself: the lease is on the one it is predicted to take
    unpinned = table.server_picks and waiter.slot_id is None
    # before this grant counts; chunks are pinned, so never for the server's pick
    chunked = not unpinned and pacing.in_chunks(waiter, now, tables)
    if waiter.cache_prompt and not waiter.opaque and not isolate:
        # before the row changes (the placement's prediction, made on the same row)
        table.shadow_claim(slot.slot_id, waiter.prompt, prediction, pinned=not unpinned)
    previous = slot.content(owner, *continues)
    slot.turns, slot.branch = lineage_after(slot, previous, predicted.low, isolate)
    pacing.leased(slot, waiter.tenant, prefill_until(table, len(waiter.prompt), predicted.low, now))
    return Lease(
        table,
        slot,
        waiter.prompt,
        predicted,
        now - waiter.arrived,
        isolate,
        previous,
        waiter.opaque,
        chunked,
        unpinned,
        table.scales_of(waiter.lora),
        waiter.lora is not None,
    )


def group_picks(
    policy: RoutingPolicy,
    tables: Sequence[UpstreamSlots],
    waiter: Waiter,
    views: list[SlotCandidate],
) -> list[UseSlot] | None:
    """The idle slots the policy picks for each of the waiter's `count` tasks in turn (each
    one picked counted busy for the next); None when it picks fewer: then none is granted.
    `views` are the placement's, changed here (a policy's views are thrown away after)."""
    request = RouteRequest(len(waiter.prompt), waiter.session, may_wait=False)
    upstreams = upstream_views(tables)
    by_slot = {(view.upstream, view.slot_id): view for view in views}
    picks: list[UseSlot] = []
    for _ in range(waiter.slots_wanted):
        plan = policy.plan(request, views, upstreams)
        if not isinstance(plan, UseSlot):
            return None
        view = by_slot.get((plan.upstream, plan.slot_id))
        if view is None or view.busy or tables[plan.upstream].slots[plan.slot_id].busy:
            return None  # a policy that names a busy slot is ignored, never obeyed
        view.busy = True
        upstreams[plan.upstream].in_flight += 1
        picks.append(plan)
    return picks
