"""The scheduler with per-tenant queues: fair order, per-tenant and total bounds, no tenant
blocked behind another's waiter that cannot be served."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from cacheproxy.plugins import load_plugin
from cacheproxy.slots.fair_queue import Share
from cacheproxy.slots.queue_bounds import Overloaded, TenantQueueFull
from cacheproxy.slots.routing import Restorable
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.slots.waiter import WAIT_REASONS
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import Lease, SlotState, Smoothed, TaskOutcome, UpstreamSlots


def scheduler(
    n_slots: int = 1,
    max_queue: int = 64,
    per_tenant: int | None = None,
    fair_share: bool = True,
    max_wait_s: float = 0,
    clock: Callable[[], float] = time.monotonic,
) -> SlotScheduler:
    table = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(n_slots)])
    policy = load_plugin("routing", "exact-prefix", {"max_wait_s": max_wait_s})
    return SlotScheduler(
        [table],
        policy,
        max_queue,
        clock=clock,
        fair_share=fair_share,
        max_queue_per_tenant=per_tenant,
        share_window_s=5.0,
    )


def done() -> TaskOutcome:
    return TaskOutcome(ok=True, cache_n=0, prompt_n=1, prompt_ms=1.0, tokens_cached=1)


async def served_in_order(
    sched: SlotScheduler, held: Lease, waiting: list[asyncio.Future]
) -> list[Lease]:
    """Release the one slot again and again; the leases in the order they were granted."""
    served: list[Lease] = []
    lease = held
    for _ in waiting:
        sched.release(lease, done())
        await asyncio.sleep(0)
        (lease,) = [t.result() for t in waiting if t.done() and t.result() not in served]
        served.append(lease)
    return served


@pytest.mark.parametrize("fair_share", [True, False])
async def test_a_light_tenant_goes_before_a_flooders_backlog(fair_share: bool) -> None:
    sched = scheduler(fair_share=fair_share)
    held = await sched.acquire([1], "heavy")
    waiting = [asyncio.ensure_future(sched.acquire([10 + n], "heavy")) for n in range(5)]
    await asyncio.sleep(0)
    waiting.append(asyncio.ensure_future(sched.acquire([99], "light")))
    await asyncio.sleep(0)
    served = await served_in_order(sched, held, waiting)
    light_turn = [lease.prompt for lease in served].index([99])
    # fair: next, or right after the heavy request whose turn it was; FIFO: after the backlog
    assert light_turn <= 1 if fair_share else light_turn == 5


async def test_weights_share_the_slot_in_proportion() -> None:
    sched = scheduler()
    held = await sched.acquire([1], "x")
    waiting = []
    for n in range(8):
        waiting.append(asyncio.ensure_future(sched.acquire([100 + n], "a", share=Share(3))))
        waiting.append(asyncio.ensure_future(sched.acquire([200 + n], "b", share=Share(1))))
    await asyncio.sleep(0)
    served = await served_in_order(sched, held, waiting)
    first_eight = [lease.prompt[0] // 100 for lease in served[:8]]
    assert first_eight.count(1) == 6 and first_eight.count(2) == 2


async def test_a_tenant_past_its_own_bound_is_refused_and_no_one_else() -> None:
    sched = scheduler(per_tenant=2)
    held = await sched.acquire([1], "heavy")
    queued = [asyncio.ensure_future(sched.acquire([n], "heavy")) for n in (2, 3)]
    await asyncio.sleep(0)
    with pytest.raises(TenantQueueFull) as refused:
        await sched.acquire([4], "heavy")
    assert refused.value.retry_after_s >= 1
    light = asyncio.ensure_future(sched.acquire([5], "light"))
    await asyncio.sleep(0)
    assert not light.done() and sched.queued_for("light") == 1  # waits, not refused
    # the request's own bound wins over the scheduler's
    with pytest.raises(TenantQueueFull):
        await sched.acquire([6], "light", queue_bound=1)
    for task in (*queued, light):
        task.cancel()
    sched.release(held, done())


async def test_a_full_queue_makes_the_longest_tenant_give_way() -> None:
    sched = scheduler(max_queue=3)
    held = await sched.acquire([1], "heavy")
    queued = [asyncio.ensure_future(sched.acquire([n], "heavy")) for n in (2, 3, 4)]
    await asyncio.sleep(0)
    light = asyncio.ensure_future(sched.acquire([5], "light"))
    await asyncio.sleep(0)
    assert not light.done()
    with pytest.raises(TenantQueueFull):  # the heavy tenant's newest gave way
        await asyncio.wait_for(queued[-1], 1)
    assert sched.queued == 3 and sched.queued_for("light") == 1
    # with a queue full of equals nobody gives way: the newcomer gets the 503
    another = asyncio.ensure_future(sched.acquire([6], "other"))
    await asyncio.sleep(0)
    assert not another.done()  # heavy had 2, other 0: heavy's newest gave way again
    with pytest.raises(TenantQueueFull):
        await asyncio.wait_for(queued[1], 1)
    with pytest.raises(Overloaded):
        await sched.acquire([7], "light")
    for task in (queued[0], light, another):
        task.cancel()
    sched.release(held, done())


async def test_the_global_fifo_turns_newcomers_away_when_full() -> None:
    sched = scheduler(max_queue=2, fair_share=False)
    held = await sched.acquire([1], "heavy")
    queued = [asyncio.ensure_future(sched.acquire([n], "heavy")) for n in (2, 3)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await sched.acquire([5], "light")
    for task in queued:
        task.cancel()
    sched.release(held, done())


async def test_a_waiter_held_for_a_busy_slot_does_not_block_other_tenants() -> None:
    sched = scheduler(n_slots=2, max_wait_s=60)
    sched.tables[0].prefill_ms_per_token = Smoothed(10.0)  # a slow prefill: worth a wait
    prompt = list(range(1, 500))
    first = await sched.acquire(prompt, "a")
    sched.release(first, TaskOutcome(ok=True, cache_n=0, tokens_cached=499, generated=[]))
    first = await sched.acquire(prompt, "a")  # back on the slot that holds it
    # a's next request would reuse 499 tokens on the busy slot: it waits for it, up to a minute
    patient = asyncio.ensure_future(sched.acquire([*prompt, 500], "a"))
    await asyncio.sleep(0)
    assert not patient.done()
    other = asyncio.ensure_future(sched.acquire([8], "b"))
    await asyncio.sleep(0)
    lease = await asyncio.wait_for(other, 1)  # served at once on the idle slot
    assert lease.slot.slot_id == 1
    sched.release(first, done())
    assert (await asyncio.wait_for(patient, 1)).slot.slot_id == 0


@pytest.mark.parametrize("fair_share", [True, False])
async def test_a_flooder_leaves_a_slot_to_a_tenant_active_within_the_window(
    fair_share: bool,
) -> None:
    now = [100.0]
    sched = scheduler(n_slots=4, fair_share=fair_share, clock=lambda: now[0])
    sched.release(await sched.acquire([1], "light"), done())  # light was here a moment ago
    sched.tables[0].prefill_ms_per_token = Smoothed(0.0)  # prompts take no time: slots alone
    flood = [asyncio.ensure_future(sched.acquire([10 + n], "heavy")) for n in range(6)]
    await asyncio.sleep(0)
    granted = [task for task in flood if task.done()]
    if not fair_share:  # the FIFO knows no shares: the flooder takes every slot
        assert len(granted) == 4
        return
    assert len(granted) == 3 and sched.queued_for("heavy") == 3  # waiting, not refused
    light = await asyncio.wait_for(sched.acquire([2], "light"), 1)  # the kept slot, at once
    # light holds one of its two: the next slot to free is kept for its next request
    sched.release(granted[0].result(), done())
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 3
    sched.release(light, done())
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 4  # light holds none: heavy may take 3 again
    now[0] += 5.0  # light has been quiet for the window: the flooder is alone
    sched.upstream_changed()
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 5
    assert all(slot.busy for slot in sched.tables[0].slots)
    for task in flood:
        task.cancel()


async def test_the_slot_share_follows_weights_and_a_quiet_tenant_is_forgotten() -> None:
    """Beside a tenant of weight 1 holding a slot, one of weight 3 takes the 3 others (of
    weight 1 it would be kept to 2); once the light one has been quiet for the window, a timer
    lets the heavy one take the slot kept for it, with no release to wake the queue."""
    sched = SlotScheduler(
        [UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(4)])],
        load_plugin("routing", "exact-prefix", {"max_wait_s": 0}),
        64,
        share_window_s=0.2,
    )
    light = await sched.acquire([1], "light")
    sched.tables[0].prefill_ms_per_token = Smoothed(0.0)
    flood = [
        asyncio.ensure_future(sched.acquire([10 + n], "heavy", share=Share(3))) for n in range(5)
    ]
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 3
    sched.release(light, done())
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 3  # its share: the free slot is kept for light
    await asyncio.sleep(0.4)
    assert sum(task.done() for task in flood) == 4
    for task in flood:
        task.cancel()


async def test_a_tenant_at_its_share_computes_one_prompt_at_a_time_beside_others() -> None:
    """While another tenant is active, a tenant at its share starts a request only when none
    of its own, and none of a tenant within its share, is expected to be in its prefill."""
    now = [100.0]
    sched = scheduler(n_slots=4, clock=lambda: now[0])
    sched.release(await sched.acquire([1], "light"), done())
    sched.tables[0].prefill_ms_per_token = Smoothed(1.0)  # 1 ms per token: 100 ms per prompt
    flood = [
        asyncio.ensure_future(sched.acquire(list(range(n * 100, n * 100 + 100)), "heavy"))
        for n in range(1, 5)
    ]
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 2  # within its share (2 of 4): both at once
    now[0] += 0.1  # both prompts computed
    sched.upstream_changed()
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 3  # at its share: one more, one slot kept
    light = await asyncio.wait_for(sched.acquire(list(range(900, 1000)), "light"), 1)
    now[0] += 0.1  # heavy's third prompt computed; light's still under way
    sched.release(flood[0].result(), done())
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 3  # not beside light's prompt
    now[0] += 0.1
    sched.release(light, done())
    await asyncio.sleep(0)
    assert sum(task.done() for task in flood) == 4


async def test_a_split_requests_tasks_take_their_slots_together_within_the_share() -> None:
    """A prompt's tasks (`n` > 1) run side by side: they take their slots at once, each within
    the share, or wait together in their tenant's queue, holding none meanwhile."""
    now = [100.0]
    sched = scheduler(n_slots=2, clock=lambda: now[0])
    sched.release(await sched.acquire([1], "alice"), done())  # alice active: bob's share is 1
    sched.tables[0].prefill_ms_per_token = Smoothed(0.0)
    group = asyncio.ensure_future(sched.acquire_group([5, 6], "bob", 2))
    await asyncio.sleep(0)
    assert not group.done()
    assert not any(slot.busy for slot in sched.tables[0].slots)  # none held while it waits
    alice = await asyncio.wait_for(sched.acquire([2], "alice"), 1)  # no wait for bob's
    sched.release(alice, done())
    now[0] += 5.0  # alice quiet for the window: bob alone may take both
    sched.upstream_changed()
    leases = await asyncio.wait_for(group, 1)
    assert {lease.slot.slot_id for lease in leases} == {0, 1}


