"""The scheduler: one request per slot, FIFO waiting, a bounded queue, nothing leaked."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from cacheproxy_plugins.prompt_cache_llama_server import LlamaServerPromptCache

from cacheproxy.plugins import load_plugin
from cacheproxy.prompt_cache import PromptCacheDeps
from cacheproxy.slots.queue_bounds import Overloaded
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.ram_shadow import RamCacheShadow, ShadowSlot
from cacheproxy.upstreams.slot_table import (
    ReuseBounds,
    SlotState,
    Smoothed,
    TaskOutcome,
    UpstreamSlots,
)


def scheduler(n_slots: int = 2, max_queue: int = 8) -> SlotScheduler:
    table = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(n_slots)])
    policy = load_plugin("routing", "exact-prefix", {"max_wait_s": 0})
    return SlotScheduler([table], policy, max_queue)


def two_slots() -> UpstreamSlots:
    return UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(2)])


def done(tokens_cached: int, generated: list[int], cache_n: int = 0) -> TaskOutcome:
    return TaskOutcome(
        ok=True,
        cache_n=cache_n,
        prompt_n=1,
        prompt_ms=1.0,
        tokens_cached=tokens_cached,
        generated=generated,
    )


async def test_a_leased_slot_is_not_leased_again_until_released() -> None:
    sched = scheduler(n_slots=2)
    first = await sched.acquire([1, 2, 3], "t")
    second = await sched.acquire([1, 2, 3], "t")
    assert first.slot is not second.slot
    third = asyncio.ensure_future(sched.acquire([1, 2, 3], "t"))
    await asyncio.sleep(0)
    assert not third.done() and sched.queued == 1
    sched.release(first, done(4, [9, 9]))
    lease = await asyncio.wait_for(third, 1)
    assert lease.slot is first.slot  # it holds [1, 2, 3, 9]: the most reuse
    assert lease.predicted.low == 2  # [1, 2, 3] is wholly cached: n - 1


async def test_a_lease_the_disk_tier_left_as_it_was_is_kept() -> None:
    sched = scheduler(n_slots=1)
    lease = await sched.acquire([1, 2, 3], "t")
    assert sched.prepared(lease, ReuseBounds(0, 0), lease.isolate) is lease
    restored = sched.prepared(lease, ReuseBounds(2, 2), lease.isolate)
    assert restored is not lease and restored.predicted == ReuseBounds(2, 2)
    assert (restored.slot, restored.prompt) == (lease.slot, lease.prompt)
    emptied = sched.prepared(lease, ReuseBounds(0, 0), isolate=True)
    assert emptied.isolate and emptied.predicted == lease.predicted


async def test_waiters_are_served_in_arrival_order() -> None:
    sched = scheduler(n_slots=1)
    held = await sched.acquire([1], "t")
    waiting = [asyncio.ensure_future(sched.acquire([n], "t")) for n in (10, 20, 30)]
    await asyncio.sleep(0)
    served = []
    lease = held
    for _ in waiting:
        sched.release(lease, done(1, []))
        await asyncio.sleep(0)
        (lease,) = [
            task.result() for task in waiting if task.done() and task.result() not in served
        ]
        served.append(lease)
    assert [lease.prompt for lease in served] == [[10], [20], [30]]


async def test_a_full_queue_is_refused() -> None:
    sched = scheduler(n_slots=1, max_queue=1)
    await sched.acquire([1], "t")
    queued = asyncio.ensure_future(sched.acquire([2], "t"))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await sched.acquire([3], "t")
    queued.cancel()


async def test_a_client_that_leaves_the_queue_leaves_no_trace() -> None:
    sched = scheduler(n_slots=1)
    held = await sched.acquire([1], "t")
    leaving = asyncio.ensure_future(sched.acquire([2], "t"))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.sleep(0)
    assert sched.queued == 0
    sched.release(held, done(1, []))
    again = await asyncio.wait_for(sched.acquire([3], "t"), 1)
    assert again.slot is held.slot


async def test_release_records_what_the_slot_holds_and_judges_the_prediction() -> None:
    sched = scheduler(n_slots=1)
    lease = await sched.acquire([1, 2, 3], "t")
    verdict = sched.release(lease, done(4, [7, 8], cache_n=0))
    assert verdict.matched
    assert lease.slot.known == [1, 2, 3, 7]
    lease = await sched.acquire([1, 2, 3, 7, 5], "t")
    assert lease.predicted.low == 4
    assert not sched.release(lease, done(5, [6], cache_n=1)).matched


async def test_another_tenant_is_never_predicted_reuse() -> None:
    sched = scheduler(n_slots=1)
    lease = await sched.acquire([1, 2, 3], "a")
    sched.release(lease, done(3, [4]))
    other = await sched.acquire([1, 2, 3, 4, 5], "b")
    assert other.predicted.high == 0
    assert other.isolate  # the server must be told not to reuse a's tokens


async def test_a_public_prefix_is_shared_only_as_far_as_it_goes() -> None:
    sched = scheduler(n_slots=1)
    lease = await sched.acquire([1, 2, 3, 9, 9], "a")
    sched.release(lease, done(5, [8]))
    # b's prompt shares 3 tokens with a's slot, all inside a 3-token public prefix
    shared = await sched.acquire([1, 2, 3, 4], "b", public_prefix_length=3)
    assert (shared.predicted.low, shared.predicted.high, shared.isolate) == (3, 3, False)
    sched.release(shared, done(4, [7]))
    # c's prompt shares 4 tokens with b's slot: one past the public prefix, so nothing at all
    beyond = await sched.acquire([1, 2, 3, 4, 5], "c", public_prefix_length=3)
    assert (beyond.predicted.high, beyond.isolate) == (0, True)


async def test_slots_of_unknown_origin_belong_to_the_single_user_only() -> None:
    sched = scheduler(n_slots=1)
    sched.tables[0].slots[0].hold([1, 2, 3])  # found holding this at start-up
    assert (await sched.acquire([1, 2, 3, 4], "t")).isolate
    sched = scheduler(n_slots=1)
    sched.tables[0].slots[0].hold([1, 2, 3])
    lease = await sched.acquire([1, 2, 3, 4], "default")
    assert (lease.predicted.low, lease.isolate) == (3, False)


async def test_a_whole_upstream_waits_for_every_slot_and_blocks_later_requests() -> None:
    sched = scheduler(n_slots=2)
    held = await sched.acquire([1], "t")
    whole = asyncio.ensure_future(sched.acquire_upstream("t"))
    later = asyncio.ensure_future(sched.acquire([2], "t"))
    await asyncio.sleep(0)
    assert (
        not whole.done() and not later.done()
    )  # slot 1 is free, but the whole upstream waits first
    sched.release(held, done(1, []))
    lease = await asyncio.wait_for(whole, 1)
    assert all(slot.busy for slot in lease.table.slots)
    before = [{"id": 0, "n_ctx": 4096}, {"id": 1, "n_ctx": 4096}]
    after = [{"id": 0, "n_ctx": 4096, "id_task": 9, "n_prompt_tokens": 7}, before[1]]
    sched.release_upstream(lease, before, after)
    assert lease.table.slots[0].tenant == "t"  # the request wrote it
    assert (await asyncio.wait_for(later, 1)).slot.slot_id == 1  # slot 0 holds 7 unknown tokens


def slot_report(id_task: int | None, n_prompt_tokens: int) -> dict:
    entry = {"id": 0, "n_ctx": 4096, "is_processing": False}
    if id_task is not None:
        entry |= {"id_task": id_task, "n_prompt_tokens": n_prompt_tokens}
    return entry


async def test_a_whole_upstream_relabels_only_the_slots_it_wrote() -> None:
    sched = scheduler(n_slots=3)
    slots = sched.tables[0].slots
    slots[0].hold([1, 2, 3])  # alice's, left alone by bob's request
    slots[1].hold([4, 5, 6])  # alice's, overwritten by bob's request
    slots[0].tenant = slots[1].tenant = "alice"
    lease = await sched.acquire_upstream("bob")
    assert not lease.clean and [f.slot.slot_id for f in lease.foreign] == [0, 1]
    before = [slot_report(1, 3), slot_report(2, 3), slot_report(None, 0)]
    after = [slot_report(1, 3), slot_report(5, 9), slot_report(None, 0)]
    for entries in (before, after):
        for slot_id, entry in enumerate(entries):
            entry["id"] = slot_id
    sched.release_upstream(lease, before, after)
    assert (slots[0].tenant, slots[0].known) == ("alice", [1, 2, 3])
    assert (slots[1].tenant, slots[1].known, slots[1].n_tokens) == ("bob", [], 9)
    assert (slots[2].tenant, slots[2].empty) == (None, True)
    assert not any(slot.busy for slot in slots)


async def test_a_whole_upstream_not_told_apart_leaves_its_slots_nobodys() -> None:
    sched = scheduler(n_slots=2)
    sched.tables[0].slots[0].hold([1, 2, 3])
    sched.tables[0].slots[0].tenant = "alice"
    lease = await sched.acquire_upstream("bob")
    sched.release_upstream(lease, None, None)  # /slots did not answer
    for slot in sched.tables[0].slots:
        assert (slot.tenant, slot.n_tokens, slot.busy) == (None, None, False)


async def test_a_whole_upstream_prefers_one_holding_nobody_elses_text() -> None:
    tables = [
        UpstreamSlots(i, Upstream(f"http://u{i}"), [SlotState(0, 4096), SlotState(1, 4096)])
        for i in range(2)
    ]
    tables[0].slots[0].hold([1, 2])
    tables[0].slots[0].tenant = "alice"
    tables[1].slots[0].hold([3, 4])
    tables[1].slots[0].tenant = "bob"
    policy = load_plugin("routing", "exact-prefix", {"max_wait_s": 0})
    sched = SlotScheduler(tables, policy, 8)
    lease = await sched.acquire_upstream("bob")
    assert lease.table is tables[1] and lease.clean and lease.foreign == ()


async def test_a_whole_upstream_cancelled_as_it_is_served_is_given_back() -> None:
    sched = scheduler(n_slots=2)
    held = await sched.acquire([1, 2, 3], "t")
    waiting = asyncio.ensure_future(sched.acquire_upstream("t"))
    await asyncio.sleep(0)
    sched.release(held, done(3, []))  # served now: the future holds the lease
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    slots = sched.tables[0].slots
    assert not any(slot.busy for slot in slots)
    assert held.slot.known == [1, 2, 3]  # nothing was sent: it holds what it held


async def test_a_slot_leased_to_another_tenant_and_abandoned_unsent_is_nobodys() -> None:
    sched = scheduler(n_slots=1)
    alice = await sched.acquire([1, 2, 3], "alice")
    waiting = asyncio.ensure_future(sched.acquire([7, 8, 9], "bob"))
    await asyncio.sleep(0)
    sched.release(alice, done(3, []))  # served now: bob's lease, isolated from alice's text
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    slot = sched.tables[0].slots[0]
    # nothing was sent: it still holds alice's text, which must not pass as bob's
    assert not slot.busy and slot.tenant is None
    again = await sched.acquire([1, 2, 3, 4], "bob")
    assert again.isolate


async def test_an_opaque_lease_records_unnamed_tokens_of_its_tenant() -> None:
    sched = scheduler(n_slots=2)
    lease = await sched.acquire_opaque("alice")
    assert lease.opaque and lease.prompt == []
    sched.release(lease, done(21, [7, 8, 9]))
    assert (lease.slot.tenant, lease.slot.known, lease.slot.n_tokens) == ("alice", [], 21)
    again = await sched.acquire_opaque("alice")  # its own unnamed text may be reused
    assert again.predicted == ReuseBounds(0, 4096) and not again.isolate


async def test_the_disk_tiers_decision_goes_through_the_scheduler() -> None:
    """A lease cannot be changed by its holder; the scheduler hands back a new one, and the
    request is judged against what the disk tier decided."""
    sched = scheduler(n_slots=1)
    lease = await sched.acquire([1, 2, 3, 4], "t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.predicted = ReuseBounds(3, 3)  # type: ignore[misc]
    restored = sched.prepared(lease, ReuseBounds(3, 3), isolate=False)
    assert (restored.predicted, restored.isolate, restored.slot) == (
        ReuseBounds(3, 3),
        False,
        lease.slot,
    )
    assert sched.release(restored, done(5, [9], cache_n=3)).matched


async def test_an_opaque_prompt_goes_back_to_its_tenants_slot_of_the_same_start() -> None:
    sched = scheduler(n_slots=3)
    first = await sched.acquire_opaque("alice", "infill:file-a")
    sched.release(first, done(400, []))
    other = await sched.acquire_opaque("alice", "infill:file-b")
    sched.release(other, done(20, []))
    again = await sched.acquire_opaque("alice", "infill:file-a")
    assert again.slot is first.slot  # not the empty slot, the cheapest to overwrite
    sched.release(again, done(410, []))
    stranger = await sched.acquire_opaque("bob", "infill:file-a")
    assert stranger.slot is not first.slot and not stranger.isolate  # the empty one


async def test_a_failed_request_leaves_its_slot_nobodys() -> None:
    """Bob's request failed on alice's slot: the server may not have touched it, so it must not
    become bob's (his next request would reuse alice's text)."""
    sched = scheduler(n_slots=1)
    alice = await sched.acquire([1, 2, 3], "alice")
    sched.release(alice, done(3, []))
    for acquire in (sched.acquire([1, 2, 3, 4], "bob"), sched.acquire_opaque("bob")):
        failed = await acquire
        sched.release(failed, TaskOutcome(ok=False))
        assert (failed.slot.tenant, failed.slot.n_tokens) == (None, None)
        again = await sched.acquire([1, 2, 3, 5], "bob")
        assert again.isolate and again.predicted == ReuseBounds(0, 0)
        sched.release(again, TaskOutcome(ok=False))


async def test_a_prepared_lease_keeps_every_other_field() -> None:
    sched = scheduler(n_slots=1)
    lease = await sched.acquire([1, 2, 3], "t")
    prepared = sched.prepared(lease, ReuseBounds(1, 2), isolate=True)
    assert prepared == dataclasses.replace(lease, predicted=ReuseBounds(1, 2), isolate=True)


def answered(prompt_n: int, prompt_ms: float, tokens_cached: int) -> TaskOutcome:
    return TaskOutcome(
        ok=True,
        cache_n=tokens_cached - prompt_n,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        tokens_cached=tokens_cached,
        generated=[],
    )


async def test_a_prompt_of_a_few_tokens_does_not_measure_the_prefill_rate() -> None:
    # A prompt of one uncached token takes the server one whole step, whatever the rate: as
    # ms per token that is the step's fixed time, many times the rate of a real prompt.
    sched = scheduler(n_slots=1)
    table = sched.tables[0]
    for _ in range(10):
        lease = await sched.acquire(list(range(8)), "t")
        sched.release(lease, answered(prompt_n=1, prompt_ms=30.0, tokens_cached=8))
    assert table.prefill_ms_per_token.value == pytest.approx(0.1)  # still the default
    lease = await sched.acquire(list(range(512)), "t")
    sched.release(lease, answered(prompt_n=512, prompt_ms=256.0, tokens_cached=512))
    assert table.prefill_ms_per_token.value == pytest.approx(0.1 + 0.2 * (0.5 - 0.1))


async def test_short_prompts_take_idle_slots_rather_than_wait_for_the_one_holding_them() -> None:
    # Identical short prompts, several at once (the overhead benchmark's load): each must take
    # an idle slot, not queue for the busy one holding its few tokens because one-token prompts
    # made every uncached token look as dear as a whole server step.
    table = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(4)])
    sched = SlotScheduler([table], load_plugin("routing", "exact-prefix", {}), 8)
    prompt = list(range(1000, 1008))
    for _ in range(10):
        lease = await sched.acquire(prompt, "t")
        sched.release(lease, answered(prompt_n=1, prompt_ms=30.0, tokens_cached=8))
    held = [await asyncio.wait_for(sched.acquire(prompt, "t"), 0.5) for _ in range(4)]
    assert sorted(lease.slot.slot_id for lease in held) == [0, 1, 2, 3]


def measured(sched: SlotScheduler, ms_per_token: float, request_s: float, after_s: float) -> None:
    """The upstream's figures, as if measured."""
    table = sched.tables[0]
    table.prefill_ms_per_token = Smoothed(ms_per_token)
    table.request_s = Smoothed(request_s)
    table.after_prefill_s = Smoothed(after_s)


