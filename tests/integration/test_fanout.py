"""Several completions (`n`, `n_cmpl`) and prompt batches, split into single tasks placed through
the slot table, answered as llama-server answers them.

The differential tests send each request to a llama-server directly and through the proxy in
front of a twin server (same binary, model and flags): the answers must be equal field by field,
but for what differs between any two runs (`id`, `created`, timings) or between slot choices
(`id_slot`, cached-token counts). Streams are compared per `index`, since llama-server itself
interleaves its tasks' events as they happen to come.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.completions import without
from tests.support.metrics import proxy_counters
from tests.support.raw_http import open_connection, request_bytes
from tests.support.serve_process import start_serve
from tests.support.servers import (
    LlamaServer,
    StartServer,
    running_proxy,
    serving_tenants,
    start_llama_server,
)
from tests.support.sse import sse_payloads
from tests.support.upstream_slots import wait_until_idle

PARALLEL = 3
# A client that leaves mid-stream abandons a generation this long; cancelled, it stops far sooner
LEFT_MID_STREAM_TOKENS = 3000
# bound for the server to see the cancellation (it checks closed connections about once a
# second); generous, as a loaded machine is slow, and no figure of speed is asserted
IDLE_WITHIN_S = 30.0
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name three colours."},
]
# what differs between two runs, or between two slot choices, not between two answer shapes
UNCOMPARED = frozenset({"id", "created", "timings", "id_slot", "cached_tokens", "prompt_progress"})

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat n=2": (
        "/v1/chat/completions",
        {"messages": CHAT, "n": 2, "max_tokens": 6, "temperature": 0, "seed": 42},
    ),
    "chat n=2 with progress": (
        "/v1/chat/completions",
        {"messages": CHAT, "n": 2, "max_tokens": 3, "temperature": 0, "return_progress": True},
    ),
    "chat n_cmpl=3 with usage": (
        "/chat/completions",
        {
            "messages": CHAT,
            "n_cmpl": 3,
            "max_tokens": 5,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        },
    ),
    "oai completion n=2": (
        "/v1/completions",
        {"prompt": "Once upon a time", "n": 2, "max_tokens": 6, "temperature": 0},
    ),
    "native n_cmpl=2 with a seed": (
        "/completion",
        {"prompt": "Once upon a time", "n_cmpl": 2, "n_predict": 6, "temperature": 0, "seed": 7},
    ),
    "native batch, mixed shapes": (
        "/completions",
        {
            "prompt": [
                "Once upon a time",
                [1, 450, 4996, 17354],
                {"prompt_string": "The sky"},
                ["Mixed", 3681, " prompt"],
            ],
            "n_predict": 5,
            "temperature": 0,
        },
    ),
    "native batch n=2 with progress": (
        "/completion",
        {
            "prompt": ["Once upon a time", "The sky is"],
            "n": 2,
            "n_predict": 3,
            "temperature": 0,
            "return_progress": True,
        },
    ),
    "oai batch n=2": (
        "/v1/completions",
        {"prompt": ["Once upon a time", "The sky is"], "n": 2, "max_tokens": 5, "temperature": 0},
    ),
}

REFUSED: dict[str, tuple[str, dict[str, Any]]] = {
    "n over the slot count": ("/v1/chat/completions", {"messages": CHAT, "n": PARALLEL + 1}),
    "n=0": ("/v1/chat/completions", {"messages": CHAT, "n": 0}),
    "n_cmpl=0": ("/completion", {"prompt": "x", "n_cmpl": 0}),
    "n_cmpl over, streamed": ("/completion", {"prompt": "x", "n_cmpl": 9, "stream": True}),
    "n not a number": ("/v1/completions", {"prompt": ["a", "b"], "n": "2"}),
    "an empty batch": ("/completion", {"prompt": [], "n": 2}),
    "a batch element of no shape": ("/completion", {"prompt": ["a", ["b"]]}),
}


@pytest.fixture(scope="module")
def twins(
    llama_server_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    """Two identical llama-servers: one asked directly, one behind the proxy."""
    servers = [
        start_llama_server(
            llama_server_binary,
            tiny_model,
            tmp_path_factory.mktemp(name),
            parallel=PARALLEL,
            ctx_size=8192,
        )
        for name in ("direct", "behind")
    ]
    yield servers[0], servers[1]
    for server in servers:
        server.stop()


@pytest.fixture
async def routes(
    twins: tuple[LlamaServer, LlamaServer], tmp_path: Path
) -> AsyncIterator[tuple[str, str]]:
    """(the direct server's URL, the proxy's URL in front of its twin)."""
    direct, behind = twins
    settings = load_settings(upstreams=[behind.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        yield direct.url, url


def comparable(document: Any) -> Any:
    return without(document, UNCOMPARED)


async def answer(
    client: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None
) -> tuple[int, Any]:
    async with client.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def stream(client: aiohttp.ClientSession, url: str, body: dict) -> list[str]:
    async with client.post(url, json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        assert response.content_type == "text/event-stream"
        return [payload async for payload in sse_payloads(response)]


def index_of(event: dict) -> Any:
    if "choices" in event:  # OAI: a usage chunk has no choice, hence no index
        return event["choices"][0]["index"] if event["choices"] else "usage"
    return event.get("index")


def by_index(payloads: list[str]) -> dict[Any, list[Any]]:
    """Each task's events in order; `data: null` begin markers and usage chunks as groups of
    their own (the order between tasks is the server's timing, not the answer's shape)."""
    groups: dict[Any, list[Any]] = defaultdict(list)
    for payload in payloads:
        if payload in ("null", "[DONE]"):
            groups[payload].append(payload)
            continue
        event = orjson.loads(payload)
        groups[index_of(event)].append(comparable(event))
    groups["usage"].sort(key=orjson.dumps)
    return dict(groups)


@pytest.mark.parametrize("case", CASES)
async def test_answers_equal_llama_servers(
    client: aiohttp.ClientSession, routes: tuple[str, str], case: str
) -> None:
    path, body = CASES[case]
    direct, proxied = [await answer(client, base + path, body) for base in routes]
    assert proxied[0] == direct[0] == 200, proxied
    assert comparable(proxied[1]) == comparable(direct[1])
    # the shape itself: an array of native results, or one OAI answer with every choice
    shown = proxied[1]
    if isinstance(shown, list):
        assert [result["index"] for result in shown] == list(range(len(shown)))
    else:
        assert [choice["index"] for choice in shown["choices"]] == list(
            range(len(shown["choices"]))
        )


@pytest.mark.parametrize("case", CASES)
async def test_streams_equal_llama_servers_by_index(
    client: aiohttp.ClientSession, routes: tuple[str, str], case: str
) -> None:
    path, body = CASES[case]
    direct, proxied = [await stream(client, base + path, body) for base in routes]
    assert by_index(proxied) == by_index(direct)
    oai = path != "/completion" and path != "/completions"
    assert (proxied[-1] == "[DONE]") == (direct[-1] == "[DONE]") == oai
    if oai:  # one id for the whole stream, as llama-server gives its tasks
        ids = {orjson.loads(p)["id"] for p in proxied if p not in ("null", "[DONE]")}
        assert len(ids) == 1


@pytest.mark.parametrize("case", REFUSED)
async def test_refusals_equal_llama_servers(
    client: aiohttp.ClientSession, routes: tuple[str, str], case: str
) -> None:
    path, body = REFUSED[case]
    direct, proxied = [await answer(client, base + path, body) for base in routes]
    assert direct[0] == 400
    assert proxied == direct


# -- through the table -----------------------------------------------------------------------


def placements(counters: dict[str, float], placement: str) -> float:
    return sum(
        value
        for name, value in counters.items()
        if name.startswith("cacheproxy_requests_total") and f'placement="{placement}"' in name
    )


async def test_tasks_run_on_distinct_slots_at_once(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=PARALLEL, ctx_size=8192)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        body = {
            "prompt": "Once upon a time",
            "n_cmpl": PARALLEL,
            "n_predict": 300,
            "ignore_eos": True,
            "stream": True,
        }
        seen: set[int] = set()
        started_before_any_ended = 0
        finals = []
        async with client.post(url + "/completion", json=body) as response:
            async for payload in sse_payloads(response):
                event = orjson.loads(payload)
                seen.add(event["index"])
                if event["stop"]:
                    started_before_any_ended = started_before_any_ended or len(seen)
                    finals.append(event)
        counters = await proxy_counters(client, url)
    # at once: every task had streamed before the first ended (run one after another, each
    # would end before the next began); told by the events' order, not by when /slots is read
    assert started_before_any_ended == PARALLEL
    assert sorted(final["id_slot"] for final in finals) == list(range(PARALLEL))
    assert placements(counters, "slot") == PARALLEL
    assert placements(counters, "whole_upstream") == 0


async def test_a_later_single_request_reuses_what_a_task_left(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """The table knows what each task left in its slot: the same chat asked once more is
    placed on one of them (a four-slot server, two of them never touched)."""
    server = start_server(parallel=4, ctx_size=8192)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        body = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
        status, _ = await answer(client, url + "/v1/chat/completions", {**body, "n": 2})
        assert status == 200
        status, single = await answer(client, url + "/v1/chat/completions", body)
    assert status == 200
    prompt_tokens = single["usage"]["prompt_tokens"]
    assert single["timings"]["cache_n"] == prompt_tokens - 1  # all of it but the last token


async def test_more_tasks_than_slots_queue_and_complete(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=8192)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        prompts = ["Once upon a time", "The sky is", "In the beginning"]
        # long enough that the third task's wait for a slot shows on a fast machine (40
        # tokens took the small model under 20 ms)
        body = {"prompt": prompts, "n_predict": 200, "ignore_eos": True, "temperature": 0}
        status, results = await answer(client, url + "/completion", body)
        counters = await proxy_counters(client, url)
    assert status == 200, results
    assert [r["index"] for r in results] == [0, 1, 2]
    assert [r["tokens_predicted"] for r in results] == [200, 200, 200]
    assert {r["id_slot"] for r in results} == {0, 1}
    assert placements(counters, "slot") == 3
    assert counters["cacheproxy_queue_wait_seconds_count"] == 3
    assert counters["cacheproxy_queue_wait_seconds_sum"] > 0.02  # the third waited for a slot


async def test_n_over_free_slots_waits_for_one(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """n=3 on three slots, one of them busy: two tasks start, the third waits and completes."""
    server = start_server(parallel=PARALLEL, ctx_size=8192)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        long_one = {"prompt": "A long story", "n_predict": 150, "ignore_eos": True}
        busy = asyncio.create_task(answer(client, url + "/completion", long_one))
        await asyncio.sleep(0.3)
        body = {"prompt": "The sky is", "n": PARALLEL, "n_predict": 8, "temperature": 0}
        status, results = await answer(client, url + "/completion", body)
        assert (await busy)[0] == 200
        counters = await proxy_counters(client, url)
    assert status == 200, results
    assert [r["content"] for r in results] == [results[0]["content"]] * PARALLEL
    assert placements(counters, "slot") == 1 + PARALLEL  # the long one, and each task


# -- tenants ---------------------------------------------------------------------------------

LONG_TEXT = " ".join(f"token{random.Random(i).randrange(10**5)}" for i in range(250))
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat n=2": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG_TEXT}], "n": 2},
    ),
    "n_cmpl=2": ("/completion", {"prompt": LONG_TEXT, "n_cmpl": 2}),
    "a prompt batch": ("/completion", {"prompt": [LONG_TEXT, LONG_TEXT + " and more"]}),
    "an OAI batch": ("/v1/completions", {"prompt": [LONG_TEXT, LONG_TEXT + " and more"]}),
}


def cache_signals(shown: Any) -> list[int]:
    """Every cached-token count the answer shows (OAI: the first task's, as llama-server)."""
    if isinstance(shown, list):
        return [result["timings"]["cache_n"] for result in shown]
    return [shown["timings"]["cache_n"], shown["usage"]["prompt_tokens_details"]["cached_tokens"]]


@pytest.mark.parametrize("shape", SHAPES)
async def test_another_tenant_reuses_nothing_the_owner_reuses(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, shape: str
) -> None:
    server = start_server(parallel=2, ctx_size=8192)
    path, body = SHAPES[shape]
    body = {**body, "max_tokens": 2, "temperature": 0}
    # alice's requests have ended when bob's come: no slot is kept for her (the slot share),
    # so bob's tasks run side by side on the slots holding her text, each reusing none of it
    no_window = {"share_window_s": 0}
    async with serving_tenants(server.url, tmp_path, scheduling=no_window) as (url, registry):
        alice, bob = (tenant_key(registry, name) for name in ("alice", "bob"))
        signals = []
        for key in (alice, alice, bob, bob):
            status, shown = await answer(client, url + path, body, {"Authorization": key})
            assert status == 200, shown
            signals.append(cache_signals(shown))
    _, alice_again, bob_first, bob_again = signals
    assert all(count > 0 for count in alice_again), signals  # the owner reuses its own text
    assert bob_first == [0] * len(bob_first), signals  # and nobody else does
    assert all(count > 0 for count in bob_again), signals  # the slots are bob's now


def tenant_key(registry: TenantRegistry, name: str) -> str:
    _, key = registry.create(name)
    return f"Bearer {key}"


# -- a client that leaves --------------------------------------------------------------------


@pytest.mark.parametrize("when", ["after the last event", "mid-stream"])
async def test_a_client_leaving_a_split_stream_frees_every_slot(
    start_server: StartServer, tmp_path: Path, when: str
) -> None:
    """The client resets its connection as soon as it has read `[DONE]` (a client library
    would be too slow to catch the proxy still at work after the last event), or mid-way.
    Mid-way, both tasks stop long before their 3,000 tokens (the slots' length is the
    witness, read from the server); either way the next request is served."""
    server = start_server(parallel=2, ctx_size=8192)
    proxy = await start_serve(
        tmp_path, "--upstream", server.url, env={"CACHEPROXY_SHUTDOWN_TIMEOUT_S": "6"}
    )
    try:
        body = {"messages": CHAT, "n": 2, "stream": True, "temperature": 0, "ignore_eos": True}
        body["max_tokens"] = 4 if when == "after the last event" else LEFT_MID_STREAM_TOKENS
        reader, writer = await open_connection(proxy.url)
        writer.write(request_bytes("POST", "/v1/chat/completions", body=orjson.dumps(body)))
        received = b""
        enough = b"data: [DONE]" if when == "after the last event" else b"data: "
        while received.count(enough) < (1 if when == "after the last event" else 8):
            chunk = await reader.read(1 << 16)
            assert chunk, received
            received += chunk
        writer.transport.abort()  # gone at once (a reset), without reading further
        async with aiohttp.ClientSession() as client:
            state = await wait_until_idle(client, server, within_s=IDLE_WITHIN_S)
            if when == "mid-stream":
                assert all(slot["n_prompt_tokens"] < LEFT_MID_STREAM_TOKENS for slot in state)
            single = {"prompt": "The sky is", "n_predict": 2}
            async with client.post(proxy.url + "/completion", json=single) as next_response:
                assert next_response.status == 200
        proxy.process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proxy.process.wait(), 6 + 4)
    finally:
        await proxy.stop()
    assert code == 0, proxy.log()[-3000:]


