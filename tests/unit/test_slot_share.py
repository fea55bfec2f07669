"""The slot share (pure): weighted max-min shares, the reserve for other active tenants, and
random traces of a slot pool served through it: work conserving, no tenant starved, the share
held while others are active, everything to a tenant alone."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from cacheproxy.slots.fair_queue import FairQueue, Share
from cacheproxy.slots.slot_share import TenantSlots, fair_shares, may_take


def test_shares_follow_weights_and_what_a_capped_tenant_cannot_use_goes_to_the_others() -> None:
    assert fair_shares({"a": TenantSlots(1), "b": TenantSlots(1)}, 4) == {"a": 2, "b": 2}
    assert fair_shares({"a": TenantSlots(3), "b": TenantSlots(1)}, 4) == {"a": 3, "b": 1}
    capped = {"a": TenantSlots(3, max_concurrent=1), "b": TenantSlots(1), "c": TenantSlots(1)}
    assert fair_shares(capped, 5) == {"a": 1, "b": 2, "c": 2}


def test_a_flooder_leaves_a_slot_for_an_active_tenant_below_its_share() -> None:
    light_idle = {"heavy": TenantSlots(holding=2), "light": TenantSlots(holding=0)}
    assert may_take("heavy", light_idle, idle=2, total=4)  # a third slot: one is left for light
    light_idle = {"heavy": TenantSlots(holding=3), "light": TenantSlots(holding=0)}
    assert not may_take("heavy", light_idle, idle=1, total=4)  # never the last one
    assert may_take("light", light_idle, idle=1, total=4)
    light_at_share = {"heavy": TenantSlots(holding=1), "light": TenantSlots(holding=2)}
    assert may_take(
        "heavy", light_at_share, idle=1, total=4
    )  # nobody below its share to keep it for
    # whoever is at its share is held the same way
    heavy_below = {"heavy": TenantSlots(holding=1), "light": TenantSlots(holding=2)}
    assert not may_take("light", heavy_below, idle=1, total=4)


def test_beside_others_a_tenant_at_its_share_computes_one_prompt_at_a_time() -> None:
    light_prefilling = {
        "heavy": TenantSlots(holding=2),
        "light": TenantSlots(holding=1, prefilling=1),
    }
    assert not may_take("heavy", light_prefilling, idle=1, total=4)
    assert may_take("light", light_prefilling, idle=1, total=4)  # within its share
    own_prefill = {"heavy": TenantSlots(holding=2, prefilling=1), "light": TenantSlots()}
    assert not may_take("heavy", own_prefill, idle=2, total=4)
    assert may_take("heavy", {"heavy": TenantSlots(holding=2), "light": TenantSlots()}, 2, 4)
    below_share = {
        "heavy": TenantSlots(holding=1, prefilling=1),
        "light": TenantSlots(prefilling=0),
    }
    assert may_take("heavy", below_share, idle=3, total=4)
    alone = {"heavy": TenantSlots(holding=3, prefilling=3)}
    assert may_take("heavy", alone, idle=1, total=4)  # alone: nothing to protect


def test_alone_a_tenant_takes_every_slot() -> None:
    rng = random.Random(1)
    for _ in range(500):
        total = rng.randint(1, 16)
        idle = rng.randint(0, total)
        alone = {"t": TenantSlots(rng.uniform(0.1, 5), total - idle, rng.choice([None, 1, 3]))}
        assert may_take("t", alone, idle, total) == (idle > 0)


def test_random_shares_are_max_min_fair() -> None:
    rng = random.Random(2)
    for _ in range(500):
        total = rng.randint(1, 32)
        tenants = {
            f"t{i}": TenantSlots(rng.choice([0.5, 1, 2, 3]), 0, rng.choice([None, None, 1, 2, 5]))
            for i in range(rng.randint(1, 6))
        }
        shares = fair_shares(tenants, total)
        caps = [
            t.max_concurrent if t.max_concurrent is not None else total for t in tenants.values()
        ]
        assert sum(shares.values()) == pytest.approx(min(total, sum(caps)))
        for name, tenant in tenants.items():
            if tenant.max_concurrent is not None:
                assert shares[name] <= tenant.max_concurrent + 1e-9
        # max-min: a tenant below its cap has at least the weighted share of any other
        uncapped = [
            n
            for n, t in tenants.items()
            if t.max_concurrent is None or shares[n] < t.max_concurrent - 1e-9
        ]
        for name in uncapped:
            for other in tenants:
                per_weight = shares[other] / tenants[other].weight
                assert shares[name] / tenants[name].weight >= per_weight - 1e-9


# -- random traces: a pool of slots served in fair-queue order through the share ---------------


MAX_QUEUED = 8


@dataclass
class Pool:
    """A slot pool served as the scheduler serves it: the fair queue's order, each waiter
    taking an idle slot only within its tenant's share. Requests hold a slot for a duration."""

    slots: int
    weights: dict[str, float]
    window: float
    caps: dict[str, int | None] = field(default_factory=dict)
    now: float = 0.0
    queue: FairQueue[tuple[str, float, int]] = field(default_factory=FairQueue)
    holding: Counter[str] = field(default_factory=Counter)
    last_active: dict[str, float] = field(default_factory=dict)
    running: list[tuple[float, int, str]] = field(default_factory=list)  # (end, seq, tenant)
    grants: Counter[str] = field(default_factory=Counter)
    peak: Counter[str] = field(default_factory=Counter)  # the most slots each held at once
    busy_time: Counter[str] = field(default_factory=Counter)
    seq: int = 0
    checks: list[str] = field(default_factory=list)  # violations, described

    def active(self) -> dict[str, TenantSlots]:
        waiting = self.queue.tenants()
        return {
            tenant: TenantSlots(self.weights[tenant], self.holding[tenant], self.caps.get(tenant))
            for tenant in self.weights
            if self.holding[tenant]
            or tenant in waiting
            or self.now - self.last_active.get(tenant, -1e9) < self.window
        }

    def arrive(self, tenant: str, duration: float) -> None:
        self.last_active[tenant] = self.now
        if self.queue.waiting(tenant) >= MAX_QUEUED:
            return  # refused (429), as the scheduler bounds a tenant's queue
        self.seq += 1
        self.queue.push((tenant, duration, self.seq), tenant, Share(self.weights[tenant]))
        self.dispatch()

    def finish_until(self, time: float) -> None:
        while self.running and self.running[0][0] <= time:
            end, _, tenant = heapq.heappop(self.running)
            self.now = end
            self.holding[tenant] -= 1
            self.last_active[tenant] = end
            self.dispatch()
        self.now = time
        self.dispatch()  # tenants leave the window as time passes

    def drain(self) -> None:
        """Time passes until every request has been served."""
        while self.running or len(self.queue):
            self.finish_until(self.running[0][0] if self.running else self.now + self.window)

    def dispatch(self) -> None:
        granted = True
        while granted:
            granted = False
            for item in self.queue.order():
                tenant, duration, seq = item
                idle = self.slots - sum(self.holding.values())
                active = self.active()
                if not may_take(tenant, active, idle, self.slots):
                    continue
                self.check_grant(tenant, active, idle)
                self.queue.served(item)
                self.holding[tenant] += 1
                self.peak[tenant] = max(self.peak[tenant], self.holding[tenant])
                self.grants[tenant] += 1
                self.busy_time[tenant] += duration
                heapq.heappush(self.running, (self.now + duration, seq, tenant))
                granted = True
                break
        self.check_idle()

    def check_grant(self, tenant: str, active: dict[str, TenantSlots], idle: int) -> None:
        """A tenant at or above its share never takes a slot another active tenant below its
        share would need."""
        shares = fair_shares(active, self.slots)
        if len(active) > 1 and active[tenant].holding >= shares[tenant]:
            below = [t for t in active if t != tenant and active[t].holding < shares[t]]
            if idle - 1 < len(below):
                self.checks.append(f"{tenant} took a slot reserved for {below} at {self.now}")

    def check_idle(self) -> None:
        """Work conservation: a slot stays idle while a request waits only as the reserve of an
        active tenant that is below its share and has nothing waiting."""
        idle = self.slots - sum(self.holding.values())
        if not idle or not len(self.queue):
            return
        active = self.active()
        shares = fair_shares(active, self.slots)
        waiting = self.queue.tenants()
        reserve = [t for t in active if t not in waiting and active[t].holding < shares[t]]
        if idle > len(reserve):
            self.checks.append(f"{idle} idle, {len(self.queue)} waiting, reserve {reserve}")


