"""Background loops outlive a failed round; only cancellation ends them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from cacheproxy.ops.supervise import repeat

log = logging.getLogger("cacheproxy.tests.supervise")


async def until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the loop stopped going round"
        await asyncio.sleep(0.01)


async def test_a_failing_round_is_logged_once_and_the_loop_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "missing" / "file"  # a real OSError until the folder exists
    rounds: list[str] = []

    async def one_round() -> None:
        rounds.append("tried")
        target.write_text("x")
        rounds.append("done")

    caplog.set_level(logging.INFO, logger=log.name)
    loop = asyncio.create_task(
        repeat("writer", one_round, pause_s=0.01, log=log, after_failure_s=0.01)
    )
    try:
        await until(lambda: rounds.count("tried") >= 5)
        assert not loop.done() and "done" not in rounds
        failures = [r for r in caplog.records if "a round failed" in r.getMessage()]
        assert len(failures) == 1  # the same fault again is not logged again
        assert failures[0].exc_info is None  # an expected I/O error: one line, no traceback
        target.parent.mkdir()
        await until(lambda: "done" in rounds)
        await asyncio.sleep(0.05)
        assert "writer: working again" in caplog.text
    finally:
        loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop


async def test_an_unexpected_error_gets_its_traceback_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = 0

    async def one_round() -> None:
        nonlocal calls
        calls += 1
        raise KeyError("surprise")

    loop = asyncio.create_task(repeat("odd", one_round, pause_s=0, log=log, after_failure_s=0.01))
    await until(lambda: calls >= 3)
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop
    failures = [r for r in caplog.records if "a round failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
