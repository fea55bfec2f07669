"""A store's async twin of a blocking method: the same call, run on a worker thread.

Stores own their threads, as Datasette's `Database.execute_fn` does: a caller on the event loop
awaits `store.acreate(...)` and never hops threads itself, while `store.create(...)` stays the
blocking call for code that runs no event loop (the command line, start-up checks, tests). The
twin waits for the store's own lock, and for the database, on the worker thread: each store
keeps its one connection and its writer discipline as they are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

Args = ParamSpec("Args")
Result = TypeVar("Result")
Store = TypeVar("Store")


def off_loop(
    method: Callable[Concatenate[Store, Args], Result],
) -> Callable[Concatenate[Store, Args], Coroutine[Any, Any, Result]]:
    """`method`'s async twin, for a class body: `aupdate = off_loop(update)`.

    The method is looked up on the instance at each call, so a subclass that overrides it is
    run as it would be when called directly."""
    name = method.__name__

    async def twin(store: Store, *args: Args.args, **kwargs: Args.kwargs) -> Result:
        return await asyncio.to_thread(getattr(store, name), *args, **kwargs)

    twin.__name__ = "a" + name
    owner = method.__qualname__.rpartition(".")[0]
    twin.__qualname__ = f"{owner}.a{name}" if owner else f"a{name}"
    twin.__doc__ = f"`{name}` on a worker thread, for callers on the event loop."
    return twin