async def test_a_split_requests_tasks_within_the_share_start_at_once() -> None:
    now = [100.0]
    sched = scheduler(n_slots=4, clock=lambda: now[0])
    sched.release(await sched.acquire([1], "alice"), done())  # alice active: bob's share is 2
    sched.tables[0].prefill_ms_per_token = Smoothed(0.0)
    leases = await asyncio.wait_for(sched.acquire_group([5, 6], "bob", 2), 1)
    assert len({lease.slot.slot_id for lease in leases}) == 2
    # a third of bob's is beyond its share while alice is about: the last slots stay hers
    third = asyncio.ensure_future(sched.acquire_group([7, 8], "bob", 2))
    await asyncio.sleep(0)
    assert not third.done()
    assert (await asyncio.wait_for(sched.acquire([2], "alice"), 1)).slot.busy
    third.cancel()


async def test_a_waiting_group_is_not_overtaken_by_its_tenants_later_requests() -> None:
    """Slots free one at a time: the group's tenant's later requests must not take each as it
    frees, or the slots the group waits for would never all be idle at once."""
    sched = scheduler(n_slots=2)
    held = await sched.acquire([1], "bob")
    group = asyncio.ensure_future(sched.acquire_group([5, 6], "bob", 2))
    later = asyncio.ensure_future(sched.acquire([7], "bob"))
    await asyncio.sleep(0)
    assert not group.done() and not later.done()  # the idle slot is kept for the group
    sched.release(held, done())
    leases = await asyncio.wait_for(group, 1)
    assert not later.done()
    for lease in leases:
        sched.release(lease, done())
    await asyncio.wait_for(later, 1)