def a_group(prefix: int, question: int, start: int = 1000) -> list[int]:
    """A prompt of a group: `prefix` tokens the group shares, then 10 of its own."""
    return [*range(start, start + prefix), *range(90000 + question * 10, 90010 + question * 10)]


async def test_a_request_sharing_a_prompt_being_computed_waits_for_its_slot() -> None:
    # 1,000 shared tokens at 0.5 ms beside the request computing them: 1 s to compute again.
    # Requests take 1.5 s on average, but this one's prompt is 0.5 s from computed and 0.2 s
    # after that is what requests take: its slot is free in about 0.7 s. Wait for it.
    sched = SlotScheduler([two_slots()], load_plugin("routing", "exact-prefix", {}), 8)
    measured(sched, ms_per_token=0.5, request_s=1.5, after_s=0.2)
    first = await sched.acquire(a_group(1000, 1), "t")
    second = asyncio.ensure_future(sched.acquire(a_group(1000, 2), "t"))
    await asyncio.sleep(0.05)
    assert not second.done()  # not on the idle slot, computing the 1,000 tokens again
    sched.release(first, answered(prompt_n=1010, prompt_ms=505.0, tokens_cached=1010))
    lease = await asyncio.wait_for(second, 1)
    assert lease.slot is first.slot and lease.predicted.low == 1000


