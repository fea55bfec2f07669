"""The meter: counts every tenant's usage into the ledger and enforces its limits.

It lives on the event loop and never blocks it: counting and limit decisions are in memory
(`tenancy/limits.py`, `tenancy/usage.py`); a named background task writes what was counted to
the ledger (`tenancy/ledger.py`, on its worker thread) every `usage.flush_interval_s`, with the
rate buckets' levels, so a kill -9 loses at most one interval and a restart refills no bucket.
A stop writes the rest (its cleanup runs after the cache layer's, whose drain is counted too).
Budgets read the ledger's totals for this month once at start, then add what is counted.

Where usage is fed from (one place per request shape): the task route counts each client
request and its status (`record_request`); the cache layer counts each task it placed on a slot,
single or one of a split request's (`record_task`, from the same outcome that feeds
`CacheLayer.usage`), and each request run on a whole upstream from its answer; the disk tier
counts the bytes it archived for the tenant whose text it saved (`record_archived`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from cacheproxy.errors import ApiError
from cacheproxy.ops.supervise import repeat
from cacheproxy.settings import UsageSettings
from cacheproxy.tenancy.ledger import HourKey, LedgerStore, ModelHourKey, SavedBucket
from cacheproxy.tenancy.limits import (
    REQUEST_RATE_HEADERS,
    TOKEN_RATE_HEADERS,
    Limits,
    Refusal,
    TokenBucket,
    admit,
    charge,
    month_start,
    rate_headers,
    refusal_headers,
    take_prompt,
)
from cacheproxy.tenancy.limits import day_start as day_start_of
from cacheproxy.tenancy.usage import HOUR_S, budget_tokens, hour_of, task_figures

if TYPE_CHECKING:
    from cacheproxy.tenancy.shared_concurrency import SharedConcurrency
    from cacheproxy.upstreams.slot_table import TaskOutcome

log = logging.getLogger(__name__)

# set once a request is admitted: the tenant whose rate-limit headers its answer carries, and
# its request-rate headers as of its admission (what remained once it took its request)
ADMITTED = web.RequestKey("admitted", tuple)
DAY_S = 86400


class Meter:
    def __init__(
        self,
        store: LedgerStore,
        settings: UsageSettings,
        limits_of: Callable[[str], Limits],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings
        self.limits_of = limits_of  # a tenant's effective limits (its own over the defaults)
        self.clock = clock
        self.pending: dict[HourKey, Counter[str]] = {}
        # the same per model: what each model's tasks used (by the name its upstream gives it)
        self.pending_models: dict[ModelHourKey, Counter[str]] = {}
        self.buckets: dict[str, dict[str, TokenBucket]] = {}
        # prompt + generated tokens per tenant and hour, this month: durable and pending
        self.hour_tokens: dict[str, dict[int, int]] = {}
        # sums of hour_tokens asked per request (since the day's and the month's start), kept
        # up to date as tokens are counted rather than summed over up to 744 hours each time
        self._used: dict[str, dict[float, int]] = {}  # tenant -> since -> tokens
        # the hour whose UTC day and month starts are `_period_starts`
        self._period_hour: int | None = None
        self._period_starts = (0.0, 0.0)
        self.writing = asyncio.Lock()

    async def load(self) -> None:
        """Read the buckets' saved levels and this month's totals (at start)."""
        self.buckets = await self.store.abuckets()
        self.hour_tokens = await self.store.abudget_totals(int(month_start(self.clock())))
        self._used.clear()

    # -- limits --------------------------------------------------------------------------------

    # the tenants' `max_concurrent` counted across proxies (None: by the request path alone)
    across: SharedConcurrency | None = None

    def admit(self, tenant: str) -> dict[str, str] | None:
        """Admit one request of `tenant` (taking a request token), or raise its 429; the
        request-rate headers as they stand once it is admitted. None only where limits are
        shared between proxies (shared_meter.py): this proxy must top its allowance up first,
        with `admit_topped_up`."""
        now = self.clock()
        today, this_month = self._periods(now)
        buckets, limits = self._buckets_of(tenant), self.limits_of(tenant)
        refusal = admit(
            buckets,
            limits,
            now,
            self.used_since(tenant, today),
            self.used_since(tenant, this_month),
        )
        if refusal is not None:
            raise self._refused(tenant, refusal, now)
        return rate_headers(buckets, limits, now, REQUEST_RATE_HEADERS)

    async def admit_topped_up(self, tenant: str) -> dict[str, str]:
        """`admit`, once the allowances it lacks are topped up (shared limits; here none)."""
        headers = self.admit(tenant)
        assert headers is not None  # a meter of its own never needs a top-up
        return headers

    def answer_headers(self, request: web.Request) -> dict[str, str]:
        """The rate-limit headers of an answer to an admitted request (none otherwise):
        token figures as they stand now, request figures as of its admission."""
        admitted = request.get(ADMITTED)
        if admitted is None:
            return {}
        tenant, request_headers = admitted
        # the `-requests` headers are the admission's: only the token rates are read now
        headers = rate_headers(
            self._buckets_of(tenant), self.limits_of(tenant), self.clock(), TOKEN_RATE_HEADERS
        )
        headers.update(request_headers)
        return headers

    def take_prompt(self, tenant: str, n_tokens: int) -> bool:
        """Take a prompt's tokens before it is forwarded (True), or raise its 429. False only
        where limits are shared (shared_meter.py): `take_prompt_topped_up` then."""
        now = self.clock()
        refusal = take_prompt(self._buckets_of(tenant), self.limits_of(tenant), n_tokens, now)
        if refusal is not None:
            raise self._refused(tenant, refusal, now)
        return True

    async def take_prompt_topped_up(self, tenant: str, n_tokens: int) -> None:
        """`take_prompt`, once the allowance is topped up (shared limits; here never short)."""
        self.take_prompt(tenant, n_tokens)

    def headers(self, tenant: str) -> dict[str, str]:
        return rate_headers(self._buckets_of(tenant), self.limits_of(tenant), self.clock())

    def used_since(self, tenant: str, since: float) -> int:
        sums = self._used.setdefault(tenant, {})
        used = sums.get(since)
        if used is None:
            hours = self.hour_tokens.get(tenant, {})
            used = sums[since] = sum(tokens for hour, tokens in hours.items() if hour >= since)
        return used

    def _periods(self, now: float) -> tuple[float, float]:
        """The starts of the UTC day and month `now` falls in (computed once an hour)."""
        hour = hour_of(now)
        if hour != self._period_hour:
            self._period_hour = hour
            self._period_starts = (day_start_of(now), month_start(now))
        return self._period_starts

    def _refused(self, tenant: str, refusal: Refusal, now: float) -> ApiError:
        headers = {
            **refusal_headers(self._buckets_of(tenant), self.limits_of(tenant), refusal, now),
            "Retry-After": refusal.retry_after_header,
            "retry-after-ms": str(max(1, round(refusal.retry_after_s * 1000))),
        }
        return ApiError(429, refusal.message, refusal.limit, headers=headers)

    def _buckets_of(self, tenant: str) -> dict[str, TokenBucket]:
        buckets = self.buckets.get(tenant)
        if buckets is None:  # not setdefault: that would build a dict every call
            buckets = self.buckets[tenant] = {}
        return buckets

    # -- counting ------------------------------------------------------------------------------

    def record_request(self, tenant: str, status: int) -> None:
        """A client request on a task route, answered with `status` (or cut: >= 400)."""
        figures = self._hour(tenant)
        figures["requests"] += 1
        if status >= 400:
            figures["errors"] += 1

    def record_task(self, tenant: str, figures: Mapping[str, int], prompt_taken: bool) -> None:
        """What a finished task used; its generated tokens (and its prompt, when it could not
        be taken before: the server alone knew it) are charged to the rate buckets now."""
        now = self.clock()
        hour = hour_of(now)
        pending = self.pending.get((tenant, hour))
        if pending is None:
            pending = self.pending[(tenant, hour)] = Counter()
        _add(pending, figures)
        tokens = self.hour_tokens.setdefault(tenant, {})
        spent = budget_tokens(figures)
        tokens[hour] = tokens.get(hour, 0) + spent
        sums = self._used.get(tenant, {})
        for since, used in sums.items():
            if hour >= since:
                sums[since] = used + spent
        self._charge_spent(tenant, figures, spent, prompt_taken, now)

    def _charge_spent(
        self, tenant: str, figures: Mapping[str, int], spent: int, prompt_taken: bool, now: float
    ) -> None:
        """Charge a finished task's tokens to the rate buckets (budgets read `hour_tokens`)."""
        limits = self.limits_of(tenant)
        buckets = self._buckets_of(tenant)
        charge(buckets, limits, "generated_tokens_per_minute", figures["generated_tokens"], now)
        if not prompt_taken:
            charge(buckets, limits, "prompt_tokens_per_minute", figures["prompt_tokens"], now)

    def record_outcome(
        self,
        tenant: str,
        outcome: TaskOutcome,
        previous_owner: str | None,
        disk_action: str,
        prompt_taken: bool,
        model: str | None = None,
    ) -> None:
        """A task's figures as the server reported them (none for a task it reported nothing
        of: failed or cut before its end); `model`: the model that ran it, counted apart too."""
        reused, computed = outcome.cache_n or 0, outcome.prompt_n or 0
        figures = task_figures(
            prompt_tokens=reused + computed,
            computed_tokens=computed,
            reused_tokens=reused,
            generated_tokens=outcome.predicted_n,
            tenant=tenant,
            previous_owner=previous_owner,
            disk_action=disk_action,
        )
        self.record_task(tenant, figures, prompt_taken)
        if model is not None:
            key = (tenant, model, hour_of(self.clock()))
            by_model = self.pending_models.get(key)
            if by_model is None:
                by_model = self.pending_models[key] = Counter()
            _add(by_model, figures)
            by_model["requests"] += 1  # per model: the tasks it ran

    def record_archived(self, tenant: str, n_bytes: int) -> None:
        self._hour(tenant)["archived_bytes"] += n_bytes

    def _hour(self, tenant: str) -> Counter[str]:
        key = (tenant, hour_of(self.clock()))
        figures = self.pending.get(key)
        if figures is None:  # not setdefault: that would build a Counter every call
            figures = self.pending[key] = Counter()
        return figures

    # -- writing -------------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write what was counted since the last flush, and the buckets' levels, in one
        transaction off the loop; on failure it stays counted for the next one."""
        async with self.writing:
            batch, self.pending = self.pending, {}
            models, self.pending_models = self.pending_models, {}
            now = self.clock()
            buckets: list[SavedBucket] = [
                (tenant, name, TokenBucket(b.capacity, b.level, b.updated))
                for tenant, named in self.buckets.items()
                for name, b in named.items()
            ]
            prune_before = hour_of(now) - self.settings.retention_days * DAY_S
            try:
                await self.store.awrite(batch, buckets, prune_before, models)
            except Exception:
                for key, figures in batch.items():  # merged back: counted again next time
                    self.pending.setdefault(key, Counter()).update(figures)
                for model_key, figures in models.items():
                    self.pending_models.setdefault(model_key, Counter()).update(figures)
                raise
            self._forget_old_hours(now)

    async def rows(
        self, tenant: str | None, start: int | None, end: int | None, by_model: bool = False
    ) -> list[dict[str, Any]]:
        """The ledger's hours in [start, end) with what is counted but not yet written
        (`by_model`: per model as well)."""
        async with self.writing:  # not while a batch is between memory and the file
            rows = await self.store.arows(tenant, start, end, by_model)
            for key, figures in self._pending_rows(by_model):
                hour = key["hour"]
                if (tenant is None or key["tenant_id"] == tenant) and (
                    (start is None or hour >= start) and (end is None or hour < end)
                ):
                    rows.append({**key, **figures})
        return rows

    def _pending_rows(self, by_model: bool) -> list[tuple[dict[str, Any], Counter[str]]]:
        """What is counted but not yet written, each with its row's key columns."""
        if by_model:
            return [
                ({"tenant_id": tenant, "model": model, "hour": hour}, figures)
                for (tenant, model, hour), figures in self.pending_models.items()
            ]
        return [
            ({"tenant_id": tenant, "hour": hour}, figures)
            for (tenant, hour), figures in self.pending.items()
        ]

    def _forget_old_hours(self, now: float) -> None:
        since = month_start(now) - HOUR_S
        for hours in self.hour_tokens.values():
            for hour in [hour for hour in hours if hour < since]:
                del hours[hour]
        self._used.clear()  # summed again when next asked: past days' sums go


