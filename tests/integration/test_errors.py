"""Bad input and broken upstreams: a clear error in llama-server's envelope; serving goes on."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.settings import load_settings
from cacheproxy.upstreams.managed import free_port
from tests.support.servers import LlamaServer, StartServer, running_proxy
from tests.support.sse import collect_sse

PROMPT_IDS = [1, 450, 4996, 17354, 1701, 432]


async def envelope(response: aiohttp.ClientResponse) -> dict:
    document = await response.json()
    assert set(document) == {"error"}
    assert set(document["error"]) == {"code", "message", "type"}
    assert document["error"]["code"] == response.status
    return document["error"]


async def assert_serving(client: aiohttp.ClientSession, proxy_url: str) -> None:
    async with client.post(
        proxy_url + "/completion", json={"prompt": PROMPT_IDS, "n_predict": 1}
    ) as response:
        assert response.status == 200
        assert (await response.json())["tokens_predicted"] == 1


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions", "/embedding", "/slots/0"])
@pytest.mark.parametrize("body", [b"{not json", b"[1, 2, 3]", b'"a string"', b"\xff\xfe"], ids=repr)
async def test_malformed_json_is_a_400(
    client: aiohttp.ClientSession, proxy: str, path: str, body: bytes
) -> None:
    async with client.post(
        proxy + path, data=body, headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == 400
        error = await envelope(response)
    assert error["type"] == "invalid_request_error"
    await assert_serving(client, proxy)


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
async def test_empty_task_body_is_a_400(
    client: aiohttp.ClientSession, proxy: str, path: str
) -> None:
    async with client.post(proxy + path) as response:
        assert response.status == 400
        await envelope(response)


async def test_body_over_the_limit_is_a_413(
    client: aiohttp.ClientSession, llama_server: LlamaServer, tmp_path: Path
) -> None:
    settings = load_settings(upstreams=[llama_server.url], state_dir=tmp_path, max_body_bytes=4096)
    oversized = orjson.dumps({"prompt": "x" * 5000, "n_predict": 1})

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds anyway
        yield oversized

    async with running_proxy(settings) as proxy_url:
        async with client.post(proxy_url + "/completion", data=oversized) as response:
            assert response.status == 413
            await envelope(response)
        async with client.post(proxy_url + "/completion", data=chunked()) as response:
            assert response.status == 413
            await envelope(response)
        await assert_serving(client, proxy_url)


async def test_upstream_down_is_a_502_naming_it_and_recovers(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    settings = load_settings(upstreams=[upstream], state_dir=tmp_path / "state")
    async with running_proxy(settings) as proxy_url:
        # a task gets 502 at once; /health tells a load balancer 503 (nothing can serve)
        for method, path, status in (("GET", "/health", 503), ("POST", "/completion", 502)):
            async with client.request(
                method, proxy_url + path, json={"prompt": PROMPT_IDS}
            ) as response:
                assert response.status == status
                error = await envelope(response)
            assert upstream in error["message"]

        start_server(port=port)  # the upstream comes (back) up on the same address
        await assert_serving(client, proxy_url)


async def test_upstream_killed_mid_stream_ends_the_stream_with_an_error_event(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    server = start_server()
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    request = {"prompt": PROMPT_IDS, "n_predict": 3000, "ignore_eos": True, "stream": True}
    async with running_proxy(settings) as proxy_url:
        async with client.post(proxy_url + "/completion", json=request) as response:
            assert response.status == 200
            first = await response.content.readline()
            assert first.startswith(b"data: ")
            server.kill()
            payloads = await collect_sse(response)
        last = orjson.loads(payloads[-1])
        assert last["error"]["code"] == 502
        assert server.url in last["error"]["message"]

        async with client.get(proxy_url + "/health") as response:
            assert response.status == 503  # nothing can serve: still answering, in the envelope
            await envelope(response)


async def test_upstream_loading_503_is_passed_on(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """A model path that is a FIFO keeps llama-server in its loading state until it is fed:
    its HTTP side is up and answers 503, exactly as while a large model loads."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    server = start_server(model=fifo, wait=False)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    try:
        async with running_proxy(settings) as proxy_url:
            status = None
            for _ in range(200):
                async with client.get(proxy_url + "/health") as response:
                    status = response.status
                    if status == 503:
                        error = await envelope(response)
                        break
                await asyncio.sleep(0.05)
            assert status == 503
            assert error["type"] == "unavailable_error"
            async with client.post(
                proxy_url + "/completion", json={"prompt": PROMPT_IDS}
            ) as response:
                assert response.status == 503
    finally:
        # unblock the loader so the server can exit
        threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True).start()
        server.kill()