def run_trace(pool: Pool, rates: dict[str, float], duration: float, rng: random.Random) -> Pool:
    """Poisson arrivals per tenant with exponential service times, for `duration`."""
    arrivals = [(rng.expovariate(rate), tenant) for tenant, rate in rates.items() if rate]
    heapq.heapify(arrivals)
    while arrivals and arrivals[0][0] < duration:
        at, tenant = heapq.heappop(arrivals)
        pool.finish_until(at)
        pool.arrive(tenant, rng.expovariate(1.0))
        heapq.heappush(arrivals, (at + rng.expovariate(rates[tenant]), tenant))
    pool.drain()
    return pool


@pytest.mark.parametrize("seed", range(12))
def test_random_traces_keep_the_share_and_conserve_work(seed: int) -> None:
    rng = random.Random(seed)
    slots = rng.randint(1, 8)
    tenants = [f"t{i}" for i in range(rng.randint(2, 5))]
    weights = {tenant: rng.choice([1.0, 1.0, 2.0, 3.0]) for tenant in tenants}
    caps = {tenant: rng.choice([None, None, None, 1, 2]) for tenant in tenants}
    # one floods at twice the pool's capacity, the others send a little, in bursts
    rates = {tenant: rng.uniform(0.05, 0.5) for tenant in tenants}
    rates[tenants[0]] = 2.0 * slots
    pool = run_trace(Pool(slots, weights, rng.uniform(0.5, 5), caps), rates, 200.0, rng)
    assert pool.checks == []
    assert not len(pool.queue) and not pool.running  # everyone was served in the end


