"""A request lined up behind its tenant's running request (slots/line_up.py): served at once on a
provisional lease where every rule allows it, handed the slot when the running one is given back,
and never where a rule forbids it (another tenant's text or turn, a RAM cache, a prompt that
would drop what the slot holds)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from cacheproxy.disk.blocks import MIN_ARCHIVE_TOKENS
from cacheproxy.plugins import load_plugin
from cacheproxy.slots.fair_queue import Share
from cacheproxy.slots.line_up import ArchivesFrom
from cacheproxy.slots.queue_bounds import Overloaded, TenantQueueFull
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.tenancy.auth import Caller
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import (
    CONTINUATION_SLACK_TOKENS,
    UNANSWERED,
    UNKNOWN,
    Lease,
    ReuseBounds,
    SlotState,
    TaskOutcome,
    UpstreamSlots,
)

PROMPT = list(range(100, 160))
MIN_TOKENS = 256  # the disk tier's `min_tokens` in these tests


def archives_from_min_tokens(index: int) -> int | None:
    """A disk tier attached to the upstream: it archives slots of `MIN_TOKENS` and more."""
    return MIN_TOKENS


def scheduler(
    n_slots: int = 1,
    ram_cache: str = "off",
    line_up: bool = True,
    clock: Callable[[], float] = time.monotonic,
    archives_from: ArchivesFrom | None = archives_from_min_tokens,
    max_queue: int = 64,
) -> SlotScheduler:
    table = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(n_slots)])
    table.set_ram_cache(ram_cache)
    policy = load_plugin("routing", "exact-prefix", {"max_wait_s": 0})
    return SlotScheduler(
        [table],
        policy,
        max_queue,
        clock=clock,
        share_window_s=5.0,
        line_up=line_up,
        archives_from=archives_from,
    )


def answered(prompt: list[int], generated: list[int]) -> TaskOutcome:
    cached = len(prompt) + len(generated)
    return TaskOutcome(
        ok=True, cache_n=0, prompt_n=len(prompt), tokens_cached=cached, generated=generated
    )


async def soon(waiting: asyncio.Future) -> bool:
    """Whether `waiting` is done once the scheduler's dispatch has run."""
    await asyncio.sleep(0)
    return waiting.done()


async def test_a_request_keeping_the_running_prompt_is_lined_up_and_handed_the_slot() -> None:
    sched = scheduler()
    running = await sched.acquire(PROMPT, "a")
    sched.sent(running)
    behind = asyncio.ensure_future(sched.acquire(PROMPT, "a"))
    assert await soon(behind)  # served at once, though the one slot is busy
    provisional = behind.result()
    assert provisional.slot is running.slot
    handover = sched.take_handover(provisional)
    assert handover is not None and not handover.done()
    assert sched.take_handover(running) is None  # a lease granted on an idle slot has none
    third = asyncio.ensure_future(sched.acquire(PROMPT, "a"))
    assert not await soon(third)  # one request behind a slot at a time

    sched.release(running, answered(PROMPT, [7, 8]))
    lease = await handover
    # granted on what the running request left, exactly: its prompt and what it generated
    assert lease.slot is running.slot and lease.slot.busy
    assert lease.previous.known == [*PROMPT, 7, 8]
    assert lease.predicted.low == lease.predicted.high == len(PROMPT) - 1
    assert await soon(third)  # the next one lines up behind the request that took the slot
    assert third.result().slot is running.slot