@pytest.mark.parametrize("idle_slot", ["holds a text", "empty"])
async def test_a_busy_slot_is_waited_for_by_one_request_the_other_takes_the_idle_one(
    idle_slot: str,
) -> None:
    # Both queued requests share the 1,000 tokens the busy slot holds (its prompt computed,
    # 0.6 s to go), and a wait for it is worth it to one of them (0.6 s against 0.8 s on the
    # idle slot), not to both: for the one behind, the wait lasts both requests (1.2 s), so it
    # takes the idle slot at once rather than leave it idle. Which one waits depends on the
    # idle slot. Holding another text, the first queued waits (the wait keeps that text).
    # Empty, the first queued takes it: the copy of the prefix made there is credited with the
    # wait it spares the next request sharing it (without that credit, a system prompt every
    # conversation shares, held by two busy slots of four, kept the two others empty for a
    # whole run, each request finding the wait a little cheaper than the copy).
    sched = SlotScheduler([two_slots()], load_plugin("routing", "exact-prefix", {}), 8)
    if idle_slot == "holds a text":
        sched.release(await sched.acquire(list(range(50000, 50010)), "t"), done(10, []))
    measured(sched, ms_per_token=0.5, request_s=1.5, after_s=0.6)
    first = await sched.acquire(a_group(1000, 1), "t")
    sched.prefill_ended(first)
    second = asyncio.ensure_future(sched.acquire(a_group(1000, 2), "t"))
    third = asyncio.ensure_future(sched.acquire(a_group(1000, 3), "t"))
    await asyncio.sleep(0.05)
    waiting, copying = (second, third) if idle_slot == "holds a text" else (third, second)
    assert copying.done() and not waiting.done()
    assert copying.result().slot is not first.slot and copying.result().predicted.low == 0
    sched.release(first, answered(prompt_n=1010, prompt_ms=505.0, tokens_cached=1010))
    lease = await asyncio.wait_for(waiting, 1)
    assert lease.slot is first.slot and lease.predicted.low == 1000


