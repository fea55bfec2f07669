"""Whether a tenant may take one more idle slot while other tenants are about (pure).

The fair queue decides whose waiting request goes next; this decides whether that request may
take an idle slot at all. A tenant with no other tenant active (no request in the proxy, none
arrived or ended within `scheduling.share_window_s`) may take every slot: nothing is kept idle
for nobody. While others are active, each active tenant has a weighted max-min share of the
slots (the slots split by weight, none given more than its `max_concurrent`, what a capped one
cannot use going to the rest). Below its share a tenant may always take an idle slot. At or
above it, it may take one only if the idle slots left after it still hold one for each other
active tenant below its share: the reserve.

So a flooding tenant uses whatever the others leave, but never the last slot another active
tenant's next request would need: that request starts at once rather than after one of the
flood's ends.

A slot is not all a request costs the others: the server computes every running prompt in the
same batches, so a light request's first token also waits for the prompts of the flood computed
beside it. So a tenant at or above its share (while others are active) has at most one request
in its prefill, and starts none while a tenant within its share has one in its prefill: the light
request's prompt is computed beside at most the one flood prompt already under way.
A tenant that was active within the window but holds nothing now still counts: its next
request is the one the reserve is for. The cost is at most one idle slot per such tenant, for
at most the window, and only while a tenant above its share waits.

A split request's tasks of one prompt (`n` > 1), which must run side by side, take their slots
at once, each by these rules: one larger than its tenant's share waits, while others are
active, in its tenant's queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantSlots:
    """One active tenant as the share sees it."""

    weight: float = 1.0
    holding: int = 0  # slots it holds now
    max_concurrent: int | None = None  # it never holds more (None: no cap)
    prefilling: int = 0  # of the slots it holds, those whose prompt is still being computed


def fair_shares(tenants: Mapping[str, TenantSlots], total: int) -> dict[str, float]:
    """Each tenant's weighted max-min share of `total` slots (water-filling): slots in
    proportion to weight, a tenant capped below that gets its cap and the rest is split again."""
    shares: dict[str, float] = {}
    open_tenants = dict(tenants)
    left = float(total)
    while open_tenants:
        weight = sum(tenant.weight for tenant in open_tenants.values())
        capped = {
            name: tenant.max_concurrent
            for name, tenant in open_tenants.items()
            if tenant.max_concurrent is not None
            and tenant.max_concurrent < left * tenant.weight / weight
        }
        if not capped:
            shares.update(
                (name, left * tenant.weight / weight) for name, tenant in open_tenants.items()
            )
            break
        for name, cap in capped.items():
            shares[name] = float(cap)
            left -= cap
            del open_tenants[name]
    return shares


def may_take(
    tenant: str, active: Mapping[str, TenantSlots], idle: int, total: int, count: int = 1
) -> bool:
    """Whether `tenant` (one of `active`, the tenants active within the window) may take
    `count` of the `idle` slots out of `total` at once (a split request's tasks, which run side
    by side): as if it took them one after another, each by the rules for one."""
    if idle < count or count <= 0:
        return False
    if len(active) <= 1:
        return True  # alone: every slot is its to use
    shares = fair_shares(active, total)
    asking = active[tenant]
    for taken in range(count):
        # each slot taken is one more held, and one more prompt being computed
        holding, prefilling = asking.holding + taken, asking.prefilling + taken
        if not _may_take_one(tenant, holding, prefilling, active, shares, idle - taken):
            return False
    return True


def _may_take_one(
    tenant: str,
    holding: int,
    prefilling: int,
    active: Mapping[str, TenantSlots],
    shares: Mapping[str, float],
    idle: int,
) -> bool:
    if holding < shares[tenant]:
        return True
    if prefilling or any(
        other.prefilling and other.holding <= shares[name]
        for name, other in active.items()
        if name != tenant
    ):
        return False  # its prompt would be computed beside another, delaying it
    reserve = sum(
        1 for name, other in active.items() if name != tenant and other.holding < shares[name]
    )
    return idle - 1 >= reserve
