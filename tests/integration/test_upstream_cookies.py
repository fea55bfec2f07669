"""A cookie set in one answer is never sent with another request: the proxy keeps no cookies.

llama-server sets none, but a relay or gateway in front of it may (a load balancer's stickiness
cookie, an auth gateway's session). A client-side cookie jar in the proxy would replay what one
tenant's answer set on every later request, another tenant's included. The relay here is a real
HTTP server on a loopback port in front of a real llama-server; it is reached by the name
`localhost`, since a cookie jar keeps no cookies of a bare IP address.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from cacheproxy.upstreams.relay import HOP_BY_HOP
from tests.support.servers import StartServer, serving_tenants


@pytest.fixture
async def cookie_relay(
    start_server: StartServer,
) -> AsyncIterator[tuple[str, list[str | None]]]:
    """A relay to a llama-server that sets a session cookie in every answer, and the Cookie
    header of every request it was sent."""
    server = start_server(parallel=1)
    seen: list[str | None] = []

    async def relay(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Cookie"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with upstream.request(
            request.method,
            server.url + request.rel_url.raw_path_qs,
            data=await request.read(),
            headers=headers,
        ) as answer:
            reply = web.StreamResponse(status=answer.status)
            for name, value in answer.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    reply.headers.add(name, value)
            reply.set_cookie("gateway_session", f"issued-{len(seen)}")
            await reply.prepare(request)
            async for piece in answer.content.iter_any():
                await reply.write(piece)
            await reply.write_eof()
            return reply

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app)
    # a connection per request: llama-server closes one after each stream although it announces
    # keep-alive, and the relay's pool could hand that dead connection to the next request
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), connector=connector
    ) as upstream:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://localhost:{runner.addresses[0][1]}", seen
        await runner.cleanup()


async def test_no_cookie_an_answer_set_is_sent_with_a_later_request(
    cookie_relay: tuple[str, list[str | None]], tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    relay_url, seen = cookie_relay
    async with serving_tenants(relay_url, tmp_path) as (url, registry):
        keys = [registry.create(name)[1] for name in ("alice", "bob")]
        for key in keys:
            for stream in (False, True):
                body = {"prompt": "Once upon a time", "n_predict": 4, "stream": stream}
                headers = {"Authorization": f"Bearer {key}"}
                async with client.post(url + "/completion", json=body, headers=headers) as answer:
                    assert answer.status == 200
                    await answer.read()
                    # the client gets the relay's cookie, as it would talking to it directly
                    assert answer.cookies["gateway_session"].value.startswith("issued-")
    assert len(seen) > 4  # the probes, the health checks and the four completions
    assert [cookie for cookie in seen if cookie is not None] == []
