"""`/v1/responses` through the slot table, against real llama-servers.

The proxy converts each Responses body to the chat body llama-server runs it as, mirrors its
exact tokens, pins a slot, and forwards the original body with `id_slot`: the client gets
llama-server's own Responses answer, events and errors, and the request gets what pinned
requests get (concurrency across slots, the table, the disk tier, tenant isolation).
"""

from __future__ import annotations

import asyncio
import random
import signal
import string
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from cacheproxy.errors import ApiError
from cacheproxy.settings import load_settings
from cacheproxy.slots.mirror import TokenMirror
from cacheproxy.upstreams.pool import Upstream
from tests.support.metrics import proxy_counters
from tests.support.serve_process import start_serve
from tests.support.servers import LlamaServer, StartServer, serving, serving_tenants

# cache_prompt false: both runs decode the whole prompt, so greedy output and usage are the
# same whichever slot served them and whatever it held.
GREEDY = {"temperature": 0, "max_output_tokens": 8, "cache_prompt": False, "seed": 1}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASKED = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}

REQUESTS: dict[str, dict[str, Any]] = {
    "string input": {"input": "Name three colours."},
    "instructions": {"instructions": "You are terse.", "input": "Name three colours."},
    "stop sequences": {"input": "Hello there, tell me a story", "stop": ["Track", "\n"]},
    "input_text parts": {
        "input": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Name three colours."},
                    {"type": "input_text", "text": "And one fruit."},
                ],
            },
        ]
    },
    "assistant output message": {
        "input": [
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hello! How can I help?"}],
            },
            {"role": "user", "content": "Tell me a joke."},
        ]
    },
    "function call and output": {
        "tools": [WEATHER_TOOL, {"type": "web_search"}],  # the second is skipped
        "input": [
            ASKED,
            CALL,
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        ],
    },
    "merged into the assistant message": {
        "tools": [WEATHER_TOOL],
        "reasoning": {"effort": "low"},
        "input": [
            ASKED,
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Hm"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            CALL,
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [{"type": "input_text", "text": "Rain, 12 C"}],
            },
            {"role": "user", "content": "Thanks. And tomorrow?"},
        ],
    },
}

IMAGE = {"type": "input_image", "image_url": "http://127.0.0.1:9/cat.png"}
REFUSED: dict[str, dict[str, Any]] = {
    "no input": {"model": "m"},
    "previous_response_id": {"input": "hi", "previous_response_id": "resp_123"},
    "input neither text nor list": {"input": {"role": "user", "content": "hi"}},
    "a number as item": {"input": [1]},
    "an item of no known type": {"input": [{"type": "item_reference", "id": "x"}]},
    "assistant text without type message": {"input": [{"role": "assistant", "content": "hi"}]},
    "input_file": {
        "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]
    },
    "input_text without text": {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
    "image on a text-only model": {"input": [{"role": "user", "content": [IMAGE]}]},
    "image in a tool output": {
        "input": [
            ASKED,
            CALL,
            {"type": "function_call_output", "call_id": "call_1", "output": [IMAGE]},
        ]
    },
    "tool output of another type": {
        "input": [
            ASKED,
            CALL,
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [{"type": "output_text"}],
            },
        ]
    },
    "reasoning without content": {"input": [{"type": "reasoning", "summary": [], "content": []}]},
    "refusal in the history": {
        "input": [
            {"role": "user", "content": "x"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "refusal", "refusal": "no"}],
            },
        ]
    },
    "tools not a list": {"input": "hi", "tools": {"type": "function", "name": "f"}},
}

# What differs between two runs of one request: ids, clocks and timings.
VOLATILE = frozenset({"id", "item_id", "call_id", "created_at", "completed_at", "timings"})
SLOT_REQUESTS = 'cacheproxy_requests_total{placement="slot",tenant="default"}'
WHOLE_UPSTREAM_REQUESTS = 'cacheproxy_requests_total{placement="whole_upstream",tenant="default"}'
PROMPT_TOKENS = 'cacheproxy_prompt_tokens_total{tenant="default"}'


def stable(document: Any) -> Any:
    if isinstance(document, dict):
        return {key: stable(value) for key, value in document.items() if key not in VOLATILE}
    if isinstance(document, list | tuple):
        return [stable(item) for item in document]
    return document


@dataclass
class Exchange:
    status: int
    content_type: str
    answer: Any  # the JSON answer, or the events as (event line, data) pairs
    raw: bytes


