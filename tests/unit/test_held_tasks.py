"""HeldTasks: a task started beside a request is held until it ends, and a stop waits for it."""

from __future__ import annotations

import asyncio
import gc

from cacheproxy.ops.held_tasks import HeldTasks


async def test_a_task_nobody_awaits_runs_to_its_end_and_is_then_let_go() -> None:
    held = HeldTasks()
    release, ended = asyncio.Event(), []

    async def work() -> None:
        await release.wait()
        ended.append(True)

    held.start(work(), "test.work")  # its task not kept here: only the holder has it
    await asyncio.sleep(0)
    gc.collect()  # the loop's reference is weak: without the holder the task could go
    assert len(held) == 1
    release.set()
    await held.wait(None)
    assert ended == [True] and len(held) == 0


async def test_a_stop_waits_within_its_deadline_then_cancels_the_rest() -> None:
    held = HeldTasks()
    quick = held.start(asyncio.sleep(0), "test.quick")
    stuck = held.start(asyncio.Event().wait(), "test.stuck")
    assert stuck.get_name() == "test.stuck"
    await held.wait(0.05)
    assert quick.done() and not stuck.done() and len(held) == 1
    await held.cancel()
    assert stuck.cancelled() and len(held) == 0
