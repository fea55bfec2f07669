"""A client that leaves a stream, right after its last event or half-way, costs nothing after.

For every streamed shape, a raw-socket client reads up to a point and drops the connection at
once; the next request is then served within 2 s (no slot or upstream stays leased), and SIGTERM
still stops `cacheproxy serve`. The proxy runs as its own process, as in production, in front of
a real llama-server whose model has fill-in-the-middle tokens, so `/infill` streams too.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.provision.make_model import ensure_model
from tests.support.raw_http import body_until, open_connection, read_head, request_bytes
from tests.support.serve_process import start_serve
from tests.support.servers import LlamaServer, start_llama_server

NEXT_REQUEST_S = 2.0
SHUTDOWN_TIMEOUT_S = 4.0
EXIT_MARGIN_S = 6.0  # closing the session and the databases after the deadline
MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
GENERATE = {"max_tokens": 24, "temperature": 0}


@dataclass(frozen=True)
class Shape:
    path: str
    body: dict
    last_event: bytes  # what the stream's last event carries
    first_event: bytes = b"data: "


SHAPES = {
    "chat": Shape("/v1/chat/completions", {"messages": MESSAGES, **GENERATE}, b"[DONE]"),
    "completion": Shape(
        "/completion", {"prompt": "Once upon a time", "n_predict": 24}, b'"stop":true'
    ),
    "oai-completion": Shape(
        "/v1/completions", {"prompt": "Once upon a time", **GENERATE}, b"[DONE]"
    ),
    "chat-n2": Shape("/v1/chat/completions", {"messages": MESSAGES, "n": 2, **GENERATE}, b"[DONE]"),
    "messages": Shape(
        "/v1/messages", {"model": "m", "messages": MESSAGES, **GENERATE}, b"message_stop"
    ),
    "responses": Shape(
        "/v1/responses",
        {"model": "m", "input": "Tell me a story.", "max_output_tokens": 24, "temperature": 0},
        b"response.completed",
    ),
    "infill": Shape(
        "/infill",
        {"input_prefix": "def area(r):\n    return", "input_suffix": "\n", "n_predict": 24},
        b'"stop":true',
    ),
}


@pytest.fixture(scope="module")
def fim_server(
    llama_server_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """Two slots and a model that can infill; shared: every test leaves it idle."""
    workdir = tmp_path_factory.mktemp("close")
    server = start_llama_server(
        llama_server_binary, ensure_model("small", fim=True), workdir, parallel=2, ctx_size=4096
    )
    yield server
    server.stop()


async def leave_stream(url: str, shape: Shape, after: bytes) -> None:
    """Send the shape's stream request, read until `after` has arrived, and drop the socket."""
    reader, writer = await open_connection(url)
    body = orjson.dumps({**shape.body, "stream": True})
    try:
        writer.write(request_bytes("POST", shape.path, body=body))
        await writer.drain()
        status, headers = await asyncio.wait_for(read_head(reader), 30)
        assert status == 200, (await reader.read()).decode(errors="replace")
        assert headers.get("content-type", "").startswith("text/event-stream")
        read = await asyncio.wait_for(body_until(reader, headers, after), 30)
        assert after in read, read.decode(errors="replace")
    finally:
        writer.close()  # at once: no reading what follows


async def one_token(url: str, timeout_s: float) -> float:
    """How long a one-token completion of token ids takes (no tokenization round trip)."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as client:
        body = {"prompt": [1, 15043], "n_predict": 1}
        async with client.post(
            url + "/completion", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            assert response.status == 200, await response.text()
            await response.read()
    return time.monotonic() - started


async def served_in_time(url: str, server: LlamaServer) -> None:
    """The proxy must answer within NEXT_REQUEST_S more than the server alone takes for the
    same request just before (on a busy host the server's own time is not a wait in the proxy;
    a leaked lease makes the proxy wait for ever)."""
    direct_s = await one_token(server.url, 30)
    took = await one_token(url, NEXT_REQUEST_S + direct_s)
    assert took < NEXT_REQUEST_S + direct_s


@pytest.mark.parametrize("name", list(SHAPES))
async def test_leaving_a_stream_frees_everything(
    name: str, fim_server: LlamaServer, tmp_path: Path
) -> None:
    shape = SHAPES[name]
    proxy = await start_serve(
        tmp_path,
        "--upstream",
        fim_server.url,
        env={"CACHEPROXY_SHUTDOWN_TIMEOUT_S": str(SHUTDOWN_TIMEOUT_S)},
    )
    try:
        await served_in_time(
            proxy.url, fim_server
        )  # the first request also opens the proxy's connections
        for _ in range(3):  # the race with the end of the stream, more than once
            await leave_stream(proxy.url, shape, shape.last_event)
            await served_in_time(proxy.url, fim_server)
            await leave_stream(proxy.url, shape, shape.first_event)
            await served_in_time(proxy.url, fim_server)
        proxy.process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(proxy.process.wait(), SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S)
        except TimeoutError:
            pytest.fail(f"still running after SIGTERM:\n{proxy.log()[-3000:]}")
        assert code == 0, proxy.log()[-3000:]
    finally:
        await proxy.stop()
