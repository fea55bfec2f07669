"""What a tenant's request may claim before it is placed: its share and class in the fair
queue, its bound on waiting requests, and its cap on requests in the proxy at once (pure).

The concurrency cap refuses (429 `concurrency_limit_error`) rather than queues: a tenant at its
cap has asked for more parallelism than it is allowed, and holding its extra requests idle
would show the client slowness instead of telling it to back off; bursts within the cap still
wait in the tenant's own queue, which has its own bound (429 `queue_limit_error`). A split
request (`n` > 1, a batch of prompts) counts as its tasks: one that alone passes the cap can
never run within it, and is refused the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from cacheproxy.settings import SchedulingSettings
from cacheproxy.slots.fair_queue import PRIORITIES, Priority, Share, capped_priority
from cacheproxy.tenancy.registry import DEFAULT_TENANT, Tenant
from cacheproxy.tenancy.shared_concurrency import SharedConcurrency

QUEUE_LIMIT_ERROR = "queue_limit_error"
CONCURRENCY_LIMIT_ERROR = "concurrency_limit_error"


class InvalidPriority(ValueError):
    """The priority header names no class (400)."""


class ConcurrencyLimited(Exception):
    """The tenant has as many requests in the proxy as it may (429)."""


@dataclass(frozen=True)
class TenantLimits:
    """A request's place among the tenants: its share, and its tenant's bounds."""

    share: Share = field(default_factory=Share)
    max_queued: int | None = None  # None: no bound but the whole queue's
    max_concurrent: int | None = None  # None: no cap


def limits_for(tenant: Tenant, asked: str | None, settings: SchedulingSettings) -> TenantLimits:
    """The limits a request of `tenant` runs under, `asked` being its priority header's value
    (None: absent). A class above the tenant's `max_priority` is lowered to it, not refused:
    a client that always sends the header keeps working when the admin changes the cap."""
    if asked is None:
        priority: Priority = settings.default_priority
    else:
        wanted = asked.strip().lower()
        if wanted not in PRIORITIES:
            raise InvalidPriority(
                f"{settings.priority_header} must be one of {', '.join(PRIORITIES)}"
                f" (got {asked[:32]!r})"
            )
        priority = wanted  # type: ignore[assignment]  # checked just above
    ceiling = tenant.max_priority if tenant.max_priority in PRIORITIES else "batch"
    if tenant.id == DEFAULT_TENANT.id:
        # no tenants configured: everyone is this one, and a bound of its own would only
        # shrink the whole queue (`routing.max_queue` bounds it)
        return TenantLimits(share=Share(priority=priority))
    max_concurrent = tenant.max_concurrent or settings.max_concurrent_per_tenant
    return TenantLimits(
        share=Share(
            weight=tenant.weight,
            priority=capped_priority(priority, ceiling),  # type: ignore[arg-type]
            max_concurrent=max_concurrent,
        ),
        max_queued=tenant.max_queued or settings.max_queue_per_tenant,
        max_concurrent=max_concurrent,
    )


class RequestLimits:
    """`limits_for` under one app's settings, kept per tenant and header value: a tenant is a
    frozen object of the registry's snapshot, so what it may claim changes only with a new
    object, and working it out takes several calls, once a request."""

    MAX_KEPT = 4096  # header values are the client's: past this many, start afresh

    def __init__(self, settings: SchedulingSettings) -> None:
        self.settings = settings
        self._kept: dict[tuple[str, str | None], tuple[Tenant, TenantLimits]] = {}

    def of(self, tenant: Tenant, asked: str | None) -> TenantLimits:
        """`limits_for(tenant, asked, settings)`; raises `InvalidPriority` as it does."""
        key = (tenant.id, asked)
        kept = self._kept.get(key)
        if kept is not None and kept[0] is tenant:
            return kept[1]
        limits = limits_for(tenant, asked, self.settings)
        if len(self._kept) >= self.MAX_KEPT:
            self._kept.clear()
        self._kept[key] = (tenant, limits)
        return limits


class ConcurrencyGate:
    """Counts each tenant's requests in the proxy (waiting for a slot or running); with
    `across` (several proxies), a capped tenant's are also held in the count every proxy of
    the cluster shares (tenancy/shared_concurrency.py), so its cap holds across them."""

    def __init__(self, across: SharedConcurrency | None = None) -> None:
        self._in_flight: Counter[str] = Counter()
        self.across = across

    def in_flight(self, tenant: str) -> int:
        return self._in_flight[tenant]

    def enter(self, tenant: str, cap: int | None, count: int = 1) -> bool:
        """`count` more requests (or tasks of one request) of `tenant`, to be given back by
        `leave`; `ConcurrencyLimited` (nothing taken) past its cap. False (several proxies):
        counted here, but not yet in the shared count: `enter_across` asks for their places
        there."""
        self._enter_here(tenant, cap, count)
        if cap is None or self.across is None:
            return True
        return self.across.try_take(tenant, cap, count)

    def _enter_here(self, tenant: str, cap: int | None, count: int) -> None:
        in_flight = self._in_flight[tenant]
        if cap is not None and in_flight + count > cap:
            if count == 1:
                message = f"this tenant already has {in_flight} requests in progress"
            else:  # a split request: each of its tasks is a request in progress
                message = (
                    f"this request's {count} more tasks (`n`, or a batch's prompts) would take"
                    f" this tenant, with {in_flight} requests in progress, past its limit"
                )
            raise ConcurrencyLimited(f"{message} (its limit is {cap})")
        self._in_flight[tenant] = in_flight + count

    async def enter_across(self, tenant: str, cap: int, count: int = 1) -> None:
        """Places in the shared count for the `count` requests `enter` counted here;
        `ConcurrencyLimited` (and nothing held, here either) past the cap across the proxies."""
        assert self.across is not None
        try:
            others = await self.across.take(tenant, cap, count)
        except BaseException:
            self._left_here(tenant, count)
            raise
        if others is not None:
            self._left_here(tenant, count)
            if count == 1:
                message = f"this tenant already has {cap} requests in progress (its limit is {cap})"
                raise ConcurrencyLimited(f"{message}, {others} of them on other proxies")
            raise ConcurrencyLimited(  # a split request's other tasks
                f"this request's {count} more tasks (`n`, or a batch's prompts) would take this"
                f" tenant past its limit (its limit is {cap}, with {others} requests in progress"
                " on other proxies)"
            )

    def leave(self, tenant: str, cap: int | None = None, count: int = 1) -> None:
        """`count` requests `enter` (with `cap`) counted have ended."""
        self._left_here(tenant, count)
        if cap is not None and self.across is not None:
            self.across.give_back(tenant, count)

    def _left_here(self, tenant: str, count: int = 1) -> None:
        self._in_flight[tenant] -= count
        if not self._in_flight[tenant]:
            del self._in_flight[tenant]

    @contextmanager
    def held(self, tenant: str, cap: int | None, count: int = 1) -> Iterator[None]:
        """`count` requests of `tenant` for the duration, counted here only (`across` is asked
        by the request path); `ConcurrencyLimited` past its cap."""
        self._enter_here(tenant, cap, count)
        try:
            yield
        finally:
            self._left_here(tenant, count)