def parse_events(raw: bytes) -> list[tuple[str, Any]]:
    """Each event block as llama-server frames it: an `event:` line, then one `data:` line."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[1].startswith("data: "), block
        events.append((lines[0], orjson.loads(lines[1][6:])))
    return events


async def exchange(
    client: aiohttp.ClientSession,
    url: str,
    body: dict,
    headers: dict | None = None,
    route: str = "/v1/responses",
) -> Exchange:
    async with client.post(url + route, json=body, headers=headers) as response:
        raw = await response.read()
        kind = response.content_type
    answer = parse_events(raw) if kind == "text/event-stream" else orjson.loads(raw)
    return Exchange(response.status, kind, answer, raw)


def count_of(counters: dict[str, float], name: str) -> float:
    return counters.get(name, 0.0)


def final_usage(result: Exchange) -> dict:
    """The usage of a whole answer, or of the stream's `response.completed`."""
    assert result.status == 200, result.raw
    if result.content_type == "text/event-stream":
        name, data = result.answer[-1]
        assert name == "event: response.completed"
        return data["response"]["usage"]
    return result.answer["usage"]


# Bodies at the edges of the conversion: each is counted or refused by the port exactly as
# llama-server counts or refuses it.
EDGES: dict[str, dict[str, Any]] = {
    "instructions a number": {"instructions": 5, "input": "Hi"},
    "instructions null": {"instructions": None, "input": "Hi"},
    "empty previous_response_id": {"input": "Hi", "previous_response_id": ""},
    "previous_response_id a number": {"input": "Hi", "previous_response_id": 7},
    "max_output_tokens and max_tokens": {"input": "Hi", "max_output_tokens": 3, "max_tokens": 9},
    "reasoning not an object": {"input": "Hi", "reasoning": "high"},
    "system content parts": {
        "input": [
            {"role": "system", "content": [{"type": "input_text", "text": "S"}]},
            {"type": "message", "role": "user", "status": "completed", "content": "U"},
        ]
    },
    "assistant message without content": {
        "input": [ASKED, {"type": "message", "role": "assistant"}, {"role": "user", "content": "?"}]
    },
    "assistant text as input_text": {
        "input": [ASKED, {"type": "message", "role": "assistant", "content": "Sunny."}]
    },
    "reasoning alone, then its message": {
        "input": [
            ASKED,
            {"type": "reasoning", "summary": [], "content": "a string made a part"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "A"}],
            },
        ]
    },
    "two calls, two outputs": {
        "tools": [WEATHER_TOOL],
        "input": [
            ASKED,
            CALL,
            {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [
                    {"type": "input_text", "text": "Rain"},
                    {"type": "input_text", "text": ", 12 C"},
                ],
            },
        ],
    },
    "strict given": {"tools": [{**WEATHER_TOOL, "strict": False}], "input": "Hi"},
    "only other tools": {"tools": [{"type": "web_search"}, "x"], "input": "Hi"},
    "empty input list": {"input": []},
    "text a number": {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    "role a number": {"input": [{"role": 5, "content": "x"}]},
    "content null": {"input": [{"role": "user", "content": None}]},
    "a call first": {"input": [CALL, {"role": "user", "content": "Go on."}]},
    "empty tool output list": {
        "input": [ASKED, CALL, {"type": "function_call_output", "call_id": "call_1", "output": []}]
    },
    "messages given too": {
        "input": "Hi",
        "messages": [{"role": "user", "content": "a longer message than the input, replaced"}],
    },
    "a function tool without a name": {"tools": [{"type": "function"}], "input": "Hi"},
    "effort null": {"input": "Hi", "reasoning": {"effort": None}},
    "tool_choice and text format": {
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "text": {"format": {"type": "text"}},
        "input": "Hi",
    },
}


@pytest.mark.parametrize("name", list(EDGES) + list(REFUSED) + list(REQUESTS))
async def test_the_port_counts_and_refuses_as_llama_server_does(
    client: aiohttp.ClientSession, llama_server: LlamaServer, name: str
) -> None:
    body = {**EDGES, **REFUSED, **REQUESTS}[name]
    async with client.post(llama_server.url + "/v1/responses/input_tokens", json=body) as response:
        expected = (response.status, await response.json())
    mirror = TokenMirror(client)
    try:
        tokens = await mirror.prompt_tokens("responses", body, Upstream(llama_server.url), "tenant")
    except ApiError as refused:
        assert (refused.status, refused.envelope()) == expected
    else:
        assert (200, {"input_tokens": len(tokens), "object": "response.input_tokens"}) == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name", list(REQUESTS))
