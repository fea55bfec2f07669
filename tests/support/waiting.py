"""Waiting for a condition the test cannot be told of: polled, with a deadline that only turns
a hang into a failure (the verdict is the condition, never the time it took)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

WITHIN_S = 30.0


async def wait_for(
    condition: Callable[[], object | Awaitable[object]],
    what: str = "the condition",
    within_s: float = WITHIN_S,
    poll_s: float = 0.02,
) -> None:
    """Until `condition()` holds; a coroutine function's answer is awaited (a coroutine object
    itself is always true, and would end the wait at once)."""
    deadline = time.monotonic() + within_s
    while not await _answer(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(poll_s)


async def _answer(condition: Callable[[], object | Awaitable[object]]) -> object:
    answer = condition()
    return await answer if inspect.isawaitable(answer) else answer


def wait_for_sync(
    condition: Callable[[], object],
    what: str = "the condition",
    within_s: float = WITHIN_S,
    poll_s: float = 0.1,
) -> None:
    """`wait_for` for a test that runs no event loop (the proxy in a child process)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