@contextlib.asynccontextmanager
async def running_meter(
    store_path: Path | str,
    settings: UsageSettings,
    limits_of: Callable[[str], Limits],
    make: Callable[[LedgerStore, UsageSettings, Callable[[str], Limits]], Meter] = Meter,
) -> AsyncIterator[Meter]:
    """Open the ledger, load the meter (`make`: the kind) and write batches in a named task;
    at the end stop the task (never in the middle of a write) and write the rest."""
    store = await LedgerStore.aopen(store_path)
    try:
        meter = make(store, settings, limits_of)
        await meter.load()
        writer = asyncio.create_task(
            repeat(
                "usage ledger",
                meter.flush,
                pause_s=settings.flush_interval_s,
                log=log,
                after_failure_s=settings.flush_interval_s,
            ),
            name="usage-ledger-writer",
        )
        try:
            yield meter
        finally:
            async with meter.writing:  # a write under way ends first: none is cut half-way
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
            try:
                await meter.flush()
            except Exception as exc:  # nothing else can be done: say what is lost
                log.error("usage ledger: the last batch could not be written: %r", exc)
    finally:
        await store.aclose()


def _add(counter: Counter[str], figures: Mapping[str, int]) -> None:
    """`counter.update(figures)` without its generic checks (an ABC isinstance test each call):
    run twice a task."""
    for name, value in figures.items():
        counter[name] = counter.get(name, 0) + value