async def test_answers_as_llama_server_does(
    client: aiohttp.ClientSession, llama_server: LlamaServer, proxy: str, name: str, stream: bool
) -> None:
    body = {**REQUESTS[name], **GREEDY, "stream": stream}
    before = await proxy_counters(client, proxy)
    direct = await exchange(client, llama_server.url, body)
    proxied = await exchange(client, proxy, body)
    assert direct.status == 200, direct.raw
    assert (proxied.status, proxied.content_type) == (direct.status, direct.content_type)
    assert stable(proxied.answer) == stable(direct.answer)
    if stream:
        assert direct.answer[0][0] == "event: response.created"
        assert direct.answer[-1][0] == "event: response.completed"
    after = await proxy_counters(client, proxy)
    # placed on a slot, with its prompt known to the token: what the server counted
    assert count_of(after, SLOT_REQUESTS) - count_of(before, SLOT_REQUESTS) == 1
    reported = final_usage(direct)["input_tokens"]
    assert count_of(after, PROMPT_TOKENS) - count_of(before, PROMPT_TOKENS) == reported
    # the token count route is llama-server's own
    async with client.post(proxy + "/v1/responses/input_tokens", json=body) as response:
        assert response.status == 200
        assert await response.json() == {
            "input_tokens": reported,
            "object": "response.input_tokens",
        }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_route_without_v1_is_pinned_too(
    client: aiohttp.ClientSession, llama_server: LlamaServer, proxy: str, stream: bool
) -> None:
    body = {**REQUESTS["instructions"], **GREEDY, "stream": stream}
    before = await proxy_counters(client, proxy)
    direct = await exchange(client, llama_server.url, body, route="/responses")
    proxied = await exchange(client, proxy, body, route="/responses")
    assert direct.status == 200, direct.raw
    assert stable(proxied.answer) == stable(direct.answer)
    after = await proxy_counters(client, proxy)
    assert count_of(after, SLOT_REQUESTS) - count_of(before, SLOT_REQUESTS) == 1


@pytest.mark.parametrize("name", list(REFUSED))
async def test_refused_as_llama_server_refuses(
    client: aiohttp.ClientSession, llama_server: LlamaServer, proxy: str, name: str
) -> None:
    before = await proxy_counters(client, proxy)
    for stream in (False, True):
        body = {**REFUSED[name], **GREEDY, "stream": stream}
        direct = await exchange(client, llama_server.url, body)
        proxied = await exchange(client, proxy, body)
        assert direct.status in (400, 500), direct.raw
        assert (proxied.status, proxied.answer) == (direct.status, direct.answer)
        for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
            async with client.post(proxy + path, json=body) as response:
                assert (response.status, await response.json()) == (direct.status, direct.answer)
    after = await proxy_counters(client, proxy)
    # refused before any slot or upstream was taken
    for name_ in (SLOT_REQUESTS, WHOLE_UPSTREAM_REQUESTS):
        assert count_of(after, name_) == count_of(before, name_)


async def test_the_openai_sdk_as_client(
    client: aiohttp.ClientSession, llama_server: LlamaServer, proxy: str
) -> None:
    request = {
        "model": "tiny",
        "instructions": "You are terse.",
        "input": [{"role": "user", "content": "Name three colours."}],
        "max_output_tokens": 8,
        "temperature": 0,
        "extra_body": {"cache_prompt": False},
    }
    before = await proxy_counters(client, proxy)
    answers, event_types = [], []
    for base in (llama_server.url, proxy):
        sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        async with sdk:
            answers.append(await sdk.responses.create(**request))
            stream = await sdk.responses.create(**request, stream=True)
            events = [event async for event in stream]
        event_types.append([event.type for event in events])
        completed = events[-1].response
        assert completed.output_text == answers[-1].output_text
        assert completed.usage.input_tokens == answers[-1].usage.input_tokens
    direct, proxied = answers
    assert proxied.output_text == direct.output_text != ""
    assert proxied.usage.model_dump() == direct.usage.model_dump()
    assert event_types[1] == event_types[0]
    assert event_types[0][:2] == ["response.created", "response.in_progress"]
    assert event_types[0][-1] == "response.completed"
    after = await proxy_counters(client, proxy)
    assert count_of(after, SLOT_REQUESTS) - count_of(before, SLOT_REQUESTS) == 2


# -- pinned: concurrency, reuse, the disk tier, tenants ----------------------------------------


def words(seed: str, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(count)
    )


async def busy_slots(client: aiohttp.ClientSession, server: LlamaServer) -> int:
    async with client.get(server.url + "/slots") as response:
        return sum(slot["is_processing"] for slot in await response.json())


async def test_two_requests_run_at_once_on_two_slots(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, _):
        long_run = {"max_output_tokens": 1500, "ignore_eos": True, "temperature": 0}
        bodies = [{"input": words(f"run{n}", 40), **long_run, "stream": n == 1} for n in (0, 1)]
        running = [asyncio.create_task(exchange(client, url, body)) for body in bodies]
        most_at_once = 0
        while not all(task.done() for task in running):
            most_at_once = max(most_at_once, await busy_slots(client, server))
            await asyncio.sleep(0.01)
        results = [task.result() for task in running]
        assert [final_usage(result)["output_tokens"] for result in results] == [1500, 1500]
        assert most_at_once == 2


