"""Slow and idle clients: how long a connection may take before the proxy cuts it.

- Idle connections, and request heads that never complete (a half request line, headers sent a
  byte at a time): aiohttp's keep-alive timer, armed when a connection opens and after every
  answer, closes the connection if no complete request head has arrived by then; bytes arriving
  do not extend it. `runner_options` hands it to the runner (`cacheproxy serve` and the tests).
- Request bodies: aiohttp reads them without any deadline, so the front door
  (`http/front_door.py`) runs `watch_body` beside a handler whose body is still arriving, and,
  when the client pauses longer than `body_timeout_s`, falls below `body_min_bytes_per_s`
  once that grace time is over, or is still sending after `body_max_s` in all, answers 408
  and closes the connection. The rate alone would let a body take hours: every byte received
  buys time, so 60 MB sent fast and then trickled is allowed some 17 hours.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from cacheproxy.settings import ClientSettings

CHECK_INTERVAL_S = 0.5


def runner_options(settings: ClientSettings) -> dict[str, Any]:
    """Keyword arguments for `web.AppRunner` / `web.run_app`."""
    return {"keepalive_timeout": settings.keepalive_timeout_s}


class SlowBody(TimeoutError):
    """Set on a request's body stream when the client sends it too slowly.

    A TimeoutError, so that aiohttp's lingering read of an unfinished body after the answer
    takes it as the timeout it is and closes the connection quietly."""


def body_deadline(
    settings: ClientSettings, started: float, last_byte: float, received: int
) -> float:
    """When a body that started at `started`, last grew at `last_byte` and holds `received`
    bytes is too slow: a pause of body_timeout_s, a rate below body_min_bytes_per_s, or
    body_max_s in all."""
    deadline = min(last_byte + settings.body_timeout_s, started + settings.body_max_s)
    if settings.body_min_bytes_per_s:
        rate_deadline = started + settings.body_timeout_s + received / settings.body_min_bytes_per_s
        deadline = min(deadline, rate_deadline)
    return deadline


async def watch_body(request: web.Request, settings: ClientSettings) -> None:
    """Fail the request's body stream with `SlowBody` once it arrives too slowly."""
    loop = asyncio.get_running_loop()
    body = request.content
    started = last_byte = loop.time()
    received = body.total_bytes
    while not body.is_eof():
        now = loop.time()
        if body.total_bytes != received:
            received, last_byte = body.total_bytes, now
        deadline = body_deadline(settings, started, last_byte, received)
        if now >= deadline:
            body.set_exception(SlowBody(_too_slow(settings, received, now - started)))
            return
        await asyncio.sleep(min(CHECK_INTERVAL_S, deadline - now))


def _too_slow(settings: ClientSettings, received: int, elapsed_s: float) -> str:
    if elapsed_s >= settings.body_max_s:
        return (
            f"request body not complete within {settings.body_max_s:g} s"
            f" ({received} bytes received)"
        )
    return f"request body too slow: {received} bytes in {elapsed_s:.0f} s"
