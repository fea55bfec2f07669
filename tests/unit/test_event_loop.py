"""The proxy's event loop: uvloop when it can be imported, asyncio's own when asked for."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from cacheproxy.ops.event_loop import EventLoopUnavailable, loop_factory


def run_on(factory: object) -> type:
    async def kind() -> type:
        return type(asyncio.get_running_loop())

    with asyncio.Runner(loop_factory=factory) as runner:  # type: ignore[arg-type]
        return runner.run(kind())


@pytest.mark.parametrize("choice", ["auto", "uvloop"])
def test_uvloop_is_run_when_it_can_be_imported(choice: str) -> None:
    name, factory = loop_factory(choice)  # type: ignore[arg-type]
    assert name == "uvloop"
    assert run_on(factory) is uvloop.Loop


def test_asyncio_is_run_when_asked_for() -> None:
    name, factory = loop_factory("asyncio")
    assert name == "asyncio"
    assert not issubclass(run_on(factory), uvloop.Loop)


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes `import uvloop` fail
    assert loop_factory("auto")[0] == "asyncio"
    with pytest.raises(EventLoopUnavailable, match="uvloop cannot be imported"):
        loop_factory("uvloop")
