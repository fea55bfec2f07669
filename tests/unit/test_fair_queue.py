"""The fair queue (pure): whose waiting request goes next, by weight and class."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from cacheproxy.settings import SchedulingSettings
from cacheproxy.slots.admission import (
    ConcurrencyGate,
    ConcurrencyLimited,
    InvalidPriority,
    RequestLimits,
    TenantLimits,
    limits_for,
)
from cacheproxy.slots.fair_queue import FairQueue, Share, capped_priority
from cacheproxy.tenancy.registry import DEFAULT_TENANT


class Item:
    def __init__(self, tenant: str, n: int, priority: str = "interactive") -> None:
        self.tenant, self.n, self.priority = tenant, n, priority

    def __repr__(self) -> str:
        return f"{self.tenant}{self.n}{self.priority[0]}"


def serve_all(queue: FairQueue[Item], count: int) -> list[Item]:
    """Serve the head of the order `count` times."""
    served = []
    for _ in range(count):
        head = queue.order()[0]
        queue.served(head)
        served.append(head)
    return served


def test_a_flooding_tenant_does_not_delay_a_light_one() -> None:
    queue: FairQueue[Item] = FairQueue()
    for n in range(100):
        queue.push(Item("heavy", n), "heavy", Share())
    serve_all(queue, 10)
    light = Item("light", 0)
    queue.push(light, "light", Share())
    # behind at most the one heavy request whose turn it was when it arrived
    assert queue.order().index(light) <= 1


def test_global_fifo_serves_in_arrival_order() -> None:
    queue: FairQueue[Item] = FairQueue(fair=False)
    items = [Item("heavy", n) for n in range(5)] + [Item("light", 0)]
    for item in items:
        queue.push(item, item.tenant, Share())
    assert queue.order() == items


def test_weights_give_proportional_service() -> None:
    queue: FairQueue[Item] = FairQueue()
    for n in range(300):
        queue.push(Item("a", n), "a", Share(weight=3))
        queue.push(Item("b", n), "b", Share(weight=1))
    counts = Counter(item.tenant for item in serve_all(queue, 200))
    assert counts["a"] == 150 and counts["b"] == 50


def test_interactive_goes_before_the_same_tenants_batch() -> None:
    queue: FairQueue[Item] = FairQueue()
    batch = [Item("a", n, "batch") for n in range(3)]
    for item in batch:
        queue.push(item, "a", Share(priority="batch"))
    urgent = Item("a", 9)
    queue.push(urgent, "a", Share())
    assert queue.order()[0] is urgent


def test_batch_costs_more_of_a_tenants_share() -> None:
    queue: FairQueue[Item] = FairQueue(batch_factor=0.5)
    for n in range(100):
        queue.push(Item("a", n, "batch"), "a", Share(priority="batch"))
        queue.push(Item("b", n), "b", Share())
    counts = Counter(item.tenant for item in serve_all(queue, 60))
    assert counts["b"] == 40 and counts["a"] == 20


def test_a_tenant_that_left_comes_back_without_credit_nor_debt() -> None:
    queue: FairQueue[Item] = FairQueue()
    for n in range(20):
        queue.push(Item("heavy", n), "heavy", Share())
    queue.push(Item("light", 0), "light", Share())
    serve_all(queue, 10)  # light's one request among them
    assert queue.waiting("light") == 0
    # light was idle while heavy was served: it starts at the current virtual time
    again = Item("light", 1)
    queue.push(again, "light", Share())
    assert queue.order().index(again) <= 1


def test_a_passed_over_waiter_keeps_its_turn_and_its_tenant_pays_for_another() -> None:
    queue: FairQueue[Item] = FairQueue()
    a0, a1, b0 = Item("a", 0), Item("a", 1), Item("b", 0)
    for item in (a0, a1, b0):
        queue.push(item, item.tenant, Share())
    # the scheduler could not serve a0 (it waits for a busy slot) and served a1 instead
    queue.served(a1)
    assert queue.order() == [b0, a0]  # a was charged: b goes first, a0 keeps a's next turn


def test_removed_waiters_are_not_charged() -> None:
    queue: FairQueue[Item] = FairQueue()
    a = [Item("a", n) for n in range(3)]
    b0 = Item("b", 0)
    for item in a:
        queue.push(item, "a", Share())
    queue.push(b0, "b", Share())
    queue.remove(a[0])
    queue.remove(a[1])
    assert queue.order()[:2] == [a[2], b0]
    assert len(queue) == 2 and a[0] not in queue


def test_the_newest_of_the_longest_queue_gives_way() -> None:
    queue: FairQueue[Item] = FairQueue()
    items = [Item("a", n) for n in range(3)]
    for item in items:
        queue.push(item, "a", Share())
    queue.push(Item("b", 0), "b", Share())
    assert queue.newest_of_longest() == ("a", items[-1])


def test_a_class_is_capped_by_the_tenants_ceiling() -> None:
    assert capped_priority("interactive", "batch") == "batch"
    assert capped_priority("batch", "interactive") == "batch"
    assert capped_priority("interactive", "interactive") == "interactive"


def test_a_requests_limits_come_from_its_tenant_its_header_and_the_settings() -> None:
    settings = SchedulingSettings(max_queue_per_tenant=9, max_concurrent_per_tenant=5)
    tenant = dataclasses.replace(DEFAULT_TENANT, id="t_1", weight=2.0, max_priority="batch")
    limits = limits_for(tenant, " Interactive ", settings)
    assert limits.share == Share(2.0, "batch", 5)  # asked for more than the tenant may
    assert (limits.max_queued, limits.max_concurrent) == (9, 5)
    own = dataclasses.replace(tenant, max_queued=2, max_concurrent=1, max_priority="interactive")
    limits = limits_for(own, None, settings)
    assert (limits.share.priority, limits.max_queued, limits.max_concurrent) == (
        "interactive",
        2,
        1,
    )
    with pytest.raises(InvalidPriority):
        limits_for(tenant, "urgent", settings)
    # no tenants: the one default tenant is bounded by the whole queue alone
    alone = limits_for(DEFAULT_TENANT, "batch", settings)
    assert alone == TenantLimits(Share(1.0, "batch"), None, None)


def test_request_limits_are_kept_until_the_tenant_changes() -> None:
    settings = SchedulingSettings(max_queue_per_tenant=9)
    request_limits = RequestLimits(settings)
    tenant = dataclasses.replace(DEFAULT_TENANT, id="t_1", weight=2.0)
    first = request_limits.of(tenant, None)
    assert first == limits_for(tenant, None, settings)
    assert request_limits.of(tenant, None) is first  # the same tenant object: kept
    assert request_limits.of(tenant, "batch").share.priority == "batch"  # another header
    # a registry refresh brings a new object: what it may claim now is worked out again
    changed = dataclasses.replace(tenant, weight=3.0, max_queued=4)
    assert request_limits.of(changed, None) == limits_for(changed, None, settings)
    assert request_limits.of(changed, None).share.weight == 3.0
    with pytest.raises(InvalidPriority):
        request_limits.of(tenant, "urgent")


def test_the_concurrency_gate_counts_and_gives_back() -> None:
    gate = ConcurrencyGate()
    with gate.held("a", 2), gate.held("a", 2):
        with pytest.raises(ConcurrencyLimited), gate.held("a", 2):
            pass
        with gate.held("b", 2):
            assert (gate.in_flight("a"), gate.in_flight("b")) == (2, 1)
    assert gate.in_flight("a") == 0
    with gate.held("a", None):
        assert gate.in_flight("a") == 1