# -- the disk tier ---------------------------------------------------------------------------


async def test_each_task_gets_the_disk_tier(start_server: StartServer, tmp_path: Path) -> None:
    """A batch that overwrites both slots archives what they held, and a batch of the follow-ups
    restores each into the slot its task got."""
    server = start_server(parallel=2, ctx_size=8192)
    disk = {"directory": server.slot_save_path, "database": tmp_path / "archive.db"}
    settings = load_settings(
        upstreams=[server.url], state_dir=tmp_path / "state", disk={**disk, "min_tokens": 128}
    )
    rng = random.Random(5)
    first, second, *others = ([rng.randrange(300, 20000) for _ in range(600)] for _ in range(4))
    question = [rng.randrange(300, 20000) for _ in range(40)]
    body = {"n_predict": 4, "temperature": 0, "return_tokens": True}
    async with running_proxy(settings) as url, aiohttp.ClientSession() as client:
        status, held = await answer(
            client, url + "/completion", {**body, "prompt": [first, second]}
        )
        assert status == 200, held
        status, _ = await answer(client, url + "/completion", {**body, "prompt": others})
        assert status == 200
        counters = await proxy_counters(client, url)
        assert counters['cacheproxy_archive_saves_total{outcome="saved"}'] == 2, counters
        follow_ups = [
            prompt + result["tokens"] + question
            for prompt, result in zip((first, second), held, strict=True)
        ]
        status, again = await answer(client, url + "/completion", {**body, "prompt": follow_ups})
        counters = await proxy_counters(client, url)
    assert status == 200, again
    # all each first turn left in its slot (but the last token, never decoded) comes from disk
    assert [result["timings"]["cache_n"] for result in again] == [603, 603]
    assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 2
