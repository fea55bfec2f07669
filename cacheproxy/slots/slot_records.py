"""What each event of a lease does to a slot's record: whose text it then holds, which tokens,
whether it is busy.

The scheduler decides who gets a slot and when (scheduler.py), and is the one writer of slot
state: it alone calls these, each event's writes in one place. The rule they keep: a slot whose
content cannot be told (a request failed half-way, a probe stopped, the server's report does not
say) is nobody's, its content unknown, so that no tenant's next request reuses another's text.
"""

from __future__ import annotations

from cacheproxy.tenancy.registry import DEFAULT_TENANT
from cacheproxy.upstreams.adapters import Scales
from cacheproxy.upstreams.slot_table import UNKNOWN, Lease, SlotState, TaskOutcome


def granted(
    slot: SlotState,
    tenant: str,
    session: str | None,
    prompt: list[int],
    now: float,
    adapters: Scales | None = (),
) -> None:
    """A request of `tenant` is leased the slot to compute `prompt` under the LoRA scales
    `adapters`."""
    taken(slot, now)
    slot.tenant = tenant
    slot.session = session
    # from now on the slot is being filled with this prompt: whoever considers waiting
    # for it must compare against that, not against what it held before
    slot.hold(list(prompt), UNKNOWN)
    slot.adapters = adapters


def taken(slot: SlotState, now: float) -> None:
    """The slot is leased from `now` (alone, or with its whole upstream)."""
    slot.busy = True
    slot.version += 1
    slot.lease_started = now


def released(lease: Lease, outcome: TaskOutcome, now: float) -> None:
    """The leased request ended with `outcome`: what the slot now holds, free from `now`.
    A request the server placed itself may have run on another slot than predicted: the
    records follow the server's ids first (`UpstreamSlots.relabel`)."""
    slot = lease.slot
    if lease.unpinned and outcome.slot_id is not None:
        lease.table.relabel(slot, outcome.slot_id)
    if lease.opaque:
        slot.forget(outcome.tokens_cached if outcome.ok else None)
    else:
        slot.record(lease.prompt, outcome)
    # what it left was computed under the request's LoRA scales: computed afresh (isolated), or
    # going on from text computed under them; a request that failed may have left what the
    # slot held, under them too unless it was isolated. Where the server picked the slot, only
    # once its answer said which.
    if (not lease.unpinned or outcome.slot_id is not None) and (outcome.ok or not lease.isolate):
        slot.adapters = lease.adapters
    lease.table.shadow_unclaim(slot.slot_id)  # sent and replayed, or never sent
    if not outcome.ok:
        # refused before it ran, cut half-way, or failed inside: whether the slot still holds
        # its previous owner's text or some of this request's cannot be told, so it is
        # nobody's (labelled the requester's, its next request would reuse the other's)
        slot.tenant = slot.session = None
    slot.busy = False
    slot.last_used = now


def ran_last(slot: SlotState, known: list[int], unknown_tail: int | None) -> None:
    """Of a request lined up on the slot and the one it followed, the server ran them in an
    order that leaves the slot holding `known` and `unknown_tail` more (slots/line_up.py),
    both under the same LoRA scales."""
    adapters = slot.adapters
    slot.hold(known, unknown_tail)
    slot.adapters = adapters


def handed_over(slot: SlotState, tenant: str, adapters: Scales | None) -> None:
    """The slot, just given back, goes to a request of `tenant` lined up behind the one that
    held it (slots/line_up.py): whatever that one did, the slot holds only `tenant`'s text, so
    it is `tenant`'s even where what it holds is not known (a request failed half-way), computed
    under the LoRA scales both run under (`adapters`)."""
    slot.tenant = tenant
    slot.adapters = adapters


def released_whole(
    slot: SlotState, tenant: str, written: int | bool | None, erased: bool, now: float
) -> None:
    """A request of `tenant` that held the slot's upstream whole ended. `written`: what the
    server's report says it left there (False: it ran nothing there; None: cannot be told;
    else the tokens it now holds); `erased`: the slot was emptied before the request ran."""
    slot.busy = False
    if erased:
        slot.hold([])
        slot.tenant = slot.session = None
    if written is False:
        return  # the server ran nothing there: what it held, and whose, is unchanged
    slot.last_used = now
    slot.session = None
    if written is None:
        slot.tenant = None
        slot.forget()
    else:
        slot.tenant = tenant
        slot.forget(written)


def named(slot: SlotState, prompt: list[int], count: int) -> None:
    """A prompt of the slot's tenant starts with `count` of the tokens its hint describes
    (slots/slot_learning.py): the slot holds those ids, then as many unnamed as it held. The
    hint stays while it describes more than that (another conversation of the tenant may share
    only its first blocks, such as a system prompt: the slot's own may still come)."""
    hint = slot.hint
    held = slot.n_tokens or count
    count = min(count, held)
    slot.hold(prompt[:count], held - count)
    slot.hinted = True  # unproven until a request runs here (slot_views.reuse_on)
    if hint is not None and count < hint.n_tokens:
        slot.hint = hint


def abandoned(lease: Lease) -> None:
    """A lease whose request never went out: the slot was relabelled and filled in the table,
    so what it holds is unknown here; and it is still its previous owner's text, so nobody's
    unless that was the requester (a slot about to be isolated, or shared up to a public
    prefix, must not pass as the requester's)."""
    slot = lease.slot
    slot.busy = False
    slot.forget()
    if lease.previous.owner != slot.tenant:
        slot.tenant = slot.session = None
    lease.table.shadow_unclaim(slot.slot_id)


def probed(slot: SlotState, erased: set[int] | None) -> None:
    """The monitor's probe gave the slot back, nobody's: empty again if its id is in `erased`,
    else holding what the probe left (`erased` None: the probe stopped half-way, nothing is
    known)."""
    slot.busy = False
    slot.tenant = slot.session = None
    if erased is None:
        slot.forget()
    elif slot.slot_id in erased:
        slot.hold([])


def owner_with_tenants(slot: SlotState) -> str | None:
    """Whose text a slot holds, once tenants exist: one of unknown origin is nobody's."""
    return slot.tenant


def owner_single_user(slot: SlotState) -> str | None:
    """Whose text a slot holds while no tenants exist: one of unknown origin is the user's."""
    return DEFAULT_TENANT.id if slot.tenant is None else slot.tenant