async def test_nobody_is_lined_up_where_a_rule_forbids_it() -> None:
    # the RAM cache on (or not known off): a task pinned to a busy slot may overwrite its KV
    for ram_cache in ("on", "unknown"):
        sched = scheduler(ram_cache=ram_cache)
        sched.sent(await sched.acquire(PROMPT, "a"))
        assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a")))
    # off in the settings
    sched = scheduler(line_up=False)
    sched.sent(await sched.acquire(PROMPT, "a"))
    assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a")))
    # another tenant's running request, and any tenant's once another is active
    sched = scheduler()
    sched.sent(await sched.acquire(PROMPT, "a"))
    assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "b")))
    assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a")))
    # a prompt that drops more than the last tokens of the running prompt, or shares nothing
    sched = scheduler()
    sched.sent(await sched.acquire(PROMPT, "a"))
    dropped = [*PROMPT[: -CONTINUATION_SLACK_TOKENS - 1], 1]
    assert not await soon(asyncio.ensure_future(sched.acquire(dropped, "a")))
    sched = scheduler()
    sched.sent(await sched.acquire(PROMPT, "a"))
    assert not await soon(asyncio.ensure_future(sched.acquire([5, *PROMPT], "a")))
    # a prompt that must not reuse, a split request's tasks, an opaque prompt
    sched = scheduler()
    sched.sent(await sched.acquire(PROMPT, "a"))
    assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a", cache_prompt=False)))
    assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a", patient=False)))
    assert not await soon(asyncio.ensure_future(sched.acquire_group(PROMPT, "a", 1)))
    assert not await soon(asyncio.ensure_future(sched.acquire_opaque("a")))
    # a batch request: the tenant's interactive ones could not pass it
    sched = scheduler()
    sched.sent(await sched.acquire(PROMPT, "a"))
    batch = Share(priority="batch")
    assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a", share=batch)))


async def test_no_request_follows_one_on_another_tenants_text() -> None:
    """A request leased a slot holding another tenant's text reuses none of it, yet should it
    fail before computing, the slot still holds that text: nobody may be lined up behind it."""
    now = [0.0]
    sched = scheduler(clock=lambda: now[0])
    first = await sched.acquire(PROMPT, "b")
    sched.sent(first)
    sched.release(first, answered(PROMPT, [7]))
    now[0] = 60.0  # "b" gone quiet: "a" alone
    isolated = await sched.acquire(PROMPT, "a")
    sched.sent(isolated)
    assert isolated.isolate
    assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a")))


async def test_a_failed_running_request_hands_over_a_slot_of_the_tenant_with_unknown_text() -> None:
    sched = scheduler()
    running = await sched.acquire(PROMPT, "a")
    sched.sent(running)
    behind = asyncio.ensure_future(sched.acquire(PROMPT, "a"))
    assert await soon(behind)
    handover = sched.take_handover(behind.result())
    assert handover is not None
    sched.release(running, UNANSWERED)
    lease = await handover
    # its own tenant's text, of which nothing is known: reused as far as the server says
    assert not lease.isolate and lease.slot.tenant == "a"
    assert lease.predicted.low == 0 and lease.predicted.high == len(PROMPT) - 1


async def test_a_provisional_lease_given_back_unsent_leaves_the_slot_to_the_running_one() -> None:
    sched = scheduler()
    running = await sched.acquire(PROMPT, "a")
    sched.sent(running)
    behind = asyncio.ensure_future(sched.acquire(PROMPT, "a"))
    assert await soon(behind)
    sched.release(behind.result(), UNANSWERED)  # as a refused claim gives it back
    assert running.slot.busy  # still the running request's
    sched.release(running, answered(PROMPT, [7]))
    assert not running.slot.busy  # nobody took it over
    assert running.slot.known == [*PROMPT, 7]


async def test_a_provisional_lease_given_back_after_its_handover_frees_the_slot() -> None:
    sched = scheduler()
    running = await sched.acquire(PROMPT, "a")
    sched.sent(running)
    behind = asyncio.ensure_future(sched.acquire(PROMPT, "a"))
    assert await soon(behind)
    sched.release(running, answered(PROMPT, [7]))
    assert running.slot.busy  # handed over, though its stages have not asked yet
    sched.release(behind.result(), UNANSWERED)
    assert not running.slot.busy
    assert running.slot.tenant is None  # a request that did not run: nobody's, as any


async def test_a_cut_request_is_followed_by_nobody_and_says_when_one_was_lined_up() -> None:
    sched = scheduler(n_slots=2)
    alone = await sched.acquire(PROMPT, "a")
    sched.sent(alone)
    followed = await sched.acquire(PROMPT, "a")
    sched.sent(followed)
    assert alone.slot is not followed.slot
    behind = asyncio.ensure_future(sched.acquire(PROMPT, "a", slot_id=followed.slot.slot_id))
    assert await soon(behind)
    assert sched.cut(followed)  # its slot goes to the one behind it: not to be read
    assert not sched.cut(alone)
    # once cut, nobody more is lined up behind it (its slot is read when the server lets go)
    assert not await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a")))


