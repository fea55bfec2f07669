"""/v1/messages (Anthropic) through the slot table, against real llama-servers.

The differential tests send every request to two identical one-slot servers, one directly and
one through the proxy, in the same order, so both slots hold the same text before each request:
answers, streams and errors must then be equal field by field (usage included), ids aside.
"""

from __future__ import annotations

import asyncio
import random
import re
import string
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from cacheproxy.apis.anthropic import chat_request
from cacheproxy.provision.cache import llama_cpp_source
from cacheproxy.settings import load_settings
from tests.support.metrics import proxy_counters
from tests.support.servers import LlamaServer, StartServer, serving, serving_tenants

MODEL = "any"  # llama-server serves its one model whatever the request names


def words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(count)
    )


TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
TOOL_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
            {"type": "text", "text": "And tomorrow?"},
        ],
    },
]
BILLING = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"

REQUESTS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Hello there."}]},
    "system string": {
        "system": "You are terse. " + words(1, 40),
        "messages": [{"role": "user", "content": "Name three colours."}],
    },
    "system blocks": {
        "system": [
            {"type": "text", "text": BILLING + "You are a coding agent."},
            {"type": "text", "text": " " + words(2, 30), "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]}],
    },
    "multi-turn": {
        "system": "You are terse.",
        "messages": [
            {"role": "user", "content": "Name three colours."},
            {"role": "assistant", "content": [{"type": "text", "text": "Red, green, blue."}]},
            {"role": "user", "content": "Two more."},
        ],
    },
    "tools and results": {"tools": TOOLS, "messages": TOOL_HISTORY},
    "tool forced": {
        "tools": TOOLS,
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "max_tokens": 40,
    },
    "stop sequences": {
        "messages": [{"role": "user", "content": "Count."}],
        "stop_sequences": ["e", "a"],
    },
    "thinking": {
        "thinking": {"type": "enabled", "budget_tokens": 16},
        "messages": [
            {"role": "user", "content": "Think first."},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "thinking",
                        "thinking": "The user wants me to think.",
                        "signature": "",
                    },
                    {"type": "text", "text": "Done."},
                ],
            },
            {"role": "user", "content": "Again."},
        ],
    },
    "sampling and metadata": {
        "messages": [{"role": "user", "content": "Go."}],
        "top_k": 1,
        "top_p": 0.5,
        "metadata": {"user_id": "user-42"},
        "id_slot": 3,  # dropped by the server's conversion, so it cannot pin anything
        "cache_prompt": False,
    },
}
# requests llama-server refuses on /v1/messages: same status and envelope through the proxy
REFUSED: dict[str, dict[str, Any]] = {
    "no messages": {"max_tokens": 4},
    "an image on a text-only model": {
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    },
    "max_tokens of the wrong type": {
        "max_tokens": "many",
        "messages": [{"role": "user", "content": "Hi."}],
    },
    "a message of the wrong type": {"max_tokens": 4, "messages": ["hello"]},
    "content of the wrong type": {"max_tokens": 4, "messages": [{"role": "user", "content": 7}]},
    "a prompt longer than the context": {
        "max_tokens": 4,
        "messages": [{"role": "user", "content": words(7, 12000)}],
    },
}


@dataclass
class Pair:
    direct: LlamaServer
    proxied: LlamaServer
    proxy_url: str


# A chat template whose generation prompt opens a <think> block: whatever the random-weight
# model says is reasoning, so answers and streams carry thinking blocks (the pinned tree's own).
THINKING_TEMPLATE = "models/templates/Qwen-QwQ-32B.jinja"


@pytest.fixture
async def pair(
    start_server: StartServer, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Pair]:
    """Two identical one-slot servers; the second behind the proxy (no disk tier: the direct
    server has none either)."""
    extra_args: tuple[str, ...] = ()
    if getattr(request, "param", "plain template") == "thinking template":
        extra_args = ("--chat-template-file", str(llama_cpp_source() / THINKING_TEMPLATE))
    direct, proxied = (start_server(parallel=1, extra_args=extra_args) for _ in range(2))
    settings = load_settings(
        upstreams=[proxied.url], state_dir=tmp_path / "state", disk={"enabled": False}
    )
    async with serving(settings) as (url, _):
        yield Pair(direct, proxied, url)


def message_request(name: str, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "temperature": 0, **REQUESTS[name], "stream": stream}


