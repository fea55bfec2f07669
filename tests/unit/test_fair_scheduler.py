"""The scheduler with per-tenant queues: fair order, per-tenant and total bounds, no tenant
blocked behind another's waiter that cannot be served."""

from __future__ import annotations

import asyncio

import pytest

from cacheproxy.plugins import load_plugin
from cacheproxy.slots.fair_queue import Share
from cacheproxy.slots.scheduler import Lease, Overloaded, SlotScheduler, TenantQueueFull
from cacheproxy.slots.table import SlotState, Smoothed, TaskOutcome, UpstreamSlots
from cacheproxy.upstreams.pool import Upstream


def scheduler(
    n_slots: int = 1,
    max_queue: int = 64,
    per_tenant: int | None = None,
    fair_share: bool = True,
    max_wait_s: float = 0,
) -> SlotScheduler:
    table = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(n_slots)])
    policy = load_plugin("routing", "exact-prefix", {"max_wait_s": max_wait_s})
    return SlotScheduler(
        [table], policy, max_queue, fair_share=fair_share, max_queue_per_tenant=per_tenant
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