async def test_a_group_left_while_waiting_or_just_served_holds_no_slot() -> None:
    sched = scheduler(n_slots=2)
    held = await sched.acquire([1], "bob")
    group = asyncio.ensure_future(sched.acquire_group([5, 6], "bob", 2))
    await asyncio.sleep(0)
    group.cancel()
    await asyncio.gather(group, return_exceptions=True)
    assert sched.queued == 0
    granted = asyncio.ensure_future(sched.acquire_group([5, 6], "bob", 2))
    await asyncio.sleep(0)
    sched.release(held, done())  # both slots granted to it...
    assert all(slot.busy for slot in sched.tables[0].slots)
    granted.cancel()  # ...and its client gone before it saw them
    await asyncio.gather(granted, return_exceptions=True)
    assert not any(slot.busy for slot in sched.tables[0].slots)


async def test_each_wait_is_told_with_why_the_request_still_waited() -> None:
    """The scheduler tells, as each waiter is served, how long it waited and for what: a busy
    slot it chose (its reuse worth the wait), every slot busy, its tenant at its share."""
    now = [100.0]
    sched = scheduler(n_slots=2, max_wait_s=60, clock=lambda: now[0])
    waits: list[tuple[str, float]] = []
    sched.on_waited = lambda reason, seconds: waits.append((reason, seconds))
    sched.tables[0].prefill_ms_per_token = Smoothed(10.0)  # a slow prefill: worth a wait
    prompt = list(range(1, 500))
    sched.release(await sched.acquire(prompt, "a"), done())
    assert waits == []  # served at once: nothing to tell
    first = await sched.acquire(prompt, "a")
    patient = asyncio.ensure_future(sched.acquire([*prompt, 500], "a"))  # waits for slot 0
    await asyncio.sleep(0)
    other = await sched.acquire([8], "b")  # takes slot 1: both busy now
    late = asyncio.ensure_future(sched.acquire([9], "b"))
    await asyncio.sleep(0)
    now[0] += 2.0
    sched.release(first, done())
    await asyncio.sleep(0)
    assert patient.done() and not late.done()
    assert waits == [("busy_slot_chosen", 2.0)]
    now[0] += 1.0
    sched.release(other, done())
    await asyncio.sleep(0)
    assert late.done()
    assert waits[1] == ("slots_busy", 3.0)
    assert {reason for reason, _ in waits} <= set(WAIT_REASONS)
    for lease in (patient.result(), late.result()):
        sched.release(lease, done())