async def test_a_release_plans_no_more_requests_than_there_are_slots_to_wait_for() -> None:
    # Many requests queued behind four busy slots, all holding the prefix every request shares
    # and each a question of 200 tokens (the overhead benchmark's chat load): computing a
    # question beside three requests looks dearer than the 50 ms left on a busy slot, so
    # each queued request, planned again in turn at every release, waited for a busy slot,
    # a cost growing with the queue, while the freed slot stayed idle. Now each busy slot is
    # waited for by one request at most: a release plans at most one request a slot.
    plans: list = []
    policy = load_plugin("routing", "exact-prefix", {})
    plan = policy.plan

    def counting(request, slots, upstreams):  # noqa: ANN001, ANN202
        plans.append(result := plan(request, slots, upstreams))
        return result

    def asking(question: int) -> list[int]:
        return [*range(1000, 2000), *range(10000 + 200 * question, 10200 + 200 * question)]

    policy.plan = counting
    table = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(4)])
    sched = SlotScheduler([table], policy, 64)
    measured(sched, ms_per_token=0.5, request_s=1.5, after_s=0.05)
    # every slot taken at once (impatient: none waits for the slot computing the prefix)
    held = [await sched.acquire(asking(q), "t", patient=False) for q in range(4)]
    for lease in held:
        sched.prefill_ended(lease)
    queued = [asyncio.ensure_future(sched.acquire(asking(q), "t")) for q in range(4, 24)]
    await asyncio.sleep(0)
    for served, lease in enumerate(held, start=1):
        plans.clear()
        sched.release(lease, answered(prompt_n=200, prompt_ms=100.0, tokens_cached=1200))
        await asyncio.sleep(0)
        assert 1 <= len(plans) <= len(table.slots)
        assert sum(task.done() for task in queued) == served
    for task in queued:
        task.cancel()


