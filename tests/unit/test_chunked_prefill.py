"""Chunked prefill (pure decision and the scheduler's part): when a prompt is computed in
chunks, how big they are, where they end, and when a chunking tenant lets another's prompt go
first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from cacheproxy.plugins import load_plugin
from cacheproxy.slots.chunked_prefill import (
    MIN_CHUNK_TOKENS,
    chunk_ends,
    chunk_tokens,
    in_chunks,
    yields_to,
)
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.slots.slot_share import TenantSlots
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import SlotState, UpstreamSlots


def test_only_a_tenant_at_or_beyond_its_share_beside_others_is_chunked() -> None:
    assert not in_chunks("heavy", {"heavy": TenantSlots(holding=3)}, 4)  # alone: never
    beside = {"heavy": TenantSlots(holding=2), "light": TenantSlots(holding=0)}
    assert in_chunks("heavy", beside, 4)  # at its share of 2
    assert not in_chunks("light", beside, 4)  # within its share
    within = {"heavy": TenantSlots(holding=1), "light": TenantSlots(holding=1)}
    assert not in_chunks("heavy", within, 4)
    weighted = {"heavy": TenantSlots(weight=3, holding=2), "light": TenantSlots(holding=0)}
    assert not in_chunks("heavy", weighted, 4)  # its share is 3
    assert not in_chunks("gone", beside, 4)


def test_a_chunking_tenant_yields_only_to_a_prompt_of_another_within_its_share() -> None:
    light_computing = {"heavy": TenantSlots(holding=3), "light": TenantSlots(1, 1, None, 1)}
    assert yields_to("heavy", light_computing, 4)
    light_decoding = {"heavy": TenantSlots(holding=3), "light": TenantSlots(1, 1, None, 0)}
    assert not yields_to("heavy", light_decoding, 4)
    # two flooders, both beyond their shares: neither waits for the other
    two_heavy = {"a": TenantSlots(1, 3, None, 1), "b": TenantSlots(1, 3, None, 1)}
    assert not yields_to("a", two_heavy, 4)
    assert not yields_to("heavy", {"heavy": TenantSlots(1, 3, None, 1)}, 4)


def test_a_chunk_is_a_time_at_the_measured_rate_never_tiny_and_off_unmeasured() -> None:
    assert chunk_tokens(ms_per_token=0.1, chunk_ms=10) == 100
    assert chunk_tokens(ms_per_token=0.05, chunk_ms=10) == 200  # faster server, more tokens
    assert chunk_tokens(ms_per_token=5.0, chunk_ms=10) == MIN_CHUNK_TOKENS
    assert chunk_tokens(ms_per_token=0.0, chunk_ms=10) is None  # no rate measured yet
    assert chunk_tokens(ms_per_token=0.1, chunk_ms=0) is None  # off


def test_chunks_grow_from_what_is_reused_and_leave_the_last_piece_to_the_request() -> None:
    assert chunk_ends(256, 0, 64) == [64, 128, 192]  # the request computes 193..256
    assert chunk_ends(250, 0, 64) == [64, 128, 192]  # 58 left
    assert chunk_ends(257, 0, 64) == [64, 128, 192, 256]  # one token left
    assert chunk_ends(256, 100, 64) == [164, 228]
    assert chunk_ends(256, 200, 64) == []  # what is left fits in one chunk
    assert chunk_ends(64, 0, 64) == []
    assert chunk_ends(256, 0, None) == []
    for length in range(1, 300):
        for reused in (0, 7, 100):
            ends = chunk_ends(length, reused, 32)
            assert ends == sorted(set(ends))
            assert all(reused < end < length for end in ends)
            assert length - (ends[-1] if ends else reused) <= 32


def scheduler(clock) -> SlotScheduler:  # noqa: ANN001 - a clock function
    table = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(4)])
    table.prefill_ms_per_token.value = 1.0  # 1 ms a token
    policy = load_plugin("routing", "exact-prefix", {"max_wait_s": 0})
    return SlotScheduler([table], policy, 64, clock=clock, share_window_s=5.0)


async def test_the_lease_says_chunked_only_beyond_the_share_beside_others() -> None:
    now = [1000.0]
    sched = scheduler(lambda: now[0])
    alone = [await sched.acquire([n] * 10, "heavy") for n in range(3)]
    assert not any(lease.chunked for lease in alone)  # alone: every slot, none chunked
    light = await sched.acquire([7] * 10, "light")
    assert not light.chunked
    now[0] += 1  # every prompt computed
    sched.release(alone[0], _done())
    sched.release(alone[1], _done())
    sched.release(light, _done())  # light stays active (the window): a slot is kept for it
    within = await sched.acquire([8] * 10, "heavy")  # holds 1 of its 2
    assert not within.chunked
    now[0] += 1
    beyond = await sched.acquire([9] * 10, "heavy")  # holds 2: at its share
    assert beyond.chunked


async def test_a_chunk_waits_while_a_light_prompt_is_computed() -> None:
    sched = scheduler(time.monotonic)
    heavy = [await sched.acquire([n] * 10, "heavy") for n in range(3)]
    await asyncio.sleep(0.02)  # their prompts (10 ms each) are computed
    light = await sched.acquire([7] * 40, "light")  # 40 ms of prompt being computed
    started = time.monotonic()
    await sched.chunk_turn(heavy[2], 100)
    assert time.monotonic() - started >= 0.035
    sched.release(light, _done())
    assert finishes_without_waiting(sched.chunk_turn(heavy[2], 100))  # no other prompt: at once


def finishes_without_waiting(step: Coroutine[Any, Any, None]) -> bool:
    """Whether the coroutine ends without suspending once (not timed: a loaded machine may
    take any time over it)."""
    try:
        step.send(None)
    except StopIteration:
        return True
    step.close()
    return False


async def test_a_paused_chunk_goes_on_as_soon_as_the_prompt_it_waits_for_ends() -> None:
    sched = scheduler(time.monotonic)
    heavy = [await sched.acquire([n] * 10, "heavy") for n in range(3)]
    await asyncio.sleep(0.02)
    light = await sched.acquire([7] * 5000, "light")  # 5 s expected
    started = time.monotonic()
    paused = asyncio.ensure_future(sched.chunk_turn(heavy[2], 100))
    await asyncio.sleep(0.05)
    assert not paused.done()
    sched.release(light, _done())  # it ended long before its estimate
    await asyncio.wait_for(paused, 1.0)
    assert time.monotonic() - started < 0.5


def _done():  # noqa: ANN202 - a TaskOutcome
    from cacheproxy.upstreams.slot_table import TaskOutcome

    return TaskOutcome(ok=True, cache_n=0, prompt_n=10, prompt_ms=10.0, tokens_cached=10)


def test_a_chunked_request_counts_each_prompt_token_once_and_reused_only_what_was() -> None:
    from cacheproxy.slots.chunked_prefill import Chunks
    from cacheproxy.upstreams.slot_table import TaskOutcome

    chunks = Chunks(end=100)  # 100 tokens reused before the chunks
    chunks.add(250, TaskOutcome(True, cache_n=100, prompt_n=150, prompt_ms=15.0))
    chunks.add(400, TaskOutcome(True, cache_n=250, prompt_n=150, prompt_ms=16.0))
    final = TaskOutcome(True, cache_n=400, prompt_n=56, prompt_ms=6.0, tokens_cached=463)
    merged = chunks.merged(final)
    assert (merged.cache_n, merged.prompt_n) == (100, 356)  # 456 tokens: 100 reused, once each
    assert merged.prompt_ms == 37.0 and merged.tokens_cached == 463
    # the server reused more than the chunks left: its own figure, for the prediction check
    assert chunks.merged(TaskOutcome(True, cache_n=430, prompt_n=26)).cache_n == 430
    # cut between chunks: the slot holds exactly what they computed
    assert chunks.between()
    assert chunks.outcome() == TaskOutcome(
        True,
        cache_n=100,
        prompt_n=300,
        prompt_ms=31.0,
        tokens_cached=400,
        generated=[],
        predicted_n=0,
    )
    chunks.running = True
    assert not chunks.between()  # cut inside one: not known


async def test_a_first_token_ends_the_prefill_the_scheduler_waited_for() -> None:
    sched = scheduler(time.monotonic)
    heavy = [await sched.acquire([n] * 10, "heavy") for n in range(3)]
    await asyncio.sleep(0.02)
    light = await sched.acquire([7] * 5000, "light")  # 5 s expected
    paused = asyncio.ensure_future(sched.chunk_turn(heavy[2], 100))
    await asyncio.sleep(0.02)
    assert not paused.done()
    sched.prefill_ended(light)  # its stream's first event: computed
    await asyncio.wait_for(paused, 1.0)
    # and the heavy tenant, one prompt at a time, may start its next once its own is computed
    sched.release(heavy[0], _done())
    sched.release(light, _done())  # two idle slots: one for heavy, one kept for light
    waiting = asyncio.ensure_future(sched.acquire([9] * 10, "heavy"))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # heavy[2]'s 100 tokens (100 ms) are being computed
    sched.prefill_ended(heavy[2])
    await asyncio.wait_for(waiting, 1.0)