def without_ids(document: Any) -> Any:
    """Ids are random on every answer (the message id, and tool call ids the server makes)."""
    if isinstance(document, dict):
        return {key: without_ids(value) for key, value in document.items() if key != "id"}
    if isinstance(document, list | tuple):
        return [without_ids(item) for item in document]
    return document


async def answer_of(
    client: aiohttp.ClientSession, url: str, body: dict, path: str = "/v1/messages"
) -> tuple[int, str, Any, bytes]:
    """Status, content type, the JSON answer or the stream as (event, data) pairs, and the
    bytes themselves with the message ids masked: they must be equal too."""
    async with client.post(url + path, json=body) as response:
        payload = await response.read()
    masked = re.sub(rb"chatcmpl-[A-Za-z0-9]+", b"chatcmpl-ID", payload)
    if response.content_type != "text/event-stream":
        return response.status, response.content_type, orjson.loads(payload), masked
    events = []
    for block in payload.decode().split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines.get("event"), orjson.loads(lines["data"])))
    return response.status, response.content_type, events, masked


async def both(pair: Pair, client: aiohttp.ClientSession, body: dict, path: str = "/v1/messages"):  # noqa: ANN201
    direct = await answer_of(client, pair.direct.url, body, path)
    proxied = await answer_of(client, pair.proxy_url, body, path)
    return direct, proxied


@pytest.mark.parametrize("pair", ["plain template", "thinking template"], indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_answers_equal_llama_servers_own(
    pair: Pair, client: aiohttp.ClientSession, stream: bool
) -> None:
    kinds: set[str] = set()
    answered = 0
    for name in REQUESTS:
        for turn in range(2):  # the second time the slot holds the first: usage shows reuse
            direct, proxied = await both(pair, client, message_request(name, stream))
            assert without_ids(proxied) == without_ids(direct), (name, turn)
            if direct[0] == 200:
                answered += 1
                found = direct[2] if stream else [(None, direct[2])]
                kinds |= {block["type"] for _, event in found for block in blocks_of(event)}
    assert kinds in ({"text"}, {"thinking"})  # the answers covered what they are meant to
    # and each was placed on a slot through the table, not run on a whole upstream
    placed = await placements(client, pair.proxy_url)
    assert placed["slot"] >= answered and placed["whole_upstream"] == 0
    # with the tokens the table predicted the server to reuse, every time
    counters = await proxy_counters(client, pair.proxy_url)
    assert counters['cacheproxy_predictions_total{result="match"}'] >= answered
    assert counters.get('cacheproxy_predictions_total{result="mismatch"}', 0) == 0


async def placements(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    counters = await proxy_counters(client, url)
    return {
        placement: counters.get(
            f'cacheproxy_requests_total{{placement="{placement}",tenant="default"}}', 0
        )
        for placement in ("slot", "whole_upstream")
    }


def blocks_of(event: dict) -> list[dict]:
    if "content_block" in event:
        return [event["content_block"]]
    return event.get("content", []) if isinstance(event.get("content"), list) else []


async def test_stop_sequence_and_reuse_are_reported_as_llama_server_reports_them(
    pair: Pair, client: aiohttp.ClientSession
) -> None:
    body = message_request("plain", stream=False) | {"max_tokens": 16}
    (_, _, first, _), _ = await both(pair, client, body)  # both slots hold the same again
    word = first["content"][0]["text"].split()[2]  # a word the model will say again
    for stream in (False, True):
        body = message_request("plain", stream) | {"max_tokens": 16, "stop_sequences": [word]}
        direct, proxied = await both(pair, client, body)
        assert without_ids(proxied) == without_ids(direct)
        final = direct[2] if not stream else direct[2][-2][1]
        stop = final if not stream else final["delta"]
        assert (stop["stop_reason"], stop["stop_sequence"]) == ("end_turn", word)
        usage = direct[2]["usage"] if not stream else direct[2][0][1]["message"]["usage"]
        assert usage["cache_read_input_tokens"] > 0
    assert (await placements(client, pair.proxy_url))["slot"] == 3


async def test_refusals_equal_llama_servers_own(pair: Pair, client: aiohttp.ClientSession) -> None:
    for name, refused in REFUSED.items():
        for stream in (False, True):
            direct, proxied = await both(
                pair, client, {"model": MODEL, **refused, "stream": stream}
            )
            assert direct[0] >= 400, (name, direct)
            assert proxied == direct, name


async def test_count_tokens_equals_llama_servers_own(
    pair: Pair, client: aiohttp.ClientSession
) -> None:
    for name in REQUESTS:
        body = {"model": MODEL, **REQUESTS[name]}
        direct, proxied = await both(pair, client, body, "/v1/messages/count_tokens")
        assert direct[0] == 200
        assert proxied == direct


# bodies that take the conversion's odd corners, all of which the server accepts
ODD_BODIES: list[dict[str, Any]] = [
    {"system": 5, "messages": [{"role": "user", "content": "a"}]},
    {
        "system": [{"type": "text", "text": BILLING + "x"}, "junk", {"text": "no type"}],
        "messages": [],
    },
    {
        "system": "x-anthropic-billing-header: cch=abc;",
        "messages": [{"role": "user", "content": "b"}],
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "mystery"}]},
            {"role": "assistant"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm"},
                    {"type": "tool_use", "id": "t", "name": "f", "input": {"z": [1, 2.5, None]}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "text", "text": "1"}],
                    },
                    {"type": "tool_result", "tool_use_id": "t", "content": None},
                    {"type": "text", "text": "go"},
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"description": "nameless"}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 3.5},
        "metadata": {"user_id": 7},
    },
    {"messages": [{"role": 3, "content": [{"type": "text", "text": "role of the wrong type"}]}]},
]