async def test_a_prompt_token_is_priced_at_what_it_costs_the_server() -> None:
    # Per request, a prompt token looks cheap (0.05 ms: 1,010 tokens again beside one request,
    # 0.1 s, less than the 0.3 s the busy slot holding 1,000 of them is still taken for): the
    # idle slot, once the shared prompt is computed. Once a prompt has shown what a token
    # costs the server across its batches (0.5 ms: 1 s beside that request), waiting for the
    # busy slot costs less.
    for server_ms_per_token, waits in ((None, False), (0.5, True)):
        sched = SlotScheduler([two_slots()], load_plugin("routing", "exact-prefix", {}), 8)
        measured(sched, ms_per_token=0.05, request_s=1.5, after_s=0.3)
        if server_ms_per_token is not None:
            sched.tables[0].prefill_throughput.add(10.0, 1000 * server_ms_per_token, 1000)
        first = await sched.acquire(a_group(1000, 1), "t")
        second = asyncio.ensure_future(sched.acquire(a_group(1000, 2), "t"))
        await asyncio.sleep(0.2)  # the shared prompt is computed (expected in 0.05 s)
        assert second.done() is not waits
        sched.release(first, answered(prompt_n=1010, prompt_ms=50.5, tokens_cached=1010))
        lease = await asyncio.wait_for(second, 1)
        assert (lease.slot is first.slot) is waits
        assert lease.predicted.low == (1000 if waits else 0)