async def test_a_waiter_that_may_not_be_lined_up_is_not_passed_by_one_that_may() -> None:
    """Requests lined up one behind the other would keep an earlier one from the slot for as
    long as they came: the head of the queue keeps its turn."""
    sched = scheduler()
    running = await sched.acquire(PROMPT, "a")
    sched.sent(running)
    other = asyncio.ensure_future(sched.acquire([1, 2, 3], "a"))
    assert not await soon(other)
    same = asyncio.ensure_future(sched.acquire(PROMPT, "a"))
    assert not await soon(same)  # it would take the slot before the one ahead of it
    sched.release(running, answered(PROMPT, [7]))
    assert await soon(other)
    assert not same.done()


async def test_a_fresh_prompt_follows_where_the_disk_tier_would_do_nothing_between() -> None:
    """A fresh conversation under the same head may follow its tenant's running request when
    the disk tier would neither archive what that one leaves nor restore anything for it."""
    head = PROMPT[:40]
    fresh = [*head, *range(5000, 5020)]  # keeps the head, drops the running prompt's end

    async def follows(
        running_prompt: list[int],
        prompt: list[int],
        generates_at_most: int | None,
        archives_from: ArchivesFrom | None = archives_from_min_tokens,
    ) -> bool:
        sched = scheduler(archives_from=archives_from)
        sched.sent(await sched.acquire(running_prompt, "a", generates_at_most=generates_at_most))
        return await soon(asyncio.ensure_future(sched.acquire(prompt, "a")))

    # short: what the running one leaves (its 60 tokens and at most 16 more) is not archived
    assert await follows(PROMPT, fresh, 16)
    # ... unless it may generate enough to be worth archiving, or has no bound
    assert not await follows(PROMPT, fresh, MIN_TOKENS - len(PROMPT))
    assert await follows(PROMPT, fresh, MIN_TOKENS - len(PROMPT) - 1)
    assert not await follows(PROMPT, fresh, None)
    # long: worth archiving, unless the follower keeps all but less than a block of it
    long_prompt = [*head, *range(6000, 6000 + MIN_TOKENS)]
    assert not await follows(long_prompt, fresh, 1)
    almost_all = [*long_prompt[: -MIN_ARCHIVE_TOKENS + 2], 1]
    assert await follows(long_prompt, almost_all, 1)
    # a follower whose new part an archive might hold: the tier would look for one
    restorable = [*head, *range(7000, 7000 + MIN_ARCHIVE_TOKENS + 1)]
    assert not await follows(PROMPT, restorable, 1)
    assert await follows(PROMPT, restorable[:-1], 1)
    # sharing nothing: the tier might archive what it loses, or restore for it
    assert not await follows(PROMPT, [5, *PROMPT], 1)
    # no disk tier there: any prompt of the tenant may follow, bound or none
    assert await follows(PROMPT, [5, *PROMPT], None, archives_from=None)
    assert await follows(long_prompt, fresh, None, archives_from=lambda index: None)
    # another tenant's never (the rules above are its tenant's)
    sched = scheduler(archives_from=None)
    sched.sent(await sched.acquire(PROMPT, "a", generates_at_most=1))
    assert not await soon(asyncio.ensure_future(sched.acquire(fresh, "b")))


def test_what_a_task_may_generate_is_read_as_the_server_reads_its_limits() -> None:
    caller = Caller(None, False, False, False, False)

    def bound(document: dict) -> int | None:
        return PlacedRequest("/completion", b"", document, caller, "a", None).generates_at_most

    assert bound({"n_predict": 16}) == 16
    assert bound({"max_tokens": 0}) == 0
    assert bound({"max_completion_tokens": 7}) == 7
    # several aliases: the largest, whichever the server reads
    assert bound({"n_predict": 4, "max_tokens": 9}) == 9
    # none, the server's "no limit", or a value it may read otherwise: no bound known
    for document in (
        {},
        {"n_predict": -1},
        {"n_predict": 4, "max_tokens": -1},
        {"n_predict": True},
        {"n_predict": 4.0},
        {"max_tokens": "4"},
    ):
        assert bound(document) is None, document


