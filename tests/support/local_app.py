"""A small aiohttp app served on a real socket on 127.0.0.1, for tests that need a server to
answer exactly as scripted (a 500, a metrics page) where llama-server cannot be made to."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    """`app` on a free port of 127.0.0.1, its base URL yielded until the block ends."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