async def test_a_prompt_being_computed_is_waited_for_then_the_choice_is_made_again() -> None:
    # The same, but requests hold their slot 2 s after their prompt: the slot is not worth
    # its wait, the 0.5 s until the shared prompt is computed is (a copy computed beside it
    # would end no sooner). Once it is computed (its first streamed event), the idle slot.
    sched = SlotScheduler([two_slots()], load_plugin("routing", "exact-prefix", {}), 8)
    measured(sched, ms_per_token=0.5, request_s=1.5, after_s=2.0)
    first = await sched.acquire(a_group(1000, 1), "t")
    second = asyncio.ensure_future(sched.acquire(a_group(1000, 2), "t"))
    await asyncio.sleep(0.05)
    assert not second.done()
    sched.prefill_ended(first)
    lease = await asyncio.wait_for(second, 0.1)
    assert lease.slot is not first.slot
    # without a first event, at the expected end of the prompt (from the measured rate)
    sched.release(first, answered(prompt_n=1, prompt_ms=1.0, tokens_cached=1010))
    sched.release(lease, answered(prompt_n=1, prompt_ms=1.0, tokens_cached=1010))
    third = await sched.acquire(a_group(600, 3, start=20000), "t")
    fourth = asyncio.ensure_future(sched.acquire(a_group(600, 4, start=20000), "t"))
    await asyncio.sleep(0.1)
    assert not fourth.done()
    lease = await asyncio.wait_for(fourth, 1)
    assert lease.slot is not third.slot


