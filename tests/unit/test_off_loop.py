"""A store's async twin (cacheproxy/db/off_loop.py): the blocking method, run on a worker
thread, with its arguments, result and errors as they are."""

from __future__ import annotations

import threading

import pytest

from cacheproxy.db.off_loop import off_loop


class Store:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def put(self, key: int, value: int = 0) -> int:
        """Put it."""
        self.calls.append((threading.current_thread().name, key, value))
        if key < 0:
            raise KeyError(key)
        return key + value

    aput = off_loop(put)


class LoudStore(Store):
    def put(self, key: int, value: int = 0) -> int:
        return 10 * super().put(key, value)


async def test_the_twin_runs_the_method_on_a_worker_thread() -> None:
    store = Store()
    assert await store.aput(1, value=2) == 3
    [(thread, key, value)] = store.calls
    assert thread != threading.current_thread().name and (key, value) == (1, 2)
    with pytest.raises(KeyError):
        await store.aput(-1)


async def test_the_twin_runs_a_subclass_override() -> None:
    assert await LoudStore().aput(1, 2) == 30


def test_the_twin_is_named_for_its_method() -> None:
    assert Store.aput.__name__ == "aput"
    assert Store.aput.__qualname__ == "Store.aput"
    assert "`put` on a worker thread" in (Store.aput.__doc__ or "")
