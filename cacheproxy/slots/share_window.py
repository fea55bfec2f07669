"""Who is active for the slot share, and when what holds a tenant back ends (pure).

The slot share (slot_share.py) and the chunk pacing (chunked_prefill.py) judge a tenant against
the others active: those holding a leased slot, waiting, or whose last request arrived or ended
within `scheduling.share_window_s`. Two records (kept by share_pacing.py) are read here:

- the holders: each leased slot (by `id` of its state) with its tenant and the time its prompt
  is expected to be computed (estimated from the upstream's measured prompt rate, set to the
  first streamed event when one comes);
- the last activity: each tenant with the time its last request arrived or ended, and the share
  it last came with.

A tenant held back is let in again when a recently active tenant leaves the window or a prompt
being computed is expected to be done: `share_expiry` is the first of those times, the moment
to plan again. Data in, decision out; each call is one pass over the holders and the tenants
active (both as many as the slots and the tenants, a handful), asked on every dispatch while
several tenants are active.
"""

from __future__ import annotations

from collections import Counter

from cacheproxy.slots.fair_queue import Share
from cacheproxy.slots.slot_share import TenantSlots
from cacheproxy.upstreams.slot_table import UpstreamSlots

# a leased slot (by id of its state) -> its tenant, and until when its prompt is expected to
# be computed
Holders = dict[int, tuple[str, float]]
# a tenant -> when its last request arrived or ended, and the share it came with
LastActive = dict[str, tuple[float, Share]]


def active_tenants(
    holders: Holders, last_active: LastActive, waiting: set[str], now: float, window: float
) -> tuple[dict[str, TenantSlots], list[str]]:
    """The tenants holding a slot, waiting, or active within the window, with what they hold;
    and those gone quiet (out of the window, nothing held or waiting), to be forgotten."""
    holding = Counter(tenant for tenant, _ in holders.values())
    prefilling = Counter(tenant for tenant, until in holders.values() if until > now)
    active: dict[str, TenantSlots] = {}
    quiet: list[str] = []
    for tenant, (at, share) in last_active.items():
        if now - at >= window and tenant not in holding and tenant not in waiting:
            quiet.append(tenant)
            continue
        active[tenant] = TenantSlots(
            share.weight, holding[tenant], share.max_concurrent, prefilling[tenant]
        )
    return active, quiet


def share_expiry(
    holders: Holders, last_active: LastActive, waiting: set[str], now: float, window: float
) -> float | None:
    """When the first tenant active only recently (nothing held or waiting) leaves the window,
    or the first prompt being computed is expected to be done: a tenant held back for either
    may then take more."""
    busy = {tenant for tenant, _ in holders.values()} | waiting
    ends = [at + window for tenant, (at, _) in last_active.items() if tenant not in busy]
    ends += [until for _, until in holders.values() if until > now]
    return min(ends, default=None)


def prefill_until(table: UpstreamSlots, prompt_length: int, reused: int, now: float) -> float:
    """When the server is expected to have computed a prompt of which it reuses `reused`
    tokens, at the rate it computed prompts lately (beside others: so rather late than early)."""
    to_compute = max(prompt_length - reused, 0)
    return now + to_compute * table.prefill_ms_per_token.value / 1000


def others_prefill_left(tenant: str, holders: Holders, now: float) -> float:
    """Seconds until the first prompt of a tenant other than `tenant` is expected to be
    computed (0: none is being computed)."""
    ends = [until for other, until in holders.values() if other != tenant and until > now]
    return min(ends, default=now) - now