async def test_the_time_after_a_prompt_is_measured_from_its_first_event() -> None:
    now = [100.0]
    table = two_slots()
    sched = SlotScheduler([table], load_plugin("routing", "exact-prefix", {}), 8, lambda: now[0])
    lease = await sched.acquire(a_group(100, 1), "t")
    now[0] = 100.4
    sched.prefill_ended(lease)
    now[0] = 100.7
    sched.release(lease, answered(prompt_n=110, prompt_ms=300.0, tokens_cached=110))
    # the first measurements replace the guesses (1 s each)
    assert table.after_prefill_s.value == pytest.approx(0.3)
    assert table.request_s.value == pytest.approx(0.7)


async def test_a_wait_for_another_tenants_slot_does_not_depend_on_what_it_sent() -> None:
    # Tenant b's slot holds a's public prefix: what b's request is doing (how long its prompt)
    # is never shown to the policy that plans a's request.
    seen: list = []
    policy = load_plugin("routing", "exact-prefix", {})
    plan = policy.plan

    def spying(request, slots, upstreams):  # noqa: ANN001, ANN202
        seen.append(slots)
        return plan(request, slots, upstreams)

    policy.plan = spying
    for length in (20, 2000):
        seen.clear()
        sched = SlotScheduler([two_slots()], policy, 8)
        measured(sched, ms_per_token=0.5, request_s=1.5, after_s=0.2)
        public = list(range(1000, 1100))
        held = await sched.acquire(
            [*public, *range(5000, 5000 + length)], "b", public_prefix_length=100
        )
        waiting = asyncio.ensure_future(sched.acquire([*public, 7], "a", public_prefix_length=100))
        await asyncio.sleep(0)
        (others,) = [slot for slot in seen[-1] if slot.busy]
        assert (others.remaining_s, others.prefill_left_s) == (None, 0.0)
        waiting.cancel()
        sched.release(held, done(1, []))


async def test_turns_that_leave_out_the_last_tokens_continue_but_not_exactly() -> None:
    """A next turn that re-templates the answer, its last tokens tokenized otherwise, continues
    the conversation (within the slack) but not to its very end: a state restored whole or not
    at all (a sliding-window model's) would give it nothing."""
    sched = scheduler(n_slots=1)
    prompt, answer = list(range(100, 400)), [7, 8, 9, 10]
    lease = await sched.acquire(prompt, "t")
    sched.release(lease, done(len(prompt) + len(answer) - 1, answer))
    for turn in range(5):  # all but the answer's last three tokens, then the next question
        prompt = [*prompt, answer[0], 50 + turn, 60 + turn, *range(500, 520)]
        lease = await sched.acquire(prompt, "t")
        lease = sched.prepared(lease, lease.predicted, lease.isolate)
        sched.release(lease, done(len(prompt) + len(answer) - 1, answer))
    assert sched.continue_chance("t") == 1.0
    assert sched.exact_continue_chance("t") < 0.6
    # continuing all of it, as turns of token ids do
    exact = sched.exact_continue_chance("t")
    lease = await sched.acquire([*prompt, *answer, 11], "t")
    lease = sched.prepared(lease, lease.predicted, lease.isolate)
    assert lease.previous.continues_exactly == exact  # the evicted text's figure, as it stood
    assert sched.exact_continue_chance("t") > exact
    sched.release(lease, done(len(prompt) + 4, answer))


