"""Moving a conversation between upstreams that share the archive folder and a fingerprint:
when a request is placed on one while another holds its conversation in an idle slot, that slot
is saved there and the restore that follows (`tier`) brings it here, when `policy.move_pays`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from cacheproxy.disk.archive_types import Match
from cacheproxy.disk.attached import AttachedUpstream, SlotSaver
from cacheproxy.disk.blocks import MIN_ARCHIVE_TOKENS
from cacheproxy.disk.policy import MoveCosts, move_pays
from cacheproxy.disk.restores import reusable_of_prompt, reused_of_slot
from cacheproxy.upstreams.slot_table import Lease, SlotContent, SlotState, UpstreamSlots

log = logging.getLogger(__name__)

# the tenant's archive sharing the longest prefix with the tokens, under a fingerprint (the
# tier's lookup, through its off-on switch)
FindArchive = Callable[[str, str, Sequence[int]], Awaitable[Match | None]]


@dataclass(frozen=True)
class MoveSources:
    """Where a conversation may be moved from: every upstream's slots, whose text a slot
    holds, and how a slot is kept from requests while it is saved (the scheduler's)."""

    tables: Sequence[UpstreamSlots]
    owner_of: Callable[[SlotState], str | None]
    lend: Callable[[SlotState], bool]
    give_back: Callable[[SlotState], None]


def other_upstreams(
    lease: Lease,
    attached: AttachedUpstream,
    sources: MoveSources,
    upstreams: Mapping[int, AttachedUpstream],
) -> Iterator[tuple[UpstreamSlots, AttachedUpstream]]:
    """The upstreams a conversation may be moved from to the leased slot's: healthy, attached,
    of the same fingerprint. None on servers with LoRA adapters (upstreams/adapters.py): what
    a slot holds there is filed under its scales, which a move does not follow."""
    if lease.table.adapters:
        return
    for table in sources.tables:
        there = upstreams.get(table.index)
        if table is lease.table or not table.healthy or there is None or table.adapters:
            continue
        if there.fingerprint == attached.fingerprint:
            yield table, there


async def move_here(
    lease: Lease,
    attached: AttachedUpstream,
    tenant: str,
    sources: MoveSources,
    upstreams: Mapping[int, AttachedUpstream],
    find: FindArchive,
    save: SlotSaver,
) -> None:
    """Save the tenant's conversation from the idle slot of another upstream of `upstreams`
    (same fingerprint) that holds the most of this prompt, when that is more than this slot and
    every archive hold and `move_pays`; the restore that follows brings it here."""
    prompt = lease.prompt
    reusable, live = reusable_of_prompt(lease), reused_of_slot(lease)
    best: tuple[int, UpstreamSlots, SlotState, AttachedUpstream] | None = None
    for table, there in other_upstreams(lease, attached, sources, upstreams):
        for slot in table.slots:
            if slot.busy or slot.unknown_tail != 0 or sources.owner_of(slot) != tenant:
                continue
            shared = min(slot.shared_with(prompt), reusable)
            if best is None or shared > best[0]:
                best = (shared, table, slot, there)
    if best is None or best[0] - live < MIN_ARCHIVE_TOKENS:
        return
    shared, table, slot, there = best
    match = await find(tenant, attached.fingerprint, prompt)
    if match is not None and min(match.n_common, reusable) >= shared:
        return  # an archive holds as much already: restoring it needs no save
    costs = MoveCosts(
        prefill_ms_per_token=lease.table.prefill_ms_per_token.value,
        save_bytes_per_ms=there.save_bytes_per_ms.value,
        save_overhead_ms=there.save_overhead_ms.value,
        restore_bytes_per_ms=attached.restore_bytes_per_ms.value,
        restore_overhead_ms=attached.restore_overhead_ms.value,
    )
    state_bytes = len(slot.known) * there.bytes_per_token.value
    if not move_pays(shared - live, state_bytes, costs):
        return
    log.info(
        "moving up to %d tokens of tenant %s from slot %d of %s to %s",
        len(slot.known),
        tenant,
        slot.slot_id,
        table.upstream.base_url,
        lease.table.upstream.base_url,
    )
    # kept from requests while it is saved; it keeps its content (what comes here is a
    # copy). The index lookup above awaited: a request may have used the slot meanwhile,
    # so what it holds, and whose it is, is checked again once nobody else can change it
    if not sources.lend(slot):
        return
    try:
        if (
            sources.owner_of(slot) != tenant
            or slot.unknown_tail != 0
            or min(slot.shared_with(prompt), reusable) < shared
        ):
            return
        content = SlotContent(list(slot.known), 0, tenant)
        await save(table, slot.slot_id, content, there)
    finally:
        sources.give_back(slot)
