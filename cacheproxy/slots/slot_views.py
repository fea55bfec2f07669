"""What the routing policy sees of every slot for one waiting request (pure).

For each slot of each upstream: how many of the prompt's tokens the server will skip there
(`reuse`, with the bounds the grant keeps), how many it would overwrite (`lost`), whether it is
busy, and, for a busy slot holding the requester's own text, how long its request is expected to
hold it. The rules:

- A slot's text is its writer's; one whose writer is unknown (it held something before the proxy
  started) is nobody's, except in single-user mode, where everything is the open tenant's.
- Another tenant's text is reused only within an admin's public prefix, and only when the
  server's reuse is known to stop inside it (never on a slot whose ids only a hint named: its
  text may have changed after the hint was written); else the request must reuse nothing there.
- On a server with LoRA adapters, a slot is reused only under the scales its text was computed
  under (upstreams/adapters.py): any other request reuses nothing there.
- The server's RAM cache serves the tenant's own slots (the table's shadow predicts it).
- Text the disk tier archives as a request overwrites it (`archived_when_lost`) is shown as
  such (`archived`): it is moved to disk rather than lost, and a restore brings it back.
- Where the server empties its idle slots at every task launch (`UpstreamSlots.clears_idle`),
  it picks the slot itself: of that upstream's idle slots only the one it will take is shown.
  Its busy slots are worth a wait only for more than that pick reuses (a group's prefix that
  every cached copy of is in use): text goes from one request to the next through its RAM
  cache there, not through a slot, and a request held back for the slot a prefix-sharer is
  finishing on would only have the server copy that text to the RAM cache and load it into
  the slot again, overwriting it (a conversation lost to a request that merely shares its
  prefix), where running at once it finds the prefix in the RAM cache all the same.
- A wait for another tenant's busy slot never depends on what that tenant sent: its expected
  end is shown only for the requester's own slots.

Data in (the tables, the waiting request, the leased slots' holders, now), views out. Cost: one
pass over every slot of every upstream with a common-prefix scan of the prompt against each
slot's known tokens (and the RAM-cache shadow's prediction where it is asked), made afresh at
every placement: hence the plain loops and the values worked out once a slot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from cacheproxy.disk.policy import Evicted, worth_saving
from cacheproxy.slots.routing import QueueUntilFree, SlotCandidate, UpstreamView, UseSlot
from cacheproxy.slots.share_window import Holders
from cacheproxy.tenancy.registry import DEFAULT_TENANT
from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.adapters import Requested
from cacheproxy.upstreams.ram_shadow import RamPrediction
from cacheproxy.upstreams.slot_table import NO_REUSE, ReuseBounds, SlotState, UpstreamSlots

# where the views of one placement are kept: (upstream index, slot id) -> ...
SlotKey = tuple[int, int]
# upstream index -> the fewest tokens a slot there must hold for the disk tier to archive it when
# it is evicted (its `min_tokens`); None: the tier archives nothing on that upstream
ArchivesFrom = Callable[[int], int | None]


def nothing_archived(index: int) -> int | None:
    """No disk tier: it archives nothing anywhere."""
    return None


class Asking(Protocol):
    """What the views read of a request waiting for a slot (the scheduler's waiter)."""

    prompt: list[int]
    tenant: str
    session: str | None
    cache_prompt: bool
    opaque: bool  # its prompt's ids are not known (`prompt` is empty)
    lora: Requested  # the LoRA scales its body names (upstreams/adapters.py)
    public_prefix_length: int  # the prompt starts with an admin's public prefix this long
    slot_id: int | None  # the slot the client named (None: the proxy, or the server, picks)


def owner_of(slot: SlotState, tenant: str, open_tenant: str) -> str | None:
    """Whose text the slot holds, as far as a request of `tenant` may know: its writer, or in
    single-user mode (`tenant` is the open tenant) the open tenant."""
    if slot.tenant is None and tenant == open_tenant:
        return open_tenant
    return slot.tenant


def reuse_on(
    slot: SlotState, asking: Asking, shared: int, own: bool, same_scales: bool = True
) -> ReuseBounds:
    """What the server will reuse of the request's prompt on `slot`, which shares `shared`
    tokens with it (`own`: the slot holds the requester's tenant's text; `same_scales`: it was
    computed under the LoRA scales the request runs under, else it is reused by nobody)."""
    if not asking.cache_prompt or not same_scales:
        return NO_REUSE
    bounds = slot.reuse_bounds(asking.prompt, shared)
    if own:
        return bounds
    # Another tenant's slot: only tokens of a public prefix may be shared, and only when
    # the server's reuse is known to stop inside it (else it must reuse nothing at all).
    if slot.hinted:
        return NO_REUSE  # its ids are a guess (named by a hint): where reuse stops is not known
    if bounds.low == bounds.high and 0 < bounds.high <= asking.public_prefix_length:
        return bounds
    return NO_REUSE


def slot_candidates(
    tables: Sequence[UpstreamSlots],
    asking: Asking,
    holders: Holders,
    open_tenant: str,
    now: float,
    queued_ahead_s: Mapping[SlotKey, float] | None = None,
    archives_from: ArchivesFrom = nothing_archived,
) -> tuple[list[SlotCandidate], dict[SlotKey, ReuseBounds], dict[SlotKey, RamPrediction]]:
    """Each slot as the policy sees it, the reuse predicted there, and what the RAM-cache
    shadow predicted where it was asked (`queued_ahead_s`: how long the requests queued ahead
    of this one that wait for a busy slot will hold it; `archives_from`: where the disk tier
    archives a slot's text as it is overwritten)."""
    queued_ahead_s = queued_ahead_s or {}
    views, bounds, predictions = [], {}, {}
    prompt = asking.prompt
    tenant = asking.tenant
    for table in tables:
        ram = table.ram_shadow is not None and asking.cache_prompt and not asking.opaque
        server_picks = table.server_picks and asking.slot_id is None
        picked = table.server_pick(prompt) if server_picks else None
        # a busy slot there is worth a wait only for more than the pick reuses (see above)
        worth_waiting = picked[1].cache_n if picked is not None and picked[1].proven else 0
        floor = archives_from(table.index)
        for slot in table.slots:
            found = None
            if picked is not None and not slot.busy:
                if slot.slot_id != picked[0]:
                    continue  # the server will not take it
                found = picked[1]
            own = owner_of(slot, tenant, open_tenant) == tenant  # worked out once a slot
            shared = common_prefix_length(slot.known, prompt)
            same = not table.adapters or table.same_scales(slot, asking.lora)
            reuse = reuse_on(slot, asking, shared, own, same)
            # the server's RAM cache serves the tenant's own slots
            reuse, lost, found = table.placement(
                slot, prompt, shared, reuse, ram and own and same, found
            )
            archived = (
                lost > 0
                and found is None
                and floor is not None
                and archived_when_lost(slot, shared, floor)
            )
            bounds[(table.index, slot.slot_id)] = reuse
            if found is not None:
                predictions[(table.index, slot.slot_id)] = found
            busy = slot.busy and not slot.saving  # being saved: free in a moment, all kept
            expected = reuse.low
            if busy and server_picks and expected <= worth_waiting:
                expected = 0  # the server's pick reuses as much: not waited for (see above)
            remaining_s, prefill_left_s = None, 0.0
            if busy and own:
                remaining_s, prefill_left_s = _time_left(table, slot, tenant, holders, now)
            if asking.opaque and _same_opaque_prompt(asking, slot, own):
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
                    archived=archived,
                    last_used=slot.last_used,
                    busy_for_s=now - slot.lease_started if busy else 0.0,
                    session=slot.session,
                    remaining_s=remaining_s,
                    prefill_left_s=prefill_left_s,
                    queued_ahead_s=queued_ahead_s.get((table.index, slot.slot_id), 0.0)
                    if busy
                    else 0.0,
                )
            )
    return views, bounds, predictions