async def test_a_slot_keeps_its_branch_point_while_its_requests_branch_there() -> None:
    sched = scheduler(n_slots=1)
    document, answer = list(range(100, 400)), [7, 8]

    def answered(prompt: list[int]) -> TaskOutcome:
        return done(len(prompt) + len(answer), answer)

    def question(seed: int) -> list[int]:
        return [*document, *range(seed, seed + 40)]

    first = await sched.acquire(question(1000), "t")
    assert first.slot.branch is None  # nothing known of its lineage
    assert sched.continue_chance("t") == 1.0  # nothing reused yet: taken to continue
    # the disk tier restored an archive of the document with another question: the request
    # reused the document only
    first = sched.prepared(first, ReuseBounds(300, 300), isolate=False, branch=len(document))
    assert first.slot.branch == len(document)
    sched.release(first, answered(question(1000)))
    # another question on the document branches there again: the slot's text keeps to it,
    # and the text it replaced goes with the lease
    second = await sched.acquire(question(2000), "t")
    assert second.slot.branch == len(document) and second.previous.branch == len(document)
    second = sched.prepared(second, second.predicted, second.isolate)  # the disk tier did nothing
    sched.release(second, answered(question(2000)))
    branching = sched.continue_chance("t")
    assert branching < 1.0
    # a follow-up continuing the whole exchange makes it a conversation
    follow_up = [*question(2000), *answer, 9]
    third = await sched.acquire(follow_up, "t")
    assert third.slot.branch is None and third.previous.branch == len(document)
    third = sched.prepared(third, third.predicted, third.isolate)
    assert sched.continue_chance("t") > branching
    assert third.previous.continues == branching  # the evicted text's figure, as it stood
    sched.release(third, answered(follow_up))
    # a slot whose lineage is not known to branch does not start branching on its own
    fourth = await sched.acquire(question(3000), "t")
    assert fourth.slot.branch is None


async def test_a_grant_claims_the_ram_cache_entry_its_placement_predicted() -> None:
    """With the server's RAM cache followed, placement asks the shadow what each idle slot would
    load; the grant claims the chosen slot's entry from that answer, without asking again, and
    the other slot can no longer count on the entry."""
    group = list(range(1000, 1256))
    cached, first, second = (group + list(range(q, q + 32)) for q in (20000, 30000, 40000))
    held = [list(range(5000, 5300)), list(range(7000, 7300))]
    options = LlamaServerPromptCache.Options(limit_bytes=8192 << 20)
    shadow = RamCacheShadow(LlamaServerPromptCache(options, PromptCacheDeps(n_ctx=8192)))
    shadow.dispatched([ShadowSlot(0, cached, False)], 0, cached, held[0])  # the group's entry
    slots = [SlotState(i, 4096) for i in range(2)]
    for slot, tokens in zip(slots, held, strict=True):
        slot.hold(tokens)
    table = UpstreamSlots(0, Upstream("http://u"), slots, ram_cache=True, ram_shadow=shadow)
    asked: list[int] = []
    predict = shadow.predict

    def counted(views, slot_id, prompt):  # noqa: ANN001, ANN202 - predict's own
        asked.append(slot_id)
        return predict(views, slot_id, prompt)

    shadow.predict = counted  # type: ignore[method-assign]
    sched = SlotScheduler([table], load_plugin("routing", "exact-prefix", {}), 8)
    lease = await sched.acquire(first, sched.open_tenant)
    assert sorted(asked) == [0, 1]  # once a slot, at placement
    assert lease.predicted == ReuseBounds(256, 256)
    other = 1 - lease.slot.slot_id
    assert predict(table.shadow_slots(), other, second).cache_n == 0
