"""The one middleware every request goes through: the proxy's per-request jobs in one pass.

Each job's rules live with its concern; this module runs them in order, outermost first, in
one coroutine (six middlewares cost a frame, a partial and an await each, per request):

1. the canonical path (`http/paths.py`): an unsafe one gets 400; a request whose path is not
   canonical goes through the app again as a clone at the canonical path (it then passes this
   door again, and the first pass does nothing else);
2. shutdown tracking (`ops/shutdown.py`): what runs, so a stop can cut it and name it;
3. the slow-body guard (`http/clients.py`): a body still arriving is watched, 408 when too slow;
4. the request timer (`ops/metrics.py`), labelled by route;
5. the error envelope (`http/errors.py`): the proxy's errors and aiohttp's own as llama-server's;
6. a stale tenant registry re-read off the loop (`TenantRegistry.arefresh`) before the handler
   reads it.

Between 1 and 2, a cluster's hand-off header (`X-Cacheproxy-Handoff`) is taken off the request
(a copy without it goes on), its value kept aside for the task route to check.

Tracing, when on, is its own middleware inside this one (around the handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from yarl import URL

from cacheproxy.cluster.handoff import HANDOFF_HEADER, HANDOFF_PROOF
from cacheproxy.errors import ApiError
from cacheproxy.http.app_keys import REGISTRY
from cacheproxy.http.clients import SlowBody, watch_body
from cacheproxy.http.errors import (
    api_error_response,
    error_response,
    http_exception_response,
)
from cacheproxy.http.paths import UnsafePath, canonical_target
from cacheproxy.ops.metrics import ProxyMetrics, route_label
from cacheproxy.ops.shutdown import ShutdownClock
from cacheproxy.settings import ClientSettings
from cacheproxy.upstreams.relay import UPSTREAM_TARGET


def front_door(
    app: web.Application, clock: ShutdownClock, clients: ClientSettings, metrics: ProxyMetrics
) -> Middleware:
    """The middleware of `app` (its sub-apps' requests pass it too)."""

    @web.middleware
    async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
        # 1. the canonical path, before anything else has run on the first match
        raw_path = request.raw_path
        try:
            target = canonical_target(raw_path)
        except UnsafePath as exc:
            return error_response(400, f"invalid request path: {exc}")
        if target != raw_path:
            return await _rerouted(request, target)
        if HANDOFF_HEADER in request.headers:
            # the cluster's hand-off header, off the request before anything reads it
            stripped = _without_handoff_header(request)
            response = await front(stripped, handler)
            if not response.prepared:
                # aiohttp would prepare it with the request as received, not the copy whose
                # admission the rate-limit headers read
                await response.prepare(stripped)
            return response
        request[UPSTREAM_TARGET] = target
        # 2. tracked for the shutdown clock (the query never shows: it may hold a key)
        what = f"{request.method} {request.path}"
        key = clock.track(what, asyncio.current_task())
        started = time.perf_counter()
        # 3. a body not yet all here is watched while the handler reads it
        watchdog = None
        if request.body_exists and not request.content.is_eof():
            watchdog = asyncio.create_task(watch_body(request, clients), name="slow-body-watchdog")
        try:
            try:
                # 5. answered in the envelope; 6. the registry fresh for the handler's reads
                registry = app.get(REGISTRY)
                if registry is not None and registry.snapshot_is_stale():
                    await registry.arefresh()
                return await handler(request)
            except ApiError as exc:
                return api_error_response(request, exc)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return http_exception_response(request, exc)
        except SlowBody as exc:
            response = error_response(408, str(exc), "invalid_request_error")
            response.force_close()
            return response
        except asyncio.CancelledError:
            clock.note_cut(what, key)
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watchdog
            # 4. timed by route, the envelope's answers included
            timer = metrics.child(metrics.request_seconds, route_label(request))
            timer.observe(time.perf_counter() - started)
            clock.untrack(key)

    return front


def _without_handoff_header(request: web.Request) -> web.Request:
    """The request without `X-Cacheproxy-Handoff`, its value kept aside for the task route to
    check (cluster/handoff.py): a client's own is never trusted, nor sent to a server."""
    headers = request.headers.copy()
    proof = headers.popall(HANDOFF_HEADER)[-1]
    stripped = request.clone(headers=headers)
    stripped[HANDOFF_PROOF] = proof
    return stripped


async def _rerouted(request: web.Request, target: str) -> web.StreamResponse:
    """aiohttp matched the route on the path as received and has no public way to match again:
    the request is handed to the app again as a clone at `target`, so that router, handlers
    and `forward` all see that one path."""
    # the first match has answered any `Expect: 100-continue` already
    headers = request.headers.copy()
    headers.popall(hdrs.EXPECT, None)
    rerouted = request.clone(rel_url=URL(target, encoded=True), headers=headers)
    return await request.app._handle(rerouted)  # aiohttp's own dispatch: no public one
