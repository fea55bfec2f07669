"""Waiting for a condition the test cannot be told of: polled, with a deadline that only turns
a hang into a failure (the verdict is the condition, never the time it took)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

WITHIN_S = 30.0


async def wait_for(
    condition: Callable[[], object],
    what: str = "the condition",
    within_s: float = WITHIN_S,
    poll_s: float = 0.02,
) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(poll_s)


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