@pytest.mark.parametrize("seed", range(6))
def test_backlogged_tenants_each_get_their_weighted_share(seed: int) -> None:
    """No tenant starved: with every tenant flooding, each holds slots in proportion to its
    weight (time-averaged), whatever its arrival order."""
    rng = random.Random(100 + seed)
    slots = rng.randint(2, 8)
    weights = {f"t{i}": rng.choice([1.0, 2.0, 3.0]) for i in range(rng.randint(2, 4))}
    rates = {tenant: 3.0 * slots for tenant in weights}
    pool = run_trace(Pool(slots, weights, window=2.0), rates, 100.0, rng)
    assert pool.checks == []
    total_weight = sum(weights.values())
    busy = sum(pool.busy_time.values())
    for tenant, weight in weights.items():
        # whole slots cannot be split exactly by weight: at least half its share, never none
        assert pool.busy_time[tenant] / busy >= 0.5 * weight / total_weight, pool.busy_time


@pytest.mark.parametrize("seed", range(6))
def test_a_tenant_alone_fills_every_slot(seed: int) -> None:
    rng = random.Random(200 + seed)
    slots = rng.randint(1, 8)
    pool = run_trace(Pool(slots, {"only": 1.0}, window=5.0), {"only": 3.0 * slots}, 50.0, rng)
    assert pool.peak["only"] == slots
    assert pool.checks == []  # no slot idle while it had a request waiting


def test_a_tenant_that_left_the_window_no_longer_holds_a_slot_back() -> None:
    pool = Pool(4, {"heavy": 1.0, "light": 1.0}, window=5.0)
    pool.arrive("light", 1.0)
    pool.finish_until(1.0)  # light's request ended at 1.0: active until 6.0
    for _ in range(6):
        pool.arrive("heavy", 100.0)
    assert pool.holding["heavy"] == 3  # one slot kept for light
    pool.finish_until(6.5)
    assert pool.holding["heavy"] == 4  # light left the window: the flooder takes the last slot
