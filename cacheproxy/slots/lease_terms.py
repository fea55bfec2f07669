"""The terms a slot is leased on (pure): what the request will reuse there, whether it must
reuse nothing, and whether it continues the slot's text or branches off it.

- Isolation: a slot holding another tenant's text, of which the request may reuse nothing,
  must reuse none of it (the executor erases it, or sends `cache_prompt: false`); of which it
  may reuse a public prefix, nothing past it (it goes with `n_cache_reuse: 0`). An opaque
  prompt (its ids unknown) on its own tenant's text, or on nothing, may reuse any of it.
- Lineage: a request that reuses part of what the slot holds is its conversation's next turn;
  one that reuses a prefix and drops the rest branches off it (another question on the same
  document), and the slot's lineage stays a branching one while its requests branch where it did.
- A lease is never changed: new terms (the disk tier restored an archive, chunks computed the
  prompt) make a new lease.

Data in (the slot, the prediction, who is asking), terms out; a few comparisons a grant.
"""

from __future__ import annotations

from cacheproxy.slots.slot_views import foreign_slots, owner_of
from cacheproxy.upstreams.adapters import Requested
from cacheproxy.upstreams.slot_table import (
    Lease,
    ReuseBounds,
    SlotContent,
    SlotState,
    UpstreamSlots,
    branch_point,
)


def reuse_terms(
    slot: SlotState,
    predicted: ReuseBounds,
    owner: str | None,
    tenant: str,
    opaque: bool,
    same_scales: bool = True,
) -> tuple[ReuseBounds, bool]:
    """What a request of `tenant` will reuse on `slot` (whose text is `owner`'s, computed under
    the LoRA scales the request runs under if `same_scales`), and whether it must reuse nothing
    there."""
    isolate = not slot.empty and predicted.high == 0 and (owner != tenant or not same_scales)
    if opaque and not isolate:
        # its own text (or nothing): the server may reuse any of it, none of it known
        predicted = ReuseBounds(0, slot.n_ctx)
    return predicted, isolate


def holds_foreign_text(lease: Lease, tenant: str) -> bool:
    """Whether the leased slot held text that is not `tenant`'s when the request was placed
    there (another tenant's, or nobody's known): the server may reuse at most a public prefix
    of it, so never chunks past that prefix by shifting their KV (`n_cache_reuse`)."""
    return lease.previous.owner != tenant


def lineage_after(
    slot: SlotState, previous: SlotContent, reused: int, isolate: bool
) -> tuple[int, int | None]:
    """The slot's turns and branch (`SlotState.turns`, `.branch`) once a request that reuses
    `reused` tokens of what it held (`previous`) is granted it."""
    # a request that continues what the slot holds is the conversation's next turn
    continues = reused > 0 and not isolate
    turns = slot.turns + 1 if continues else 1
    # the lineage stays a branching one while its requests branch where it did
    branched = branch_point(previous.n_tokens_at_least, reused) if continues else None
    return turns, slot.branch if branched is not None and branched == slot.branch else None


def relet(lease: Lease, predicted: ReuseBounds, isolate: bool) -> Lease:
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
        lease.unpinned,
        lease.adapters,
        lease.names_scales,
    )


def foreign_leases(
    table: UpstreamSlots, tenant: str, open_tenant: str, queued_s: float, lora: Requested = None
) -> tuple[Lease, ...]:
    """For a request of `tenant` (its body naming the LoRA scales `lora`) holding `table`
    whole: the slots holding text it may not reuse, each as an isolated lease with what it
    holds (the disk tier may archive it)."""
    return tuple(
        Lease(
            table,
            slot,
            [],
            ReuseBounds(0, 0),
            queued_s,
            isolate=True,
            previous=SlotContent(
                slot.known,
                slot.unknown_tail,
                owner_of(slot, tenant, open_tenant),
                adapters=slot.adapters,
            ),
        )
        for slot in foreign_slots(table, tenant, open_tenant, lora)
    )
