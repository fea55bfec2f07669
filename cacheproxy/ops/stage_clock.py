"""A clock on each request's stages, for a benchmark's breakdown of what the proxy adds.

Off by default, and then it costs nothing: nothing of it is made, no method is wrapped, no
middleware added (the request path only reads the tracer's `enabled`, as it does already).
On (`[tracing] stage_clock = true`), it is the app's tracer: the spans the request path opens
(auth, mirror, queue, upstream, disk.save, disk.restore, chunk) are timed, and so are the
stages that have no span, their objects' methods wrapped once at start (`instrument`), and the
front door, by a middleware outside it and one inside it. Each stage's time is counted, wall
clock and the loop thread's CPU, into `cacheproxy_stage_seconds_total{stage,clock}` with its
entries in `cacheproxy_stage_entries_total{stage}`. Times are inclusive: `forward` holds
`upstream`, `place` holds `queue` (of which `cacheproxy_queue_wait_seconds` is the waiting),
`disk` its saves and restores; `request` the whole request and `handler` all but the front
door. The thread's CPU counts whatever else the loop ran meanwhile: it is a stage's own only
when requests come one at a time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.tracing import RequestTracer, Stage

_STAGE = Stage()


class _Timing:
    """One stage being timed."""

    __slots__ = ("_clock", "_cpu", "_name", "_wall")

    def __init__(self, clock: StageClock, name: str) -> None:
        self._clock = clock
        self._name = name
        self._wall = 0.0
        self._cpu = 0.0

    def __enter__(self) -> Stage:
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()
        return _STAGE

    def __exit__(self, *exc_info: object) -> None:
        cpu = time.thread_time() - self._cpu
        self._clock.add(self._name, time.perf_counter() - self._wall, cpu)


class StageClock(RequestTracer):
    """The tracer that times stages into the proxy's metrics."""

    enabled = True

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def span(
        self, name: str, **attributes: str | int | float | bool | None
    ) -> contextlib.AbstractContextManager[Stage]:
        return _Timing(self, name)

    def add(self, name: str, wall_s: float, cpu_s: float) -> None:
        metrics = self.metrics
        metrics.count(
            (metrics.stage_seconds, (name, "wall"), wall_s),
            (metrics.stage_seconds, (name, "cpu"), cpu_s),
            (metrics.stage_entries, (name,), 1),
        )

    def instrument(self, target: object, stages: dict[str, str]) -> None:
        """Time `target`'s methods as the stages named (method name -> stage), by wrapping
        them on the object itself (its class, and every other object of it, stay as they
        are)."""
        for method_name, stage in stages.items():
            method = getattr(target, method_name)
            setattr(target, method_name, self._timed(method, stage))

    def _timed(self, method: Callable[..., Any], stage: str) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def timed_coroutine(*args: Any, **kwargs: Any) -> Any:
                with _Timing(self, stage):
                    return await method(*args, **kwargs)

            return timed_coroutine

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with _Timing(self, stage):
                return method(*args, **kwargs)

        return timed

    def middleware(self, stage: str) -> Callable[[web.Request, Handler], Awaitable[Any]]:
        """A middleware timing what runs inside it as `stage`."""

        @web.middleware
        async def time_stage(request: web.Request, handler: Handler) -> web.StreamResponse:
            with _Timing(self, stage):
                return await handler(request)

        return time_stage
