"""A tenant's `max_concurrent` across the proxies of a cluster: a shared count of its requests
in progress, each proxy holding as many as it runs (pool_store.py `set_concurrency`).

A request of a capped tenant that this proxy holds no spare place for asks the database for
one: the writer (a named background task) asks for every tenant waiting at once, in one
transaction, which grants what the cap leaves beside what the other live proxies hold. A request
that ends gives its place back the same way, at once, so another proxy can take it; a proxy that
dies holds nothing once its holdings' expiry (the lease ttl, renewed by the shared limits'
rounds) has passed.

A split request (`n` > 1, a batch of prompts) asks for its tasks' places at once: all of them
or none. So at most `max_concurrent` of the tenant's requests run across the proxies; the cost is a
transaction per request of a capped tenant (none for the others, none without `[cluster]`).
A place given back elsewhere a moment ago may not be written yet: a request refused while other
proxies hold places is asked for once more after `RECHECK_S` before its 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cacheproxy.errors import ApiError
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.supervise import repeating
from cacheproxy.tenancy.pool_store import ConcurrencyAsk, PoolStore

log = logging.getLogger(__name__)

RECHECK_S = 0.05  # a refusal while others hold places is checked again after this long


@dataclass
class _Waiter:
    future: asyncio.Future[int | None]  # None: its places; else what the other proxies held
    wanted: int = 1  # places asked for together (a split request's tasks)
    counted: bool = False  # included in the ask under way
    rechecked: bool = False


@dataclass
class _TenantCount:
    cap: int
    running: int = 0  # requests here holding a place
    held: int = 0  # places this proxy holds in the database
    asking: bool = False  # a write of its holding is under way (what it holds may change)
    waiting: deque[_Waiter] = field(default_factory=deque)


class SharedConcurrency:
    """The tenants' requests in progress on this proxy, held in the shared count."""

    def __init__(
        self,
        store: PoolStore,
        proxy_id: str,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.store = store
        self.proxy_id = proxy_id
        self.ttl_s = ttl_s
        self.clock = clock
        self.metrics = metrics
        self.counts: dict[str, _TenantCount] = {}
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        # until when what this proxy holds is renewed in the database (set by the shared
        # limits, whose rounds renew it): past it a spare place may be another proxy's now
        self.renewed_until: Callable[[], float] = lambda: math.inf

    def holds_any(self) -> bool:
        return any(count.held for count in self.counts.values())

    def try_take(self, tenant: str, cap: int, wanted: int = 1) -> bool:
        """Take `wanted` places this proxy holds spare: True; False: ask for them (`take`)."""
        count = self.counts.get(tenant)
        if count is None or count.asking or count.waiting:
            return False
        if min(count.held, cap) - count.running < wanted:
            return False
        if self.clock() >= self.renewed_until():
            return False  # its holding may have expired: asked again
        count.running += wanted
        return True

    async def take(self, tenant: str, cap: int, wanted: int = 1) -> int | None:
        """Places for `wanted` requests (or tasks of one request) of `tenant`, all or none:
        None, or what the other proxies hold when its cap leaves too few."""
        count = self.counts.get(tenant)
        if count is None:
            count = self.counts[tenant] = _TenantCount(cap)
        count.cap = cap
        waiter = _Waiter(asyncio.get_running_loop().create_future(), wanted)
        count.waiting.append(waiter)
        self._ask(tenant)
        try:
            return await asyncio.shield(waiter.future)
        except asyncio.CancelledError:
            if waiter.future.done() and waiter.future.result() is None:
                self.give_back(tenant, wanted)  # granted as the client left
            else:
                waiter.future.cancel()
                with contextlib.suppress(ValueError):
                    count.waiting.remove(waiter)
                self._ask(tenant)
            raise

    def give_back(self, tenant: str, places: int = 1) -> None:
        """A request of `tenant` that held `places` (a split request: its tasks') has ended."""
        count = self.counts.get(tenant)
        if count is None:
            return
        count.running -= places
        self._ask(tenant)

    def _ask(self, tenant: str) -> None:
        self._dirty.add(tenant)
        self._wake.set()

    # -- the writer --------------------------------------------------------------------------

    async def write_once(self) -> None:
        """Wait for a change, then bring every changed tenant's holding to what it runs and
        waits for, in one transaction; hand the places out and refuse what its cap leaves
        none for."""
        await self._wake.wait()
        self._wake.clear()
        tenants, self._dirty = sorted(self._dirty), set()
        asks = []
        for tenant in tenants:
            count = self.counts[tenant]
            count.asking = True
            for waiter in count.waiting:
                waiter.counted = True
            target = count.running + sum(waiter.wanted for waiter in count.waiting)
            asks.append(ConcurrencyAsk(tenant, target, count.running, count.cap))
        now = self.clock()
        try:
            granted = await self.store.aset_concurrency(self.proxy_id, asks, now, now + self.ttl_s)
        except Exception as exc:
            # the requests waiting are answered 503; what this proxy holds is written again
            # with the next change (it may hold more than it runs meanwhile, never less)
            unavailable = ApiError(
                503, f"the shared count could not be read: {exc!r}", headers={"Retry-After": "1"}
            )
            for tenant in tenants:
                count = self.counts[tenant]
                count.asking = False
                for waiter in [w for w in count.waiting if w.counted]:
                    count.waiting.remove(waiter)
                    if not waiter.future.done():
                        waiter.future.set_exception(unavailable)
                self._dirty.add(tenant)
            await asyncio.sleep(RECHECK_S)
            raise
        if self.metrics is not None:
            self.metrics.shared_limit_exchanges.labels("concurrency").inc()
        for ask, answer in zip(asks, granted, strict=True):
            self._hand_out(ask.tenant, answer.held, answer.others)

    def _hand_out(self, tenant: str, held: int, others: int) -> None:
        count = self.counts[tenant]
        count.held, count.asking = held, False
        kept: deque[_Waiter] = deque()
        while count.waiting:
            waiter = count.waiting.popleft()
            if waiter.future.done():
                continue
            if count.running + waiter.wanted <= count.held:
                count.running += waiter.wanted
                waiter.future.set_result(None)
            elif not waiter.counted:
                kept.append(waiter)  # arrived meanwhile: in the next ask
            elif others and not waiter.rechecked:
                # another proxy may have just given its place back, not yet written
                waiter.rechecked, waiter.counted = True, False
                kept.append(waiter)
                asyncio.get_running_loop().call_later(RECHECK_S, self._ask, tenant)
            else:
                waiter.future.set_result(others)
        count.waiting = kept
        if count.held > count.running + sum(waiter.wanted for waiter in kept):
            # a split request refused left places held that nothing here runs: given up
            self._ask(tenant)
        elif not count.running and not count.held and not count.waiting:
            del self.counts[tenant]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SharedConcurrency]:
        """The writer, in a named task, while the proxy runs; at the end every place this
        proxy holds is given up."""
        try:
            async with repeating(
                "shared-concurrency-writer",
                "shared concurrency",
                self.write_once,
                pause_s=0,
                log=log,
                after_failure_s=0,
            ):
                yield self
        finally:
            for count in self.counts.values():
                for waiter in count.waiting:
                    if not waiter.future.done():
                        waiter.future.set_result(0)
            try:
                await self.store.aleave(self.proxy_id)
            except Exception as exc:  # they expire by themselves
                log.warning("shared limits: holdings not given up at stop (%r)", exc)
