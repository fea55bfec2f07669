"""Tasks started beside a request, held until they end, and waited for at a stop.

The event loop keeps only weak references to its tasks: one started and not awaited may be
collected before it ends. Work that must finish although nobody awaits it (a commit after a
save, the settling of a cut task, a file given back) is held here, and a stop waits for it
within its deadline, before what it needs (the store, the server's slots) goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class HeldTasks:
    """A set of tasks, each held from its start until it ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, work: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """`work` in a task of its own named `name`, held until it ends."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout_s: float | None) -> None:
        """Those under way end, for `timeout_s` at most (None: however long they take)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def cancel(self) -> None:
        """Those still under way are cancelled, and their ends awaited."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))