def archived_when_lost(slot: SlotState, kept: int, min_tokens: int) -> bool:
    """Whether the disk tier archives what `slot` holds when a request keeping `kept` tokens of
    it is placed there (the rule a save at eviction starts with, `disk.policy.worth_saving`):
    its text is then not lost, only moved to disk, and comes back by a restore."""
    return worth_saving(Evicted(slot.n_tokens_at_least, kept, slot.tenant), min_tokens)


def _time_left(
    table: UpstreamSlots, slot: SlotState, tenant: str, holders: Holders, now: float
) -> tuple[float | None, float]:
    """How long the request running on a busy slot holding `tenant`'s own text is expected
    to hold it, and to compute its prompt: its prompt's end (its first streamed event, or the
    estimate from the measured rate), then the upstream's measured time after a prompt. None
    and 0 when another tenant's request runs there: a wait for another tenant's slot must not
    depend on what that tenant sent."""
    held = holders.get(id(slot))
    if held is None or held[0] != tenant:
        return None, 0.0
    prefill_end = held[1]
    return prefill_end + table.after_prefill_s.value - now, max(prefill_end - now, 0.0)


def _same_opaque_prompt(asking: Asking, slot: SlotState, own: bool) -> bool:
    """An opaque prompt whose affinity key (its start, see `SlotScheduler.acquire_opaque`) is
    the one the slot last served, for the same tenant (`own`: the slot holds its text)."""
    return (
        asking.opaque
        and asking.cache_prompt
        and asking.session is not None
        and slot.session == asking.session
        and own
    )


