"""The overhead benchmark's reference arm: the least any aiohttp reverse proxy can do.

One catch-all route reads the body, forwards it through one shared ClientSession and relays the
answer, streaming text/event-stream chunk by chunk. What cacheproxy costs above this is the price
of its own work, not of aiohttp.

With `--burn-us N` it also spins N microseconds of its thread's CPU on each request before
forwarding it: the benchmark's calibration arm, whose throughput against the plain pass-through
says what each microsecond of a front's CPU per request costs on this machine. With `--ca-file`,
an https upstream is checked against that CA (`--upstream-tls`).

`python -m cacheproxy.bench.passthrough --upstream http://127.0.0.1:8081 --port 8082`
"""

from __future__ import annotations

import argparse
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

UPSTREAM = web.AppKey("upstream", str)
UPSTREAM_TLS = web.AppKey("upstream_tls", ssl.SSLContext)  # unset: the system's CAs
SESSION = web.AppKey("session", aiohttp.ClientSession)
FRESH_SESSION = web.AppKey("fresh_session", aiohttp.ClientSession)  # a new connection each time
# Hop-by-hop headers, and those aiohttp recomputes for the body it sends or relays.
SKIPPED_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "host", "content-length", "content-encoding"}
)


def kept_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in SKIPPED_HEADERS)


async def send(request: web.Request, body: bytes | None) -> aiohttp.ClientResponse:
    """Send upstream, once more on a new connection if the pooled one was dead (the server
    may close a kept-alive connection as it is taken): the request never reached the server,
    so sending it again is safe, as cacheproxy does."""
    url = request.app[UPSTREAM] + request.path_qs
    headers = kept_headers(request.headers)
    try:
        return await request.app[SESSION].request(
            request.method, url, data=body, headers=headers, allow_redirects=False
        )
    except aiohttp.ClientConnectorError:
        raise  # refused: the server is down, not a dead pooled connection
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return await request.app[FRESH_SESSION].request(
            request.method, url, data=body, headers=headers, allow_redirects=False
        )


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read() if request.body_exists else None
    async with await send(request, body) as upstream:
        headers = kept_headers(upstream.headers)
        if upstream.content_type != "text/event-stream":
            return web.Response(status=upstream.status, body=await upstream.read(), headers=headers)
        stream = web.StreamResponse(status=upstream.status, headers=headers)
        await stream.prepare(request)
        async for chunk in upstream.content.iter_any():
            await stream.write(chunk)
        upstream.close()  # never back to the pool: the server closes it (as cacheproxy does)
        await stream.write_eof()
        return stream


async def upstream_session(app: web.Application) -> AsyncIterator[None]:
    # The same connection pool settings as cacheproxy's, so the two arms differ only in handling:
    # llama-server drops idle keep-alive connections after 5 s, so they are given up sooner.
    tls: ssl.SSLContext | bool = app.get(UPSTREAM_TLS, True)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0, ssl=tls)
    timeout = aiohttp.ClientTimeout(total=None)
    async with (
        aiohttp.ClientSession(
            connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)
        ) as session,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True, ssl=tls),
            timeout=timeout,
            skip_auto_headers=("User-Agent",),
        ) as fresh_session,
    ):
        app[SESSION], app[FRESH_SESSION] = session, fresh_session
        yield


def burning(burn_us: float) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`relay`, after spinning `burn_us` microseconds of the thread's CPU (not of the clock: a
    loaded machine makes it take longer, never cost less)."""
    burn_s = burn_us / 1e6

    async def burn_then_relay(request: web.Request) -> web.StreamResponse:
        until = time.thread_time() + burn_s
        while time.thread_time() < until:
            pass
        return await relay(request)

    return burn_then_relay


def create_app(upstream: str, burn_us: float = 0.0, ca_file: str | None = None) -> web.Application:
    app = web.Application(client_max_size=100 << 20)
    app[UPSTREAM] = upstream.rstrip("/")
    if ca_file is not None:
        app[UPSTREAM_TLS] = ssl.create_default_context(cafile=ca_file)
    app.cleanup_ctx.append(upstream_session)
    app.router.add_route("*", "/{tail:.*}", burning(burn_us) if burn_us > 0 else relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="base URL of the llama-server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--burn-us", type=float, default=0.0, help="CPU microseconds spun on each request"
    )
    parser.add_argument("--ca-file", help="the CA an https upstream is checked against")
    args = parser.parse_args()
    app = create_app(args.upstream, args.burn_us, args.ca_file)
    web.run_app(
        app, host=args.host, port=args.port, handler_cancellation=True, access_log=None, print=None
    )


if __name__ == "__main__":
    main()
