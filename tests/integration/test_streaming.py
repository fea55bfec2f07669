"""SSE through the proxy: every event, in order, as it arrives; a client that leaves frees it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.settings import load_settings
from tests.support.servers import LlamaServer, StartServer, running_proxy, start_llama_server
from tests.support.sse import collect_sse, sse_payloads
from tests.support.upstream_slots import (
    SLOTS_POLL_S,
    generated_by_last_task,
    slots,
    wait_until_idle,
)

PROMPT_IDS = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366]
# Many seconds of generation (ignore_eos keeps it going), so a request that is not cancelled
# is still running, or has visibly run to the end, when the test looks.
LONG_GENERATION = {"prompt": PROMPT_IDS, "n_predict": 30000, "ignore_eos": True, "stream": True}
CANCEL_WAIT_S = 10.0


@pytest.fixture(scope="module")
def long_server(
    llama_server_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """Two slots of 32k tokens each, room for a generation that outlasts the test's patience."""
    server = start_llama_server(
        llama_server_binary, tiny_model, tmp_path_factory.mktemp("long"), parallel=2, ctx_size=65536
    )
    yield server
    server.stop()


@pytest.fixture
async def long_proxy(long_server: LlamaServer, tmp_path: Path) -> AsyncIterator[str]:
    settings = load_settings(upstreams=[long_server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        yield url


def event_contents(payloads: list[str]) -> list[str]:
    """What each event says, with clocks and ids taken out, so two runs can be compared."""
    contents = []
    for payload in payloads:
        if payload == "[DONE]":
            contents.append(payload)
            continue
        event = orjson.loads(payload)
        if "choices" in event:
            contents.append(
                orjson.dumps([choice.get("delta") for choice in event["choices"]]).decode()
            )
        else:
            contents.append(orjson.dumps([event.get("content"), event.get("stop")]).decode())
    return contents


@pytest.mark.parametrize(
    ("path", "body", "ends_with_done"),
    [
        ("/completion", {"prompt": PROMPT_IDS}, False),
        ("/v1/completions", {"prompt": "The sky is"}, True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, True),
    ],
)
async def test_stream_is_complete_and_in_order(
    client: aiohttp.ClientSession,
    llama_server: LlamaServer,
    proxy: str,
    path: str,
    body: dict,
    ends_with_done: bool,
) -> None:
    request = {**body, "stream": True, "n_predict": 24, "temperature": 0, "cache_prompt": False}
    async with client.post(llama_server.url + path, json=request) as response:
        direct = await collect_sse(response)
    async with client.post(proxy + path, json=request) as response:
        assert response.content_type == "text/event-stream"
        proxied = await collect_sse(response)
    assert len(proxied) >= 24
    assert event_contents(proxied) == event_contents(direct)
    assert (proxied[-1] == "[DONE]") is ends_with_done


async def test_events_are_forwarded_while_generation_runs(
    client: aiohttp.ClientSession, long_server: LlamaServer, long_proxy: str
) -> None:
    """The first event reaches the client while the server still generates: nothing is held back."""
    async with client.post(long_proxy + "/completion", json=LONG_GENERATION) as response:
        first = await anext(sse_payloads(response))
        assert orjson.loads(first)["stop"] is False
        assert any(slot["is_processing"] for slot in await slots(client, long_server))
    await wait_until_idle(client, long_server, within_s=CANCEL_WAIT_S)


async def test_client_disconnect_cancels_the_stream(
    client: aiohttp.ClientSession, long_server: LlamaServer, long_proxy: str
) -> None:
    await wait_until_idle(client, long_server, within_s=CANCEL_WAIT_S)
    response = await client.post(long_proxy + "/completion", json=LONG_GENERATION)
    await anext(sse_payloads(response))
    response.close()  # drop the connection mid-stream
    state = await wait_until_idle(client, long_server, within_s=CANCEL_WAIT_S)
    assert 0 < generated_by_last_task(state, len(PROMPT_IDS)) < LONG_GENERATION["n_predict"]


async def test_client_disconnect_cancels_a_non_streaming_request(
    client: aiohttp.ClientSession, long_server: LlamaServer, long_proxy: str
) -> None:
    """llama-server notices a closed connection of a non-streaming request only when its result
    queue has been silent for a whole second (server-queue.cpp, recv_with_timeout): any other
    result, a GET /slots included, restarts that wait. So the test leaves the server alone
    for a few seconds after the disconnect before it looks."""
    await wait_until_idle(client, long_server, within_s=CANCEL_WAIT_S)
    # its own session: closing it closes the socket, as a client process that exits would
    leaving = aiohttp.ClientSession()
    pending = asyncio.ensure_future(
        leaving.post(long_proxy + "/completion", json={**LONG_GENERATION, "stream": False})
    )
    deadline = time.monotonic() + 10
    while not any(slot["is_processing"] for slot in await slots(client, long_server)):
        assert time.monotonic() < deadline, "the request never reached a slot"
        await asyncio.sleep(SLOTS_POLL_S)
    pending.cancel()
    await leaving.close()
    # looked at only after 1.5 s of silence each time, for as long as a loaded machine needs
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        await asyncio.sleep(1.5)
        state = await slots(client, long_server)
        if not any(slot["is_processing"] for slot in state):
            break
        assert time.monotonic() < deadline, "the request left by its client kept its slot"
    assert 0 < generated_by_last_task(state, len(PROMPT_IDS)) < LONG_GENERATION["n_predict"]


async def test_conversation_id_header_does_not_keep_the_slot_busy(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """llama-server keeps a stream with X-Conversation-Id alive after the client leaves; the
    proxy strips the header, so leaving frees the slot. Both halves run on one fresh server."""
    server = start_server()
    headers = {"X-Conversation-Id": "conversation-1"}
    request = {**LONG_GENERATION, "n_predict": 2000}  # short enough to wait for its end

    # direct: the header keeps generation running after the disconnect (the trap being avoided)
    response = await client.post(server.url + "/completion", json=request, headers=headers)
    await anext(sse_payloads(response))
    response.close()
    await asyncio.sleep(0.5)
    assert any(slot["is_processing"] for slot in await slots(client, server))
    state = await wait_until_idle(client, server, within_s=600)
    assert generated_by_last_task(state, len(PROMPT_IDS)) == request["n_predict"]

    # through the proxy: the disconnect ends it early
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as proxy_url:
        response = await client.post(proxy_url + "/completion", json=request, headers=headers)
        await anext(sse_payloads(response))
        response.close()
        state = await wait_until_idle(client, server, within_s=120)
    assert 0 < generated_by_last_task(state, len(PROMPT_IDS)) < request["n_predict"]


async def test_back_to_back_streams_and_requests_all_succeed(
    client: aiohttp.ClientSession, proxy: str
) -> None:
    """llama-server closes the connection after each stream although it announces keep-alive;
    the proxy must never hand that dead connection to the next request."""
    stream = {"prompt": PROMPT_IDS, "n_predict": 4, "stream": True}
    plain = {"prompt": PROMPT_IDS, "n_predict": 1}
    for _ in range(30):
        async with client.post(proxy + "/completion", json=stream) as response:
            assert response.status == 200
            events = await collect_sse(response)
            assert len(events) == 4 + 1  # a token per event, then the final one
            assert orjson.loads(events[-1])["stop"] is True
        async with client.post(proxy + "/completion", json=plain) as response:
            assert response.status == 200, await response.text()
