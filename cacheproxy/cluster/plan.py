"""What a proxy does with the leases in one round (pure: no I/O, no clock).

Each upstream is held by one proxy at a time. The live proxies share the upstreams: a proxy
claims free ones (never held, or whose holder stopped renewing) up to its share, ceil(upstreams /
live proxies), so it does not take more while others are live; one holding more than its share
while another holds less gives one up (after the requests on it finish), which is how a
restarted proxy gets upstreams back. Ties are broken by rendezvous hashing of (proxy, upstream),
so two proxies that start together prefer different upstreams.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from cacheproxy.cluster.leases import LeaseRow


def rendezvous_score(member: str, key: str) -> int:
    """The weight of `member` for `key`: the highest-scoring member owns the key, and the
    owners of other keys do not move when a member joins or leaves."""
    digest = hashlib.sha256(f"{member}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def weighted_score(member: str, key: str, weight: int) -> float:
    """Rendezvous hashing weighted by what a member serves: a member of weight 2 owns twice
    the keys of one of weight 1 (the logarithmic method: -weight / ln(u), u uniform in (0, 1))."""
    unit = (rendezvous_score(member, key) + 0.5) / 2.0**64
    return -weight / math.log(unit)


@dataclass
class RoundPlan:
    renew: list[str] = field(default_factory=list)  # leases this proxy holds and keeps
    claim: list[str] = field(default_factory=list)  # free leases to try, best first
    release: list[str] = field(default_factory=list)  # leases given up now (idle, releasing)
    start_releasing: str | None = None  # stop placing requests here; give it up once idle


def share_of(upstreams: int, live_members: int) -> int:
    return math.ceil(upstreams / max(live_members, 1))


def plan_round(
    me: str,
    now: float,
    upstreams: list[str],
    live_members: set[str],
    leases: list[LeaseRow],
    releasing: set[str],
    idle: set[str],
) -> RoundPlan:
    """The round of proxy `me`: `leases` as read in the round's transaction, `live_members`
    those whose heartbeat holds (`me` among them), `releasing` the upstreams it is giving up,
    `idle` those with no request or slot operation of its own under way."""
    by_upstream = {lease.upstream: lease for lease in leases if lease.upstream in upstreams}
    held_by: dict[str, int] = dict.fromkeys(live_members | {me}, 0)
    for lease in by_upstream.values():
        if lease.live(now) and lease.holder in held_by:
            held_by[lease.holder] += 1
    share = share_of(len(upstreams), len(held_by))
    plan = RoundPlan()
    mine = [u for u in upstreams if (lease := by_upstream.get(u)) and lease.holder == me]
    for upstream in mine:
        if upstream in releasing and upstream in idle:
            plan.release.append(upstream)
        else:
            plan.renew.append(upstream)
    keeping = len(plan.renew) - len(releasing & set(plan.renew))
    starved = any(count < share for member, count in held_by.items() if member != me)
    if keeping > share and starved:
        candidates = [u for u in plan.renew if u not in releasing]
        plan.start_releasing = min(candidates, key=lambda u: rendezvous_score(me, u))
        keeping -= 1
    free = [
        u
        for u in upstreams
        if (lease := by_upstream.get(u)) is None or (lease.holder != me and not lease.live(now))
    ]
    free.sort(key=lambda u: rendezvous_score(me, u), reverse=True)
    plan.claim = free[: max(share - keeping, 0)]
    return plan
