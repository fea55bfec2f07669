"""One meter per tenant, wherever it is served: this proxy's allowances of the tenants' rates
and budgets, drawn from pools every proxy of a cluster shares (pool_policy.py, pool_store.py).

Design. Each limit of a tenant is one pool in the shared database; a proxy holds an allowance
of it and spends that without asking anyone, so a request costs no database round trip while
its allowance lasts:

- a request that needs more than this proxy holds (its first, or one past what the proxy
  expected) tops the allowance up: one transaction for every limit it lacks, shared by the
  tenant's requests arriving meanwhile; a pool this proxy last saw empty (a rate not refilled
  since, a budget spent) refuses at once, from memory;
- every renewal period (`cluster.renew_interval_s`) a named background round gives back, in one
  transaction for every tenant, what each allowance holds beyond what it spent in the period
  just ended, settles what it spent beyond what it held (generated tokens, charged when an
  answer ends), takes up to that much again (at most a quarter of what the pool has left, so
  near the end of a limit little sits where the tenant may not come back), renews the expiry of
  what it holds and sees every pool afresh.

So across any number of proxies a tenant gets at most its limit (a token is in one place at a
time), with what a single proxy lets through beyond it (a budget admits while it is not spent;
generated tokens are charged at the end) once per proxy; and at least its limit less what
other proxies hold unspent, which they give back within one renewal period. Counters in the
database per request were the other way: exact, but a write per request. A tenant's metering
owned by one proxy would need a network round trip to it per request, and another owner when it
dies; leases need neither, and a proxy that dies holds nothing once its expiry (the lease ttl)
has passed (what it held counts as spent).

Only a proxy with `[cluster]` on keeps shared limits; a single proxy meters in memory
(metering.py) and pays nothing for any of this. `max_concurrent` is counted across the proxies
by shared_concurrency.py, in the same tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace

from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.supervise import repeating
from cacheproxy.tenancy.limits import (
    BUDGET_NAMES,
    LIMIT_NAMES,
    RATE_NAMES,
    Limits,
    Refusal,
    TokenBucket,
    admit,
    day_start,
    month_start,
    take_prompt,
)
from cacheproxy.tenancy.pool_policy import Exchanged, PoolExchange, is_budget, projected_level
from cacheproxy.tenancy.pool_store import PoolStore, SharedLimitsUnavailable
from cacheproxy.tenancy.usage import hour_of

log = logging.getLogger(__name__)

PROMPT = "prompt_tokens_per_minute"
GENERATED = "generated_tokens_per_minute"
REQUESTS = "requests_per_minute"
# the limits a request needs a positive allowance of to be admitted, in the order a refusal
# names them (budgets, then token rates); requests take a whole one
POSITIVE_AT_ADMISSION = (*BUDGET_NAMES, PROMPT, GENERATED)
QUIET_ROUNDS = 3  # an allowance unused and empty for this many rounds is forgotten
TOP_UPS = 4  # exchanges a request may wait for before it is refused


@dataclass(frozen=True)
class PoolView:
    """A pool as this proxy last saw it (an exchange's answer)."""

    level: float
    stamp: float
    capacity: float
    others: float  # what the other live proxies held


class Allowance:
    """What this proxy holds of one tenant's limit, and what it spent."""

    __slots__ = ("held", "period", "quiet", "spent", "spent_before", "view")

    def __init__(self, period: float) -> None:
        self.period = period  # budgets: the day or month it counts; rates: 0
        self.held = 0.0  # may be spent here; below zero: spent beyond it, to be settled
        self.spent = 0.0  # since the last round
        self.spent_before = 0.0  # in the round period before: what the next one may need
        self.view: PoolView | None = None
        self.quiet = 0  # rounds in a row with nothing spent or held


class SharedLimits:
    """This proxy's allowances of every tenant's shared rates and budgets."""

    def __init__(
        self,
        store: PoolStore,
        proxy_id: str,
        renewal_s: float,
        ttl_s: float,
        limits_of: Callable[[str], Limits],
        seed_of: Callable[[str, float], int],
        clock: Callable[[], float] = time.time,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.store = store
        self.proxy_id = proxy_id
        self.renewal_s = renewal_s
        self.ttl_s = ttl_s  # what this proxy holds expires this long after its last exchange
        self.limits_of = limits_of
        self.seed_of = seed_of  # tokens the ledger counted for a tenant since a time
        self.clock = clock
        self.metrics = metrics
        self.allowances: dict[tuple[str, str], Allowance] = {}
        # set by the concurrency count: whether it holds anything (the rounds renew it)
        self.holds_requests: Callable[[], bool] = lambda: False
        # what this proxy holds counts in the pools until then (its last exchange renewed it);
        # past it (the database slow or out of reach) the pools count it as spent, and other
        # proxies may be granted it: it is spent here no more
        self.valid_until = 0.0
        self._under_way: dict[str, asyncio.Task[None]] = {}  # tenant -> its top-up
        # what the requests waiting for a top-up want of each (tenant, limit): asked together
        self._wanted: dict[tuple[str, str], float] = {}
        self._period_hour: int | None = None
        self._periods = {name: 0.0 for name in LIMIT_NAMES}

    # -- admission (memory first; an exchange only when an allowance runs short) --------------

    def admit(self, tenant: str, limits: Limits) -> bool:
        """Admit one request from what this proxy holds (taking a request): True; False: an
        allowance is short (nothing taken), `admit_topped_up` asks its pool."""
        now = self.clock()
        self._lapse_if_expired(now)
        for name in POSITIVE_AT_ADMISSION:
            if getattr(limits, name) is not None and self._allowance(tenant, name, now).held <= 0:
                return False
        if limits.requests_per_minute is not None:
            allowance = self._allowance(tenant, REQUESTS, now)
            if allowance.held < 1:
                return False
            allowance.held -= 1
            allowance.spent += 1
        return True

    async def admit_topped_up(self, tenant: str, limits: Limits) -> Refusal | None:
        """Admit one request once the allowances it lacks are topped up; the refusal if its
        pools cannot give them."""
        with self._wanting(tenant, REQUESTS, 1.0 if limits.requests_per_minute else 0.0):
            for _ in range(TOP_UPS):
                if self.admit(tenant, limits):
                    return None
                if not await self._top_up(tenant, self._lacking(tenant, limits)):
                    break
            if self.admit(tenant, limits):
                return None
        return self._refusal(tenant, limits, 0)

    def take_prompt(self, tenant: str, limits: Limits, n_tokens: int) -> bool:
        """Take a prompt's tokens from what this proxy holds: True; False: the allowance is
        short (nothing taken), `take_prompt_topped_up` asks its pool."""
        limit = limits.prompt_tokens_per_minute
        if limit is None:
            return True
        now = self.clock()
        self._lapse_if_expired(now)
        allowance = self._allowance(tenant, PROMPT, now)
        needed = min(n_tokens, limit)  # a larger prompt needs a whole minute's worth
        if allowance.held < needed or allowance.held <= 0:
            return False
        allowance.held -= n_tokens
        allowance.spent += n_tokens
        return True

    async def take_prompt_topped_up(
        self, tenant: str, limits: Limits, n_tokens: int
    ) -> Refusal | None:
        limit = limits.prompt_tokens_per_minute
        if limit is None:
            return None
        with self._wanting(tenant, PROMPT, min(n_tokens, limit)):
            for _ in range(TOP_UPS):
                if self.take_prompt(tenant, limits, n_tokens):
                    return None
                if not await self._top_up(tenant, [self._short(tenant, PROMPT, 1.0)]):
                    break
            if self.take_prompt(tenant, limits, n_tokens):
                return None
        return self._refusal(tenant, limits, n_tokens)

    def charge(self, tenant: str, limits: Limits, name: str, n_tokens: int) -> None:
        """Tokens already spent (generated, a prompt only the server counted, a budget's)."""
        if getattr(limits, name) is None or n_tokens <= 0:
            return
        allowance = self._allowance(tenant, name, self.clock())
        allowance.held -= n_tokens
        allowance.spent += n_tokens

    def view_buckets(self, tenant: str, limits: Limits) -> dict[str, TokenBucket]:
        """The tenant's rate buckets as this proxy sees them, for the rate-limit headers and
        refusals: what it holds and what the pool has (refilled since it was seen). What
        other proxies hold is left out: it may be spent already, and comes back to the pool
        within their next round if not."""
        now = self.clock()
        buckets: dict[str, TokenBucket] = {}
        for name in RATE_NAMES:
            limit = getattr(limits, name)
            if limit is not None:
                level = self._available(tenant, name, limit, now)
                buckets[name] = TokenBucket(float(limit), level, now)
        return buckets

    # -- what a refusal says ---------------------------------------------------------------

    def _refusal(self, tenant: str, limits: Limits, prompt_tokens: int) -> Refusal:
        """Why the tenant is refused, from this proxy's view of its pools (what others hold
        counted as spent), and when it may be served again."""
        now = self.clock()
        buckets = self.view_buckets(tenant, limits)
        for bucket in buckets.values():  # granted in whole tokens: a part of one is none
            bucket.level = math.floor(bucket.level)
        if prompt_tokens:
            refusal = take_prompt(buckets, limits, prompt_tokens, now)
        else:
            today, this_month = (
                0 if limit is None else int(limit - self._available(tenant, name, limit, now))
                for name in BUDGET_NAMES
                for limit in [getattr(limits, name)]
            )
            refusal = admit(buckets, limits, now, today, this_month)
        if refusal is None:  # the pools changed since they were seen: soon again
            return Refusal("requests_per_minute", "limits being settled between proxies", 1.0)
        name = refusal.limit.removeprefix("budget_")
        allowance = self.allowances.get((tenant, name))
        view = allowance.view if allowance is not None else None
        if is_budget(name) and view is not None and view.others > 0:
            # another proxy holds some of the budget (or did at its last round): what it does
            # not spend comes back within its next round, not the next day or month. A rate's
            # refill says when it surely allows, within a minute anyway.
            return replace(refusal, retry_after_s=min(refusal.retry_after_s, self.renewal_s))
        return refusal

    def _available(self, tenant: str, name: str, limit: int, now: float) -> float:
        allowance = self.allowances.get((tenant, name))
        if allowance is None or allowance.view is None:
            return float(limit)  # never seen: as a new pool
        view, held = allowance.view, allowance.held
        if is_budget(name) and view.stamp != self._period(name, now):
            return float(limit)  # a new day or month
        room = limit - view.others - max(held, 0.0)
        pool = projected_level(name, view.level, view.stamp, float(limit), room, now)
        return held + pool

    # -- exchanges ---------------------------------------------------------------------------

    def _lacking(self, tenant: str, limits: Limits) -> list[tuple[str, float, bool]]:
        """(limit, what its pool must give, whether any part will do) for each allowance the
        request lacks."""
        now = self.clock()
        lacking = [
            (name, 1.0, True)
            for name in POSITIVE_AT_ADMISSION
            if getattr(limits, name) is not None and self._allowance(tenant, name, now).held <= 0
        ]
        if limits.requests_per_minute is not None:
            if self._allowance(tenant, REQUESTS, now).held < 1:
                lacking.append(self._short(tenant, REQUESTS, 1.0))
        return lacking

    def _short(self, tenant: str, name: str, least: float) -> tuple[str, float, bool]:
        """What the requests waiting for `name` want beyond what this proxy holds (at least
        `least`): asked for together, any part of it welcome."""
        held = max(self._allowance(tenant, name, self.clock()).held, 0.0)
        return (name, max(self._wanted.get((tenant, name), 0.0) - held, least), True)

    @contextlib.contextmanager
    def _wanting(self, tenant: str, name: str, amount: float) -> Iterator[None]:
        """A request waits for `amount` of the tenant's `name` meanwhile."""
        if amount <= 0:  # nothing wanted (the limit unset): nothing recorded
            yield
            return
        key = (tenant, name)
        self._wanted[key] = self._wanted.get(key, 0.0) + amount
        try:
            yield
        finally:
            # requests of one tenant end in any order: what is left is what the others want
            left = self._wanted.pop(key, 0.0) - amount
            if left > 0:
                self._wanted[key] = left

    async def _top_up(self, tenant: str, lacking: list[tuple[str, float, bool]]) -> bool:
        """Ask the pools for what the tenant's allowances lack (or wait for the top-up under
        way); False, asking nothing, when this proxy last saw one of them unable to give it."""
        under_way = self._under_way.get(tenant)
        if under_way is None:
            now = self.clock()
            if not all(self._may_give(tenant, *want, now) for want in lacking):
                return False
            items = [self._top_up_item(tenant, *want, now) for want in lacking]
            under_way = asyncio.create_task(
                self._exchange(items, "top_up"), name="shared-limits-top-up"
            )
            self._under_way[tenant] = under_way
            under_way.add_done_callback(lambda _: self._under_way.pop(tenant, None))
        # shielded: a request whose client leaves does not cut the exchange in half
        await asyncio.shield(under_way)
        return True

    def _may_give(self, tenant: str, name: str, need: float, partial: bool, now: float) -> bool:
        allowance = self._allowance(tenant, name, now)
        view = allowance.view
        if view is None or (is_budget(name) and view.stamp != allowance.period):
            return True  # never seen, or a new period: ask
        room = view.capacity - view.others - max(allowance.held, 0.0)
        level = projected_level(name, view.level, view.stamp, view.capacity, room, now)
        level += min(allowance.held, 0.0)  # the debt it settles first
        return level >= 1 if partial else level >= need

    def _top_up_item(
        self, tenant: str, name: str, need: float, partial: bool, now: float
    ) -> PoolExchange:
        allowance = self._allowance(tenant, name, now)
        settle = min(allowance.held, 0.0)  # a debt is settled; what it holds, it keeps
        allowance.held -= settle
        return self._item(tenant, name, allowance, settle, need, partial, allowance.spent_before)

    def _item(
        self,
        tenant: str,
        name: str,
        allowance: Allowance,
        settle: float,
        need: float,
        partial: bool,
        extra: float,
    ) -> PoolExchange:
        limit = getattr(self.limits_of(tenant), name)
        seed = self.seed_of(tenant, allowance.period) if is_budget(name) else 0
        return PoolExchange(
            tenant=tenant,
            name=name,
            limit=limit,
            period=allowance.period,
            seed=float(seed),
            settle=settle,
            keep=max(allowance.held, 0.0),
            need=need,
            partial=partial,
            extra=extra,
        )

    async def _exchange(self, items: list[PoolExchange], kind: str) -> None:
        """Run `items` in one transaction and apply what they were granted; on failure what
        they were to settle is held again (nothing was written)."""
        now = self.clock()
        try:
            results = await self.store.aexchange(self.proxy_id, items, now, now + self.ttl_s)
        except Exception as exc:
            for item in items:
                allowance = self.allowances.get((item.tenant, item.name))
                if allowance is not None and allowance.period == item.period:
                    allowance.held += item.settle
            raise SharedLimitsUnavailable(f"the shared limits could not be read: {exc!r}") from exc
        self.valid_until = max(self.valid_until, now + self.ttl_s)
        if self.metrics is not None:
            self.metrics.shared_limit_exchanges.labels(kind).inc()
        for item, result in zip(items, results, strict=True):
            self._apply(item, result)

    def _lapse_if_expired(self, now: float) -> None:
        """Past `valid_until` nothing this proxy held is spent here any more (a debt stays
        to be settled)."""
        if now >= self.valid_until:
            for allowance in self.allowances.values():
                allowance.held = min(allowance.held, 0.0)

    def _apply(self, item: PoolExchange, result: Exchanged) -> None:
        key = (item.tenant, item.name)
        allowance = self.allowances.get(key)
        if allowance is None or allowance.period != item.period:
            return  # forgotten, or a new period began meanwhile: what it got is of no use
        allowance.held += result.granted
        allowance.view = PoolView(result.level, result.stamp, result.capacity, result.others)

    # -- rounds ------------------------------------------------------------------------------

    async def round(self, final: bool = False) -> None:
        """Settle every allowance with its pool, keep (and take) what it spent in the period
        just ended, renew what this proxy holds; `final`: give everything back."""
        now = self.clock()
        items = []
        for (tenant, name), allowance in list(self.allowances.items()):
            self._roll(allowance, name, now)
            limit = getattr(self.limits_of(tenant), name)
            spent = allowance.spent if limit is not None and not final else 0.0
            keep = min(max(allowance.held, 0.0), spent)
            settle = allowance.held - keep
            allowance.held -= settle
            allowance.spent_before, allowance.spent = allowance.spent, 0.0
            items.append(self._item(tenant, name, allowance, settle, 0.0, True, spent - keep))
        if not items and not self.holds_requests():
            return  # nothing held anywhere: no transaction at all
        await self._exchange(items, "round")
        for item in items:
            key = (item.tenant, item.name)
            allowance = self.allowances.get(key)
            if allowance is None:
                continue
            idle = allowance.spent_before == 0 and allowance.held == 0
            allowance.quiet = allowance.quiet + 1 if idle else 0
            if item.limit is None or allowance.quiet >= QUIET_ROUNDS:
                del self.allowances[key]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SharedLimits]:
        """The rounds, in a named task, while the proxy runs; at the end everything held is
        given back."""
        try:
            async with repeating(
                "shared-limits-rounds",
                "shared limits",
                self.round,
                pause_s=self.renewal_s,
                log=log,
                after_failure_s=self.renewal_s,
            ):
                yield self
        finally:
            try:
                await self.round(final=True)
            except Exception as exc:  # what it held then counts as spent
                log.warning("shared limits: allowances not given back at stop (%r)", exc)

    # -- periods -----------------------------------------------------------------------------

    def _allowance(self, tenant: str, name: str, now: float) -> Allowance:
        allowance = self.allowances.get((tenant, name))
        if allowance is None:
            allowance = self.allowances[(tenant, name)] = Allowance(self._period(name, now))
        elif allowance.period and allowance.period != self._period(name, now):
            self._roll(allowance, name, now)
        return allowance

    def _roll(self, allowance: Allowance, name: str, now: float) -> None:
        """A new day or month: what the allowance held or owed was of the one that ended."""
        period = self._period(name, now)
        if allowance.period != period:
            allowance.period = period
            allowance.held = allowance.spent = allowance.spent_before = 0.0
            allowance.view = None

    def _period(self, name: str, now: float) -> float:
        hour = hour_of(now)
        if hour != self._period_hour:  # computed once an hour
            self._period_hour = hour
            self._periods["tokens_per_day"] = day_start(now)
            self._periods["tokens_per_month"] = month_start(now)
        return self._periods[name]
