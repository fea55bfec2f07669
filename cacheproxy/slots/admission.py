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
    """Counts each tenant's requests in the proxy (waiting for a slot or running)."""

    def __init__(self) -> None:
        self._in_flight: Counter[str] = Counter()

    def in_flight(self, tenant: str) -> int:
        return self._in_flight[tenant]

    def enter(self, tenant: str, cap: int | None, count: int = 1) -> None:
        """`count` more requests (or tasks of one request) of `tenant`, to be given back by
        `leave`; `ConcurrencyLimited` (nothing taken) past its cap."""
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

    def leave(self, tenant: str, count: int = 1) -> None:
        self._in_flight[tenant] -= count
        if not self._in_flight[tenant]:
            del self._in_flight[tenant]

    @contextmanager
    def held(self, tenant: str, cap: int | None, count: int = 1) -> Iterator[None]:
        """`count` requests of `tenant` for the duration; `ConcurrencyLimited` past its cap."""
        self.enter(tenant, cap, count)
        try:
            yield
        finally:
            self.leave(tenant, count)