async def test_the_conversion_is_the_servers_own(
    llama_server: LlamaServer, proxy: str, client: aiohttp.ClientSession
) -> None:
    """The proxy's conversion, templated and tokenized, counts what the server's own counts."""
    for body in ODD_BODIES:
        direct = await answer_of(client, llama_server.url, body, "/v1/messages/count_tokens")
        assert direct[0] == 200, (body, direct)
        converted = chat_request(body)
        async with client.post(llama_server.url + "/apply-template", json=converted) as response:
            prompt = (await response.json())["prompt"]
        tokenize = {"content": prompt, "add_special": True, "parse_special": True}
        async with client.post(llama_server.url + "/tokenize", json=tokenize) as response:
            tokens = (await response.json())["tokens"]
        assert len(tokens) == direct[2]["input_tokens"], body
        # and through the proxy the request runs (the server would run it too)
        async with client.post(proxy + "/v1/messages", json={**body, "max_tokens": 2}) as answer:
            assert answer.status == 200, await answer.text()
            assert (await answer.json())["usage"]["output_tokens"] == 2


async def test_the_anthropic_sdk_as_client(pair: Pair) -> None:
    sdk = anthropic.AsyncAnthropic(base_url=pair.proxy_url, api_key="unused", max_retries=0)
    greedy = {"temperature": 0}  # this SDK takes no temperature argument of its own
    system = "You are terse. " + words(3, 60)
    message = await sdk.messages.create(
        model=MODEL,
        max_tokens=8,
        system=system,
        messages=[{"role": "user", "content": "Hello."}],
        extra_body=greedy,
    )
    assert message.type == "message" and message.stop_reason == "max_tokens"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 8
    follow_up = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": message.content[0].text},
        {"role": "user", "content": "More."},
    ]
    async with sdk.messages.stream(
        model=MODEL, max_tokens=8, system=system, messages=follow_up, extra_body=greedy
    ) as stream:
        text = "".join([chunk async for chunk in stream.text_stream])
        streamed = await stream.get_final_message()
    assert streamed.content[0].text == text and text
    assert streamed.stop_reason == "max_tokens"
    # the second turn was served from the first one's slot
    assert streamed.usage.cache_read_input_tokens > 60
    with_tools = await sdk.messages.create(
        model=MODEL, max_tokens=4, tools=TOOLS, messages=TOOL_HISTORY, extra_body=greedy
    )
    assert with_tools.usage.input_tokens > 0 and with_tools.content
    async with aiohttp.ClientSession() as client:
        assert (await placements(client, pair.proxy_url))["slot"] == 3


async def test_two_messages_run_at_once_on_two_slots(
    start_server: StartServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """A stream left unread holds its slot; a second request still runs, on the other one."""
    server = start_server(parallel=2)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, _):
        long_one = {
            "model": MODEL,
            "max_tokens": 4000,
            "stream": True,
            "messages": [{"role": "user", "content": words(5, 50)}],
        }
        async with client.post(url + "/v1/messages", json=long_one) as held:
            assert (await held.content.readline()).startswith(b"event: message_start")
            second = {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}],
            }
            async with asyncio.timeout(20):
                async with client.post(url + "/v1/messages", json=second) as response:
                    assert response.status == 200
                    assert (await response.json())["stop_reason"] == "max_tokens"
            async with client.get(server.url + "/slots") as slots:
                assert [slot["is_processing"] for slot in await slots.json()].count(True) == 1