def upstream_views(tables: Sequence[UpstreamSlots]) -> list[UpstreamView]:
    return [
        UpstreamView(
            index=table.index,
            in_flight=in_flight(table),
            prefill_ms_per_token=table.server_ms_per_token(),
            expected_request_s=table.request_s.value,
            ram_cache=table.ram_cache,
            healthy=table.healthy,
        )
        for table in tables
    ]


def tables_of(
    tables: Sequence[UpstreamSlots], indices: frozenset[int] | None
) -> Sequence[UpstreamSlots] | None:
    """The tables of `indices` (None: all of them), those a request may be placed on; None
    when none of them is in service (a model instance unloaded, a server gone)."""
    if indices is None:
        return tables
    chosen = [table for table in tables if table.index in indices]
    return chosen if any_healthy(chosen) else None


def any_healthy(tables: Sequence[UpstreamSlots]) -> bool:
    for table in tables:  # a plain loop: asked at every dispatch
        if table.healthy:
            return True
    return False


def any_idle_slot(tables: Sequence[UpstreamSlots]) -> bool:
    """Whether a healthy upstream has an idle slot."""
    # plain loops: asked several times a dispatch, twice a request (a generator costs more)
    for table in tables:
        if table.healthy:
            for slot in table.slots:
                if not slot.busy:
                    return True
    return False


def in_flight(table: UpstreamSlots) -> int:
    """Requests running on the upstream (a slot being saved in the background is not one)."""
    running = 0
    for slot in table.slots:  # a plain loop: asked for every upstream at every placement
        if slot.busy and not slot.saving:
            running += 1
    return running


def named_slot_plan(
    tables: Sequence[UpstreamSlots], slot_id: int | None
) -> UseSlot | QueueUntilFree | None:
    """The slot a client named, on the first healthy upstream that has it, once it is idle
    (llama-server too defers a task pinned to a busy slot); None: none was named."""
    if slot_id is None:
        return None
    for table in tables:
        if table.healthy and any(slot.slot_id == slot_id for slot in table.slots):
            busy = table.slots[slot_id].busy
            return QueueUntilFree() if busy else UseSlot(table.index, slot_id)
    return QueueUntilFree()


def foreign_slots(
    table: UpstreamSlots, tenant: str, open_tenant: str, lora: Requested = None
) -> list[SlotState]:
    """The slots of `table` that hold text `tenant` may not reuse: another's, or computed
    under other LoRA scales than its body's `lora` names."""
    return [
        slot
        for slot in table.slots
        if not slot.empty
        and (owner_of(slot, tenant, open_tenant) != tenant or not table.same_scales(slot, lora))
    ]


def cleanest_idle_upstream(
    tables: Sequence[UpstreamSlots], tenant: str, open_tenant: str, lora: Requested = None
) -> UpstreamSlots | None:
    """A whole idle upstream for a request of `tenant`: the one with the fewest slots holding
    others' text (none: the server may reuse whatever slot it picks); None: no upstream is idle."""
    idle = [
        table for table in tables if table.healthy and not any(slot.busy for slot in table.slots)
    ]
    if not idle:
        return None
    return min(idle, key=lambda table: len(foreign_slots(table, tenant, open_tenant, lora)))


def owner_with_tenants(slot: SlotState) -> str | None:
    """Whose text a slot holds, once tenants exist: one of unknown origin is nobody's."""
    return slot.tenant


def owner_single_user(slot: SlotState) -> str | None:
    """Whose text a slot holds while no tenants exist: one of unknown origin is the user's."""
    return DEFAULT_TENANT.id if slot.tenant is None else slot.tenant