def conversation_turn(
    system: str, questions: list[str], answers: list[str], stream: bool
) -> dict[str, Any]:
    """A Responses body: the instructions, every question so far, and the answers between."""
    items: list[dict[str, Any]] = []
    for number, question in enumerate(questions):
        items.append({"role": "user", "content": question})
        if number < len(answers):
            part = {"type": "output_text", "text": answers[number]}
            items.append({"type": "message", "role": "assistant", "content": [part]})
    return {
        "instructions": system,
        "input": items,
        "max_output_tokens": 6,
        "temperature": 0,
        "stream": stream,
    }


def output_text(result: Exchange) -> str:
    if result.content_type == "text/event-stream":
        output = result.answer[-1][1]["response"]["output"]
    else:
        output = result.answer["output"]
    return "".join(part["text"] for item in output for part in item["content"])


async def test_a_second_turn_reuses_the_first_also_from_the_disk_tier(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=8192)
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        disk={
            "directory": server.slot_save_path,
            "database": tmp_path / "archive.db",
            "min_tokens": 128,
        },
    )
    async with serving(settings) as (url, _):
        system = words("agent", 250)
        questions = ["What is in the file?", "And in the next one?", "Summarise both."]
        first = await exchange(client, url, conversation_turn(system, questions[:1], [], False))
        first_prompt = final_usage(first)["input_tokens"]
        answers = [output_text(first)]

        second = await exchange(
            client, url, conversation_turn(system, questions[:2], answers, True)
        )
        assert final_usage(second)["input_tokens_details"]["cached_tokens"] >= first_prompt
        answers.append(output_text(second))
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_predictions_total{result="match"}'] == 2
        assert counters.get('cacheproxy_predictions_total{result="mismatch"}', 0) == 0

        for other in ("one", "two"):  # two longer conversations take both slots
            cold = await exchange(
                client, url, conversation_turn(words(other, 400), ["Hi"], [], False)
            )
            # the template's head is all they share with the conversation they evict
            assert final_usage(cold)["input_tokens_details"]["cached_tokens"] < 20
        second_prompt = final_usage(second)["input_tokens"]

        third = await exchange(client, url, conversation_turn(system, questions, answers, False))
        assert final_usage(third)["input_tokens_details"]["cached_tokens"] >= second_prompt
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 1


@dataclass
class Tenants:
    url: str
    keys: dict[str, str]


@pytest.fixture
async def tenants(start_server: StartServer, tmp_path: Path) -> AsyncIterator[Tenants]:
    server = start_server(parallel=1)  # every request lands on the slot the last one left
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        keys = {name: registry.create(name)[1] for name in ("alice", "bob")}
        yield Tenants(url, keys)


async def test_another_tenant_reuses_nothing_the_owner_reuses_its_own(
    client: aiohttp.ClientSession, tenants: Tenants
) -> None:
    system = words("shared system prompt", 200)

    async def cached(tenant: str, question: str, stream: bool) -> int:
        body = conversation_turn(system, [question], [], stream)
        headers = {"Authorization": f"Bearer {tenants.keys[tenant]}"}
        return final_usage(await exchange(client, tenants.url, body, headers))[
            "input_tokens_details"
        ]["cached_tokens"]

    assert await cached("alice", "First?", False) == 0
    assert await cached("alice", "Second?", True) >= 200
    assert await cached("bob", "Third?", False) == 0
    assert await cached("bob", "Fourth?", True) >= 200
    assert await cached("alice", "Fifth?", True) == 0


async def test_closing_right_after_the_last_event_frees_the_slot_and_sigterm_stops(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1)  # a lease left behind would block every later request
    proxy = await start_serve(
        tmp_path, "--upstream", server.url, env={"CACHEPROXY_SHUTDOWN_TIMEOUT_S": "6"}
    )
    try:
        short = {"input": "And now?", "max_output_tokens": 1}
        started = time.monotonic()
        await exchange(client, proxy.url, short)
        # 2 s, or more on a machine so loaded that the same request took over 2/3 s before
        limit_s = max(2.0, 3 * (time.monotonic() - started))
        for stream in range(3):
            body = {"input": words(f"close{stream}", 30), "max_output_tokens": 8, "stream": True}
            response = await client.post(proxy.url + "/v1/responses", json=body)
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: ") and b'"type":"response.completed"' in line:
                    break
            response.close()  # the connection goes at once, whatever the server sends next
        async with asyncio.timeout(limit_s):  # a lease left behind would make it wait for ever
            answer = await exchange(client, proxy.url, short)
        assert final_usage(answer)["output_tokens"] == 1
        proxy.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await proxy.process.wait() == 0, proxy.log()
    finally:
        await proxy.stop()