async def test_nobody_is_lined_up_behind_a_request_before_it_is_sent() -> None:
    """Until its whole request is on its way (its disk tier's save or restore done first), a
    request lined up behind it could reach the server first and run there before them."""
    sched = scheduler()
    running = await sched.acquire(PROMPT, "a")
    behind = asyncio.ensure_future(sched.acquire(PROMPT, "a"))
    assert not await soon(behind)  # waits in the proxy
    sched.sent(running)
    assert await soon(behind)  # lined up as the running one goes out
    assert behind.result().slot is running.slot


async def test_either_order_the_server_ran_the_two_in_is_predicted_and_settled() -> None:
    """The server's threads may read the lined-up request before the running one: each is
    predicted on both orders, and the lined-up one's answer tells which the server took (so
    what the slot holds), or, where both orders give it, what is known of the slot."""
    head = PROMPT[:40]
    first_text = [*head, *range(5000, 5020)]  # what the slot held before the running one
    running_prompt = [*head, *range(6000, 6010)]
    fresh = [*head, *range(7000, 7015)]

    def reused(cache_n: int) -> TaskOutcome:  # the fresh one's answer
        return replace(answered(fresh, [3, 4]), cache_n=cache_n)

    async def handed(first: list[int]) -> tuple[SlotScheduler, Lease, ReuseBounds]:
        """The slot held `first`, then the running prompt, with the fresh one lined up behind
        it: the scheduler, the fresh one's lease, and the running one's predicted reuse."""
        sched = scheduler(archives_from=None)
        earlier = await sched.acquire(first, "a", generates_at_most=1)
        sched.sent(earlier)
        sched.release(earlier, answered(first, [1]))
        running = await sched.acquire(running_prompt, "a", generates_at_most=2)
        sched.sent(running)
        behind = asyncio.ensure_future(sched.acquire(fresh, "a", generates_at_most=2))
        assert await soon(behind)
        handover = sched.take_handover(behind.result())
        assert handover is not None
        verdict = sched.release(running, answered(running_prompt, [8, 9]))
        return sched, await handover, verdict.predicted

    sched, lease, running_bounds = await handed(first_text)
    # the running one: on the text before it (40), or on the fresh one's prompt (40): the same
    assert running_bounds == ReuseBounds(len(head), len(head))
    # both orders give 40: the fresh one ran last, or the running one did
    verdict = sched.release(lease, reused(len(head)))
    assert verdict.matched and verdict.predicted == ReuseBounds(len(head), len(head))
    assert lease.slot.known == head and lease.slot.unknown_tail is UNKNOWN

    # the text before the running one shares more with the fresh prompt: the orders differ
    sched, lease, _ = await handed([*fresh[:50], 1, 2, 3])
    # its lease keeps the order it was sent in (what it is charged if cut); its answer, either
    assert lease.predicted == ReuseBounds(len(head), len(head))
    verdict = sched.release(lease, reused(3))
    assert verdict.predicted == ReuseBounds(len(head), 50)
    assert not verdict.matched  # neither order gives 3
    assert lease.slot.known == [*fresh, 3, 4]  # as the answer says
    for cache_n, holds in ((len(head), [*fresh, 3, 4]), (50, [*running_prompt, 8, 9])):
        sched, lease, _ = await handed([*fresh[:50], 1, 2, 3])
        assert sched.release(lease, reused(cache_n)).matched
        assert lease.slot.known == holds  # read first (50 reused), it ran before the other


async def test_requests_lined_up_count_towards_the_bounds_on_waiting_requests() -> None:
    """A request lined up waits for a slot as much as one in the queue: a tenant's bound on
    waiting requests, and the bound on all of them, count it."""
    sched = scheduler()
    sched.sent(await sched.acquire(PROMPT, "a"))
    lined = asyncio.ensure_future(sched.acquire(PROMPT, "a", queue_bound=2))
    assert await soon(lined)  # lined up
    queued = asyncio.ensure_future(sched.acquire(PROMPT, "a", queue_bound=2))
    assert not await soon(queued)  # in the queue
    assert sched.queued == sched.queued_for("a") == 2
    with pytest.raises(TenantQueueFull):
        await sched.acquire(PROMPT, "a", queue_bound=2)
    sched = scheduler(max_queue=1)
    sched.sent(await sched.acquire(PROMPT, "a"))
    assert await soon(asyncio.ensure_future(sched.acquire(PROMPT, "a")))
    with pytest.raises(Overloaded):
        await sched.acquire(PROMPT, "a")
