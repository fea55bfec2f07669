"""The lease keeper: a named background task that renews this proxy's leases every renewal
period, takes free ones up to its share, gives up one above it, and sets `Upstream.held`, the
one flag the rest of the proxy reads (the monitor routes nothing to an upstream not held).

A lease is believed only until it would expire: a round that fails or takes longer than a
renewal period (the database locked, a stalled disk) leaves the upstreams held while their
leases last, then lets them go before another proxy may take them. Clocks of the proxies'
hosts must agree to well within the renewal period (NTP), since expiries are wall-clock times
written by one proxy and read by the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from cacheproxy.cluster.leases import LeaseRow, LeaseStore
from cacheproxy.cluster.plan import RoundPlan, plan_round
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.supervise import repeat
from cacheproxy.upstreams.pool import Upstream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    """A live proxy that holds at least one upstream: a possible owner of a conversation."""

    proxy_id: str
    address: str
    upstreams: int = 1  # how many it holds: its weight in the hand-off's hashing


class LeaseKeeper:
    def __init__(
        self,
        store: LeaseStore,
        upstreams: list[Upstream],
        proxy_id: str,
        address: str,
        ttl_s: float,
        renewal_s: float,
        clock: Callable[[], float] = time.time,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.store = store
        self.upstreams = {upstream.base_url: upstream for upstream in upstreams}
        self.proxy_id = proxy_id
        self.address = address
        self.ttl_s = ttl_s
        self.renewal_s = renewal_s
        self.clock = clock
        self.metrics = metrics
        # who else serves: the hand-off's candidates, refreshed every round
        self.peers: list[Peer] = []
        self.releasing: set[str] = set()
        self._valid_until: dict[str, float] = {}
        # set by the cache layer: whether nothing of ours runs on an upstream, and a nudge to
        # the monitor when an upstream is taken or given up (it rebuilds or drops the table)
        self.is_idle: Callable[[Upstream], bool] = lambda upstream: upstream.in_flight == 0
        self.on_change: Callable[[], None] = lambda: None
        self._task: asyncio.Task[None] | None = None
        for upstream in upstreams:
            upstream.held = False

    @property
    def held(self) -> list[str]:
        return [url for url, upstream in self.upstreams.items() if upstream.held]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LeaseKeeper]:
        """A first round before the proxy starts (so it inspects only what it holds), the
        renewals while it runs, and its leases given up when it stops."""
        await self.round()
        self._task = asyncio.create_task(self._renew_forever(), name="cluster-lease-keeper")
        try:
            yield self
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self._leave()

    async def _renew_forever(self) -> None:
        async def one_round() -> None:
            await asyncio.sleep(self.renewal_s)
            try:
                # a round held up (the database locked, a stalled disk) counts as failed
                await asyncio.wait_for(self.round(), timeout=self.renewal_s)
            finally:
                self._expire_unrenewed(self.clock())

        await repeat("cluster lease keeper", one_round, pause_s=0, log=log, after_failure_s=0)

    async def round(self) -> None:
        now = self.clock()
        idle = {url for url, upstream in self.upstreams.items() if self.is_idle(upstream)}
        round_statements = functools.partial(self._round_statements, now, idle)
        plan, kept, members, leases = await self.store.in_transaction(round_statements)
        self._apply(plan, kept, now)
        self._remember_peers(members, leases, now)

    def _round_statements(
        self, now: float, idle: set[str]
    ) -> tuple[RoundPlan, set[str], dict[str, str], list[LeaseRow]]:
        """A round as the store runs it: in one write transaction, on its worker thread."""
        expires = now + self.ttl_s
        self.store.heartbeat(self.proxy_id, self.address, expires)
        members = self.store.live_members(now)
        leases = self.store.leases()
        plan = plan_round(
            self.proxy_id,
            now,
            list(self.upstreams),
            set(members),
            leases,
            self.releasing,
            idle,
        )
        for upstream in plan.release:
            self.store.release(upstream, self.proxy_id)
        kept = {
            upstream
            for upstream in plan.renew + plan.claim
            if self.store.claim(upstream, self.proxy_id, self.address, now, expires)
        }
        return plan, kept, members, self.store.leases()

    def _apply(self, plan: RoundPlan, kept: set[str], now: float) -> None:
        changed = False
        self.releasing -= set(plan.release)
        if plan.start_releasing is not None:
            self.releasing.add(plan.start_releasing)
            log.info("cluster: giving up %s to a proxy below its share", plan.start_releasing)
        for url, upstream in self.upstreams.items():
            if url in kept:
                self._valid_until[url] = now + self.ttl_s
            else:
                self._valid_until.pop(url, None)
            place_here = url in kept and url not in self.releasing
            if place_here != upstream.held:
                changed = True
                upstream.held = place_here
                log.info("cluster: %s %s", "holding" if place_here else "not holding", url)
        if changed:
            self._publish()
            self.on_change()

    def _publish(self) -> None:
        if self.metrics is not None:
            for url, upstream in self.upstreams.items():
                self.metrics.upstream_held.labels(url).set(1 if upstream.held else 0)

    def _expire_unrenewed(self, now: float) -> None:
        """After every round: stop placing on upstreams whose lease may lapse before the next
        round ends (another proxy may take them when it does). Rounds end at most two renewal
        periods apart (a pause, then a round bounded by one period)."""
        changed = False
        for url, upstream in self.upstreams.items():
            if upstream.held and self._valid_until.get(url, 0.0) - 2 * self.renewal_s <= now:
                upstream.held = False
                changed = True
                log.warning("cluster: lease on %s not renewed in time; not holding it", url)
        if changed:
            self._publish()
            self.on_change()

    def _remember_peers(self, members: dict[str, str], leases: list[LeaseRow], now: float) -> None:
        held = Counter(lease.holder for lease in leases if lease.live(now))
        self.peers = sorted(
            (
                Peer(member, address, held[member])
                for member, address in members.items()
                if held[member]
            ),
            key=lambda peer: peer.proxy_id,
        )

    async def _leave(self) -> None:
        """Stopping: give every lease up at once, so another proxy need not wait for them to
        expire."""
        for upstream in self.upstreams.values():
            upstream.held = False
        try:
            await self.store.in_transaction(self._leave_statements)
        except Exception as exc:  # the leases then expire by themselves
            log.warning(
                "cluster: leases not given up at stop (%r); they expire in %ss", exc, self.ttl_s
            )

    def _leave_statements(self) -> None:
        for url in self.upstreams:
            self.store.release(url, self.proxy_id)
        self.store.leave(self.proxy_id)