async def test_a_request_served_as_it_arrives_tells_no_wait() -> None:
    sched = scheduler(n_slots=2)  # the real clock: time passes between arrival and grant
    waits: list[tuple[str, float]] = []
    sched.on_waited = lambda reason, seconds: waits.append((reason, seconds))
    leases = [await sched.acquire([n], "a") for n in (1, 2)]
    assert waits == []
    late = asyncio.ensure_future(sched.acquire([3], "a"))
    await asyncio.sleep(0)
    sched.release(leases[0], done())
    await asyncio.sleep(0)
    assert late.done() and [reason for reason, _ in waits] == ["slots_busy"]
    for lease in (leases[1], late.result()):
        sched.release(lease, done())


async def test_a_wait_within_the_tenants_share_is_told_as_such() -> None:
    now = [100.0]
    sched = scheduler(n_slots=2, clock=lambda: now[0])
    waits: list[tuple[str, float]] = []
    sched.on_waited = lambda reason, seconds: waits.append((reason, seconds))
    sched.tables[0].prefill_ms_per_token = Smoothed(0.0)  # prompts take no time: slots alone
    sched.release(await sched.acquire([1], "light"), done())  # light was here a moment ago
    heavy = await sched.acquire([10], "heavy")  # one of two: its share while light is active
    held = asyncio.ensure_future(sched.acquire([11], "heavy"))
    await asyncio.sleep(0)
    assert not held.done()  # the idle slot is kept for light
    now[0] += 5.0  # light has been quiet for the window: heavy may take it
    sched.upstream_changed()
    await asyncio.sleep(0)
    assert held.done()
    assert waits == [("share", 5.0)]
    for lease in (heavy, held.result()):
        sched.release(lease, done())


