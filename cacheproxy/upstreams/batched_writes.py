"""Requests to the upstreams written together, at the end of the event loop's step that made them.

Why: llama-server's compute threads keep the CPUs busy, and a write that wakes one of its HTTP
threads often hands that thread the CPU the proxy runs on: the proxy then waits, mid-way
through the other requests of its step, and its requests reach the server one by one, each
in a batch of its own. Held until the step's other callbacks have run, the step's requests go
out back to back: the proxy is not cut off between them, and the server takes them into one
batch (measured: docs/drop-in.md, "Requests go out together").

A request is handed to its connection's transport in the order it was made, and its sender
is told it was sent (`on_sent`: the server will have all of it) only then. Its write waits for
no I/O: at most for the callbacks already due in the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class BatchedWrites:
    """Writes held until the end of the loop step that asked for them, then made in order."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []

    def add(self, loop: asyncio.AbstractEventLoop, write: Callable[[], None]) -> None:
        """Make `write` once the callbacks the loop has due now have run."""
        if not self._pending:
            loop.call_soon(self._write_all)
        self._pending.append(write)

    def _write_all(self) -> None:
        pending, self._pending = self._pending, []
        for write in pending:
            write()
