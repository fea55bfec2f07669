"""The overhead benchmark's reference arm: the least any aiohttp reverse proxy can do.

One catch-all route reads the body, forwards it through one shared ClientSession and relays the
answer, streaming text/event-stream chunk by chunk. What cacheproxy costs above this is the price
of its own work, not of aiohttp.

`python -m cacheproxy.bench.passthrough --upstream http://127.0.0.1:8081 --port 8082`
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)
# Hop-by-hop headers, and those aiohttp recomputes for the body it sends or relays.
SKIPPED_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "host", "content-length", "content-encoding"}
)


def kept_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in SKIPPED_HEADERS)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read() if request.body_exists else None
    async with request.app[SESSION].request(
        request.method,
        request.app[UPSTREAM] + request.path_qs,
        data=body,
        headers=kept_headers(request.headers),
        allow_redirects=False,
    ) as upstream:
        headers = kept_headers(upstream.headers)
        if upstream.content_type != "text/event-stream":
            return web.Response(status=upstream.status, body=await upstream.read(), headers=headers)
        stream = web.StreamResponse(status=upstream.status, headers=headers)
        await stream.prepare(request)
        async for chunk in upstream.content.iter_any():
            await stream.write(chunk)
        await stream.write_eof()
        return stream


async def upstream_session(app: web.Application) -> AsyncIterator[None]:
    # The same connection pool settings as cacheproxy's, so the two arms differ only in handling.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)
    ) as session:
        app[SESSION] = session
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="base URL of the llama-server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application(client_max_size=100 << 20)
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(upstream_session)
    app.router.add_route("*", "/{tail:.*}", relay)
    web.run_app(
        app, host=args.host, port=args.port, handler_cancellation=True, access_log=None, print=None
    )


if __name__ == "__main__":
    main()