async def settled() -> None:
    """Let what is ready run: the lookups, their answers, the leases granted on them."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_wait_for_a_busy_slot_asks_for_the_archive_and_takes_the_idle_slot_it_fills() -> (
    None
):
    """A request that would wait for the busy slot holding its head asks the disk tier, once,
    what its tenant's archive holds: restored into the idle slot, that beats the wait."""
    sched = scheduler(n_slots=2, max_wait_s=60)
    sched.tables[0].prefill_ms_per_token = Smoothed(10.0)  # a slow prefill: worth a wait
    head = list(range(1, 500))
    sched.release(await sched.acquire(head, "a"), done())
    running = await sched.acquire(head, "a")  # slot 0, busy, holding the head
    asked: list[str] = []

    def lookup(found: dict[int, Restorable]) -> Callable[[], Awaitable[dict[int, Restorable]]]:
        async def restorable() -> dict[int, Restorable]:
            asked.append("asked")
            return found

        return restorable

    served_at_once = await sched.acquire([7, 8], "a", restorable=lookup({}))
    assert asked == []  # not asked when the request does not wait
    sched.release(served_at_once, done())
    # no archive: it keeps waiting for slot 0, asked once however often it is planned again
    patient = asyncio.ensure_future(
        sched.acquire([*head, *range(500, 600)], "a", restorable=lookup({}))
    )
    await settled()
    sched.upstream_changed()  # planned again
    await asyncio.sleep(0)
    assert not patient.done() and asked == ["asked"]
    # an archive of 590 tokens, cheap to restore: the idle slot, with slot 0 still busy
    restored = asyncio.ensure_future(
        sched.acquire([*head, *range(600, 700)], "a", restorable=lookup({0: Restorable(590, 5.0)}))
    )
    await settled()
    assert asked == ["asked", "asked"]
    assert restored.done() and restored.result().slot.slot_id == 1
    assert running.slot.busy and not patient.done()
    for lease in (running, restored.result()):
        sched.release(lease, done())
    sched.release(await patient, done())
