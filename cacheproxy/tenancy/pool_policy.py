"""A tenant's limits shared by several proxies, as pure decisions: the pool every proxy of a
cluster draws a limit from, and what one exchange with it settles and grants. No I/O and no
clock of its own (times are given); the SQL is in pool_store.py, the proxy's side in
shared_limits.py (which says why the limits are leased this way).

A pool per tenant and limit lives in the shared database; a proxy holds an allowance of it
(`held`), spends that without asking anyone, and exchanges with the pool now and then: it
*settles* (gives back what it holds beyond what it keeps, or what it spent beyond what it held)
and is *granted* more. A token is in one place at a time (the pool, one proxy's allowance, or on
its way between them), so the tenant never gets more than the limit through any number of
proxies.

- Rates (requests, prompt and generated tokens per minute): the pool is the token bucket a
  single proxy keeps (limits.py) less what the proxies hold: `level` is what no proxy holds, and
  it refills at limit/60 a second only up to the limit less what the live proxies hold, so the
  bucket they share together never holds more than a minute's worth.
- Budgets (prompt + generated tokens per UTC day and month): the budget of the period that
  `stamp` names, less what was used or is held. A new period starts at the budget less what the
  ledger already counted in it (`seed`: a budget set or a pool made in the middle of a day).
- A proxy that dies never settles: what it held counts as spent (its ledger rows say what it
  really used). What it held is at most what it spent in a renewal period (`grant`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cacheproxy.tenancy.limits import BUDGET_NAMES, day_start, month_start

# the allowance a proxy asks for beyond its need is at most this share of what the pool has
# left: near the end of a limit, little is held where the tenant may not come
PREFETCH_SHARE = 0.25
MINUTE_S = 60.0


@dataclass(frozen=True)
class Pool:
    """A tenant's pool of one limit, as stored."""

    capacity: float  # the limit it was last kept under
    level: float  # what no proxy holds (rates: refilled up to `stamp`)
    stamp: float  # rates: wall-clock seconds of `level`; budgets: the period's start


@dataclass(frozen=True)
class PoolExchange:
    """One proxy's exchange with the pool of one tenant's limit."""

    tenant: str
    name: str  # a name of limits.LIMIT_NAMES
    limit: int | None  # None: the tenant has no such limit now (the pool is deleted)
    period: float  # budgets: the start of the UTC day or month the proxy counts; rates: 0
    seed: float  # budgets: what the ledger counted in the period (a new pool starts below)
    settle: float  # given back (negative: what it spent beyond what it held)
    keep: float  # what it still holds once settled (recorded; a rate refills around it)
    need: float  # what the pool must grant, or nothing (0: only `extra` is asked for)
    partial: bool  # any part of `need` will do (a level above zero admits a request)
    extra: float  # asked for beyond the need: what it expects to spend before its next round


@dataclass(frozen=True)
class Exchanged:
    """What an exchange granted, and the pool as it left it."""

    granted: float
    level: float
    stamp: float
    capacity: float
    others: float  # what the other live proxies hold of this limit


def is_budget(name: str) -> bool:
    return name in BUDGET_NAMES


def period_of(name: str, now: float) -> float:
    """The period a budget counts at `now` (the UTC day's or month's start); rates: 0."""
    if name == "tokens_per_day":
        return day_start(now)
    if name == "tokens_per_month":
        return month_start(now)
    return 0.0


def exchange(
    pool: Pool | None, item: PoolExchange, now: float, others: float
) -> tuple[Pool | None, float]:
    """The pool after `item` settled and was granted (None: delete it), and what was granted.
    `others`: what the other live proxies hold of it."""
    if item.limit is None:
        return None, 0.0
    limit = float(item.limit)
    if is_budget(item.name):
        started = pool is None or pool.stamp < item.period
        pool = _budget_at(pool, limit, item.period, item.seed)
        if pool.stamp != item.period:
            # the proxy's clock is behind the pool's period: what it holds is of a period
            # that is over; it is granted nothing until its clock has passed too
            return pool, 0.0
        # a pool started now counts what this proxy spent in the period in its seed (its
        # ledger figures): not twice
        level = pool.level + (0.0 if started else item.settle)
    else:
        room = limit - others - item.keep  # the bucket, less what the proxies hold
        pool = _rate_at(pool, limit, now, room)
        level = min(room, pool.level + item.settle) if item.settle > 0 else pool.level + item.settle
    granted = grant(level, item.need, item.partial, item.extra)
    return replace(pool, level=level - granted), granted


def _budget_at(pool: Pool | None, limit: float, period: float, seed: float) -> Pool:
    if pool is None or pool.stamp < period:  # a new pool, or a new day or month
        return Pool(limit, limit - seed, period)
    # a changed budget: what was used stays used
    return Pool(limit, pool.level + limit - pool.capacity, pool.stamp)


def _rate_at(pool: Pool | None, limit: float, now: float, room: float) -> Pool:
    if pool is None:  # a new bucket starts full, as a single proxy's does
        return Pool(limit, max(room, 0.0), now)
    refilled = pool.level + max(now - pool.stamp, 0.0) * (limit / MINUTE_S)
    # a lowered limit caps the level (limits.TokenBucket.resize); never above the room
    return Pool(limit, min(refilled, room), max(now, pool.stamp))


def grant(level: float, need: float, partial: bool, extra: float) -> float:
    """What the pool grants from `level`: all of `need`, or (`partial`) as many whole tokens of
    it as there are, or nothing; and of `extra` at most `PREFETCH_SHARE` of what is left, in
    whole tokens (every limit counts whole requests or tokens)."""
    base = 0.0
    if need > 0:
        base = min(need, math.floor(max(level, 0.0))) if partial else need
        if base <= 0 or base > level:
            return 0.0
    spare = math.floor((level - base) * PREFETCH_SHARE)
    return base + max(0.0, min(extra, spare))


def projected_level(
    name: str, level: float, stamp: float, capacity: float, room: float, now: float
) -> float:
    """A pool's level at `now` as last seen (`level` at `stamp`): a rate refills at its
    capacity a minute up to `room`; a budget changes only by other proxies' exchanges."""
    if is_budget(name):
        return level
    return min(room, level + max(now - stamp, 0.0) * (capacity / MINUTE_S))
