"""Which event loop the proxy runs on.

uvloop (libuv) runs the same asyncio code with a cheaper loop of its own, as uvicorn does by
default. The proxy's loop is a small share of its CPU a request (most is the request's own
Python work), so the gain is small; the proxy runs on either, and its upstream client is tested
on both. The standard loop stays a choice (`event_loop = "asyncio"`), and is what `auto` falls
back to without uvloop.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from typing import Literal

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


class EventLoopUnavailable(RuntimeError):
    """`event_loop = "uvloop"` was asked for and uvloop cannot be imported."""


def loop_factory(choice: EventLoopChoice) -> tuple[str, LoopFactory]:
    """The loop's name and a factory for it: uvloop when asked for (or, for `auto`, when it
    can be imported), else the standard loop."""
    if choice != "asyncio":
        try:
            uvloop = importlib.import_module("uvloop")
        except ImportError as exc:
            if choice == "uvloop":
                raise EventLoopUnavailable(
                    f'event_loop = "uvloop" but uvloop cannot be imported ({exc}); install it'
                    ' or choose "auto" or "asyncio"'
                ) from exc
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop
