"""The meter of a proxy in a cluster: the same ledger and counting as a single proxy's
(metering.py), with the tenants' limits shared by every proxy (shared_limits.py for rates and
budgets, shared_concurrency.py for `max_concurrent`), so each tenant has one meter wherever it
is served.

What changes for a request: admission and the prompt's tokens are taken from this proxy's
allowance (memory) while it lasts, topped up from the shared pool otherwise; generated tokens
and budgets are charged to the allowance as the answer ends; the rate-limit headers show the
tenant's bucket across the proxies as this proxy last saw it, and Retry-After when the tenant
may next be served (at most a renewal period when another proxy holds some of the limit).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cacheproxy.errors import ApiError
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.settings import UsageSettings
from cacheproxy.tenancy.ledger import LedgerStore
from cacheproxy.tenancy.limits import (
    BUDGET_NAMES,
    REQUEST_RATE_HEADERS,
    Limits,
    TokenBucket,
    rate_headers,
)
from cacheproxy.tenancy.metering import Meter, running_meter
from cacheproxy.tenancy.pool_store import PoolStore, SharedLimitsUnavailable
from cacheproxy.tenancy.shared_concurrency import SharedConcurrency
from cacheproxy.tenancy.shared_limits import GENERATED, PROMPT, SharedLimits


@dataclass(frozen=True)
class LimitSharing:
    """Where and how the proxies of a cluster share the tenants' limits."""

    database: Path | str  # the database they share (the registry's, where the leases are)
    proxy_id: str
    renewal_s: float  # how often allowances are settled: the limits hold to within it
    ttl_s: float  # what a proxy that stopped renewing held expires after this long


class SharedMeter(Meter):
    """A meter whose limits are shared with the other proxies of a cluster."""

    def __init__(
        self,
        store: LedgerStore,
        settings: UsageSettings,
        limits_of: Callable[[str], Limits],
        *,
        pools: PoolStore,
        sharing: LimitSharing,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        super().__init__(store, settings, limits_of)
        self.sharing = sharing
        self.shared = SharedLimits(
            pools,
            sharing.proxy_id,
            sharing.renewal_s,
            sharing.ttl_s,
            limits_of,
            self.used_since,
            clock=self.clock,
            metrics=metrics,
        )
        self.across = SharedConcurrency(
            pools, sharing.proxy_id, sharing.ttl_s, clock=self.clock, metrics=metrics
        )
        self.shared.holds_requests = self.across.holds_any
        self.across.renewed_until = lambda: self.shared.valid_until

    def admit(self, tenant: str) -> dict[str, str] | None:
        limits = self.limits_of(tenant)
        if not self.shared.admit(tenant, limits):
            return None
        return rate_headers(self._buckets_of(tenant), limits, self.clock(), REQUEST_RATE_HEADERS)

    async def admit_topped_up(self, tenant: str) -> dict[str, str]:
        limits = self.limits_of(tenant)
        try:
            refusal = await self.shared.admit_topped_up(tenant, limits)
        except SharedLimitsUnavailable as exc:
            raise self._unavailable(exc) from exc
        if refusal is not None:
            raise self._refused(tenant, refusal, self.clock())
        return rate_headers(self._buckets_of(tenant), limits, self.clock(), REQUEST_RATE_HEADERS)

    def take_prompt(self, tenant: str, n_tokens: int) -> bool:
        return self.shared.take_prompt(tenant, self.limits_of(tenant), n_tokens)

    async def take_prompt_topped_up(self, tenant: str, n_tokens: int) -> None:
        try:
            refusal = await self.shared.take_prompt_topped_up(
                tenant, self.limits_of(tenant), n_tokens
            )
        except SharedLimitsUnavailable as exc:
            raise self._unavailable(exc) from exc
        if refusal is not None:
            raise self._refused(tenant, refusal, self.clock())

    def _charge_spent(
        self, tenant: str, figures: Mapping[str, int], spent: int, prompt_taken: bool, now: float
    ) -> None:
        limits = self.limits_of(tenant)
        shared = self.shared
        shared.charge(tenant, limits, GENERATED, figures["generated_tokens"])
        if not prompt_taken:
            shared.charge(tenant, limits, PROMPT, figures["prompt_tokens"])
        for name in BUDGET_NAMES:
            shared.charge(tenant, limits, name, spent)

    def _buckets_of(self, tenant: str) -> dict[str, TokenBucket]:
        # the headers' and refusals' view: the tenant's buckets across the proxies
        return self.shared.view_buckets(tenant, self.limits_of(tenant))

    def _unavailable(self, exc: SharedLimitsUnavailable) -> ApiError:
        retry = str(max(1, round(self.sharing.renewal_s)))
        return ApiError(503, str(exc), headers={"Retry-After": retry})


@contextlib.asynccontextmanager
async def running_shared_meter(
    store_path: Path | str,
    settings: UsageSettings,
    limits_of: Callable[[str], Limits],
    sharing: LimitSharing,
    metrics: ProxyMetrics | None = None,
) -> AsyncIterator[SharedMeter]:
    """`running_meter` with shared limits: their rounds and the concurrency count's writer run
    while it does; at the end everything held is given back."""
    pools = await PoolStore.aopen(sharing.database)
    try:
        # what this proxy held before a kill -9 is gone with that process: not renewed now
        await pools.aleave(sharing.proxy_id)
        make = functools.partial(SharedMeter, pools=pools, sharing=sharing, metrics=metrics)
        async with running_meter(store_path, settings, limits_of, make) as meter:
            assert isinstance(meter, SharedMeter)
            async with meter.across.running(), meter.shared.running():
                yield meter
    finally:
        await pools.aclose()
