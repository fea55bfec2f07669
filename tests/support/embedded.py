"""The embedded engine on a loopback port, for tests that talk to it over HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cacheproxy.embedded.server import EmbeddedServer
from cacheproxy.settings import EmbeddedSettings


@contextlib.asynccontextmanager
async def embedded(
    model: Path, workdir: Path, *, parallel: int = 2, **settings: Any
) -> AsyncIterator[EmbeddedServer]:
    server = EmbeddedServer(
        EmbeddedSettings(parallel=parallel, ctx_size=2048 * parallel, threads=1, **settings),
        model,
        workdir,
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
