"""Reading server-sent events as a client does, one `data:` payload at a time."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp


async def sse_payloads(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Yield each event's `data:` payload (`[DONE]` included); comments and pings are skipped."""
    async for raw_line in response.content:
        line = raw_line.decode().rstrip("\r\n")
        if line.startswith("data: "):
            yield line[len("data: ") :]


async def collect_sse(response: aiohttp.ClientResponse) -> list[str]:
    return [payload async for payload in sse_payloads(response)]
