"""Background loops that outlive their own faults.

A round that fails is logged (one line for the I/O errors a proxy expects: a refused
connection, a full or read-only disk, a locked database; a traceback only for the unexpected)
and the loop goes on after a short pause. The same failure again is not logged again until a
round succeeds. Only cancellation ends the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, NoReturn

import aiohttp

from cacheproxy.db.connection import DATABASE_ERRORS

EXPECTED_FAULTS: tuple[type[BaseException], ...] = (
    OSError,  # TimeoutError and ConnectionError among them
    aiohttp.ClientError,
    *DATABASE_ERRORS,
)


async def repeat(
    name: str,
    one_round: Callable[[], Awaitable[object]],
    *,
    pause_s: float,
    log: logging.Logger,
    after_failure_s: float = 1.0,
) -> NoReturn:
    """Run `one_round` forever, `pause_s` apart (`after_failure_s` after a failed round, so a
    round that fails at once is never a busy loop)."""
    failing: str | None = None
    while True:
        try:
            await one_round()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
            if said != failing:
                if isinstance(exc, EXPECTED_FAULTS):
                    log.error("%s: a round failed, going on: %s", name, said)
                else:
                    log.exception("%s: a round failed, going on", name)
                failing = said
            await asyncio.sleep(after_failure_s)
            continue
        if failing is not None:
            log.info("%s: working again", name)
            failing = None
        await asyncio.sleep(pause_s)


@contextlib.asynccontextmanager
async def repeating(
    task_name: str,
    name: str,
    one_round: Callable[[], Awaitable[object]],
    *,
    pause_s: float,
    log: logging.Logger,
    after_failure_s: float = 1.0,
) -> AsyncIterator[None]:
    """`repeat` in a task named `task_name` for the duration; cancelled (and awaited) at the
    end."""
    task = asyncio.create_task(
        repeat(name, one_round, pause_s=pause_s, log=log, after_failure_s=after_failure_s),
        name=task_name,
    )
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def start_keyed(
    running: dict[str, asyncio.Task[None]],
    key: str,
    work: Coroutine[Any, Any, None],
    task_name: str,
) -> asyncio.Task[None]:
    """`work` in a task named `task_name`, kept in `running[key]` while it runs: removed when it
    ends, unless another was put in its place meanwhile (one dropped and cancelled, say)."""
    task = asyncio.create_task(work, name=task_name)
    running[key] = task

    def ended(done: asyncio.Task[None]) -> None:
        if running.get(key) is done:
            del running[key]

    task.add_done_callback(ended)
    return task