async def test_a_client_gone_right_after_the_last_event_leaves_nothing_held(
    start_server: StartServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    server = start_server(parallel=1)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, _):
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "stream": True,
            "messages": [{"role": "user", "content": "Hi"}],
        }
        for _ in range(3):
            response = await client.post(url + "/v1/messages", json=body)
            seen = b""
            while b"event: message_stop" not in seen:
                seen += await response.content.readline()
            response.close()  # gone, before the stream's own end
            # a slot left held would keep this waiting for ever; the bound is only for a
            # loaded machine, no figure of speed
            async with asyncio.timeout(30):
                answer = await ask(client, url, {**body, "stream": False})
            assert answer["stop_reason"] == "max_tokens"


async def test_an_upstream_killed_mid_stream_ends_it_with_an_anthropic_error_event(
    start_server: StartServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    server = start_server(parallel=1)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    body = {
        "model": MODEL,
        "max_tokens": 3000,
        "stream": True,
        "messages": [{"role": "user", "content": words(6, 50)}],
    }
    async with serving(settings) as (url, _):
        async with client.post(url + "/v1/messages", json=body) as response:
            assert (await response.content.readline()).startswith(b"event: message_start")
            server.kill()
            text = (await response.read()).decode()
    *_, last = [block for block in text.split("\n\n") if block]
    name, data = last.split("\n")
    assert name == "event: error"  # as llama-server sends a late error on this route
    error = orjson.loads(data.removeprefix("data: "))
    assert error["code"] == 502 and server.url in error["message"]


def turn_body(system: str, history: list[dict], question: str) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "system": system,
        "messages": [*history, {"role": "user", "content": question}],
    }


async def ask(client: aiohttp.ClientSession, url: str, body: dict, key: str | None = None) -> dict:
    headers = {"x-api-key": key} if key else {}
    async with client.post(url + "/v1/messages", json=body, headers=headers) as response:
        answer = await response.json()
        assert response.status == 200, answer
    return answer


async def test_a_conversation_evicted_from_its_slot_comes_back_from_disk(
    start_server: StartServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    server = start_server(parallel=2, ctx_size=8192)
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        disk={"directory": server.slot_save_path, "min_tokens": 128},
    )
    async with serving(settings) as (url, _):
        system = "You are a coding agent. " + words(10, 300)
        first = await ask(client, url, turn_body(system, [], "Start."))
        history = [
            {"role": "user", "content": "Start."},
            {"role": "assistant", "content": first["content"]},
        ]
        # two other conversations take both slots: the first one's slot is overwritten
        for seed in (11, 12):
            await ask(client, url, turn_body(words(seed, 300), [], "Other."))
        again = await ask(client, url, turn_body(system, history, "Next."))
        prompt = first["usage"]["input_tokens"]
        assert again["usage"]["cache_read_input_tokens"] >= prompt
        # and its next turn reuses this one's slot as it is
        history += [
            {"role": "user", "content": "Next."},
            {"role": "assistant", "content": again["content"]},
        ]
        third = await ask(client, url, turn_body(system, history, "Last."))
        assert third["usage"]["cache_read_input_tokens"] > again["usage"]["cache_read_input_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_tenants_never_reuse_each_others_messages(
    start_server: StartServer, tmp_path: Path, client: aiohttp.ClientSession, stream: bool
) -> None:
    """One slot: every request lands where the last one left its text; only isolation can
    make the other tenant's request miss."""
    server = start_server(parallel=1)
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        _, alice = registry.create("alice")
        _, bob = registry.create("bob")
        system = "You are a coding agent. " + words(20, 200)

        async def cached(key: str, question: str) -> int:
            body = turn_body(system, [], question) | {"stream": stream}
            if not stream:
                return (await ask(client, url, body, key))["usage"]["cache_read_input_tokens"]
            headers = {"x-api-key": key}
            async with client.post(url + "/v1/messages", json=body, headers=headers) as response:
                text = await response.text()
            start = orjson.loads(text.split("data: ", 1)[1].split("\n", 1)[0])
            return start["message"]["usage"]["cache_read_input_tokens"]

        await cached(alice, "One.")
        assert await cached(alice, "Two.") > 100  # the owner reuses her system prompt
        assert await cached(bob, "Three.") == 0  # the other tenant does not
        assert await cached(bob, "Four.") > 100  # now his own
        assert await cached(alice, "Five.") == 0
