"""Hostile prompts, through a real llama-server with tenants configured: invalid token ids and
prompts over the context are refused before any work, in llama-server's own words; big bodies
are parsed without stalling the proxy; nothing of a refused request is kept."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from cacheproxy.http.app_keys import CACHE, SETTINGS
from cacheproxy.http.spill_folder import BODY_PREFIX
from cacheproxy.settings import load_settings
from cacheproxy.slots.executor import CacheLayer
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.servers import LlamaServer, serving

N_CTX = 4096  # the shared llama-server: -c 16384 over 4 slots
BAD_IDS = [2**40, 1e300, True, -1, 32000, None, [[7]]]
PROMPT_IDS = [1, 450, 4996, 17354, 1701, 432]

Body = Callable[[object], dict]
# every place a task body may carry token ids, on every route that reads them
ID_FORMS: list[tuple[str, Body]] = [
    ("/completion", lambda bad: {"prompt": [*PROMPT_IDS, bad], "n_predict": 1}),
    ("/completion", lambda bad: {"prompt": [bad, *PROMPT_IDS], "n_predict": 1}),
    # a lone number (a lone list or null is a prompt shape, not an id)
    ("/completion", lambda bad: {"prompt": bad if isinstance(bad, int | float) else 2**40}),
    ("/completions", lambda bad: {"prompt": ["Hello", 450, bad], "n_predict": 1}),
    ("/v1/completions", lambda bad: {"prompt": [*PROMPT_IDS, bad], "max_tokens": 1}),
    ("/v1/completions", lambda bad: {"prompt": [PROMPT_IDS, [1, bad]], "max_tokens": 1}),
    ("/completion", lambda bad: {"prompt": {"prompt_string": ["Hi", 450, bad]}, "n_predict": 1}),
    ("/infill", lambda bad: {"input_prefix": "a", "input_suffix": "b", "prompt": [1, bad]}),
    ("/infill", lambda bad: {"input_prefix": ["def f", 450, bad], "input_suffix": "b"}),
    ("/infill", lambda bad: {"input_prefix": "a", "input_suffix": [450, bad]}),
    ("/infill", lambda bad: {"input_prefix": "a", "input_extra": [{"text": bad}]}),
    ("/embedding", lambda bad: {"content": [*PROMPT_IDS, bad]}),
    ("/v1/embeddings", lambda bad: {"input": [PROMPT_IDS, [bad, 450]]}),
]


@dataclass
class Proxy:
    url: str
    app: web.Application
    headers: dict[str, str]
    server: LlamaServer

    @property
    def cache(self) -> CacheLayer:
        return self.app[CACHE]


@pytest.fixture
async def proxy(llama_server: LlamaServer, tmp_path: Path) -> AsyncIterator[Proxy]:
    database = tmp_path / "tenants.db"
    settings = load_settings(
        upstreams=[llama_server.url], state_dir=tmp_path / "state", tenants={"database": database}
    )
    with TenantRegistry(database) as registry:
        _, key = registry.create("mallory")
        async with serving(settings) as (url, app):
            yield Proxy(url, app, {"Authorization": f"Bearer {key}"}, llama_server)


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        yield session


async def upstream_work(client: aiohttp.ClientSession, server: LlamaServer) -> dict[str, float]:
    """What llama-server has run: prompt tokens and decode calls (tokenizing is not counted)."""
    async with client.get(server.url + "/metrics") as response:
        text = await response.text()
    figures = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("llamacpp:prompt_tokens_total", "llamacpp:n_decode_total"):
            figures[name] = float(value)
    assert len(figures) == 2, text
    return figures


def stored(proxy: Proxy) -> tuple[int, int, list[tuple[int, ...]]]:
    """What the proxy keeps about requests: memo entries and bytes, and the slot table."""
    memo = proxy.cache.mirror.memo
    table = [tuple(slot.known) for t in proxy.cache.tables for slot in t.slots]
    return len(memo), memo.bytes, table


async def post(
    client: aiohttp.ClientSession, proxy: Proxy, path: str, body: dict | bytes
) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {**proxy.headers, "Content-Type": "application/json"}
    async with client.post(proxy.url + path, data=data, headers=headers) as response:
        return response.status, orjson.loads(await response.read())


def post_from_thread(proxy: Proxy, path: str, body: bytes) -> tuple[int, dict]:
    """`post`, blocking, for a thread of its own."""
    url = urllib.parse.urlsplit(proxy.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    try:
        headers = {**proxy.headers, "Content-Type": "application/json"}
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, orjson.loads(response.read())
    finally:
        connection.close()


async def assert_serving(client: aiohttp.ClientSession, proxy: Proxy) -> None:
    status, answer = await post(
        client, proxy, "/completion", {"prompt": PROMPT_IDS, "n_predict": 1}
    )
    assert status == 200, answer
    assert answer["tokens_predicted"] == 1


@pytest.mark.parametrize(("path", "make_body"), ID_FORMS)
async def test_invalid_ids_are_refused_in_llama_servers_words(
    client: aiohttp.ClientSession, proxy: Proxy, path: str, make_body: Body
) -> None:
    before_work, before_stored = await upstream_work(client, proxy.server), stored(proxy)
    for bad in BAD_IDS:
        status, answer = await post(client, proxy, path, make_body(bad))
        assert status == 400, (bad, answer)
        assert answer == {
            "error": {
                "code": 400,
                "message": answer["error"]["message"],
                "type": "invalid_request_error",
            }
        }
        if "input_extra" not in make_body(0):
            assert answer["error"]["message"] == "Prompt contains invalid tokens"
    assert await upstream_work(client, proxy.server) == before_work  # nothing reached a slot
    assert stored(proxy) == before_stored
    await assert_serving(client, proxy)


async def test_id_prompts_over_the_context_are_refused_without_the_upstream(
    client: aiohttp.ClientSession, proxy: Proxy
) -> None:
    before_work, before_stored = await upstream_work(client, proxy.server), stored(proxy)
    for path, body, n in [
        ("/completion", {"prompt": [450] * N_CTX}, N_CTX),
        ("/v1/completions", {"prompt": [450] * 9000, "max_tokens": 1}, 9000),
        ("/completion", {"prompt": [PROMPT_IDS, [450] * 5000]}, 5000),
        ("/completion", {"prompt": [450] * 5_000_000}, 5_000_000),  # ~20 MB: the worker's
    ]:
        status, answer = await post(client, proxy, path, body)
        assert status == 400
        assert answer == {
            "error": {
                "code": 400,
                "message": f"request ({n} tokens) exceeds the available context size"
                f" ({N_CTX} tokens), try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": n,
                "n_ctx": N_CTX,
            }
        }
    assert await upstream_work(client, proxy.server) == before_work
    assert stored(proxy) == before_stored
    await assert_serving(client, proxy)


async def test_text_prompts_over_the_context_are_refused_after_tokenizing_only(
    client: aiohttp.ClientSession, proxy: Proxy
) -> None:
    long_text = " ".join(f"word{i}" for i in range(3000))  # well over 4096 tokens
    memo_before = len(proxy.cache.mirror.memo)
    before_work, before_stored = await upstream_work(client, proxy.server), stored(proxy)
    for path, body in [
        ("/completion", {"prompt": long_text, "n_predict": 1}),
        ("/v1/completions", {"prompt": [long_text], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
    ]:
        status, answer = await post(client, proxy, path, body)
        assert status == 400, answer
        error = answer["error"]
        assert error["type"] == "exceed_context_size_error"
        assert error["n_ctx"] == N_CTX and error["n_prompt_tokens"] >= N_CTX
        assert error["message"] == (
            f"request ({error['n_prompt_tokens']} tokens) exceeds the available context size"
            f" ({N_CTX} tokens), try increasing it"
        )
    assert await upstream_work(client, proxy.server) == before_work
    assert stored(proxy) == before_stored
    assert len(proxy.cache.mirror.memo) == memo_before  # a refused prompt is not memoised
    await assert_serving(client, proxy)


async def test_a_text_far_over_the_context_is_refused_at_once(
    client: aiohttp.ClientSession, proxy: Proxy
) -> None:
    huge = "hello world " * 2_000_000  # 24 MB: llama-server would tokenize it for minutes
    before_work, before_stored = await upstream_work(client, proxy.server), stored(proxy)
    lookups = proxy.cache.mirror.lookups
    status, answer = await post(client, proxy, "/completion", {"prompt": huge})
    assert status == 400
    error = answer["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == N_CTX
    assert error["message"].startswith("request (at least ")
    assert proxy.cache.mirror.lookups == lookups  # never sent to be tokenized
    assert await upstream_work(client, proxy.server) == before_work
    assert stored(proxy) == before_stored


async def test_health_answers_while_a_big_body_is_parsed(
    client: aiohttp.ClientSession, proxy: Proxy
) -> None:
    big = orjson.dumps({"prompt": [1000 + i % 20000 for i in range(12_000_000)]})  # ~70 MB
    # sent from another thread: an aiohttp client on this loop would copy the 70 MB into its
    # transport in one step of its own, which is the test's CPU, not the proxy's
    request = asyncio.ensure_future(asyncio.to_thread(post_from_thread, proxy, "/completion", big))
    # the proxy runs on this thread's event loop: the CPU the thread spends between two answers
    # is what the loop did then, whatever the machine's load (a parse of this body on the loop
    # takes over a second of CPU in one step; reading its bytes, a few ms a step)
    answered = [time.thread_time()]
    while not request.done():
        async with client.get(proxy.url + "/health") as response:
            assert response.status == 200
        answered.append(time.thread_time())
        await asyncio.sleep(0.05)
    status, answer = await request
    assert status == 400 and answer["error"]["type"] == "exceed_context_size_error"
    assert len(answered) >= 5  # it answered, again and again, while the body was worked on
    loop_cpu = [later - earlier for earlier, later in itertools.pairwise(answered)]
    assert max(loop_cpu) < 0.5, loop_cpu
    await assert_serving(client, proxy)


def spill_files(folder: Path) -> set[Path]:
    """The spilled bodies in a proxy's spill folder (each running proxy has a subfolder)."""
    return set(folder.glob(f"*/{BODY_PREFIX}*"))


async def test_a_big_body_that_fits_is_parsed_aside_and_served(
    client: aiohttp.ClientSession, proxy: Proxy
) -> None:
    folder = proxy.app[SETTINGS].body_spill_dir()
    before = spill_files(folder)
    body = {"prompt": PROMPT_IDS, "n_predict": 1, "padding": "x" * (3 << 20)}  # over 1 MiB
    status, answer = await post(client, proxy, "/completion", body)
    assert status == 200, answer
    assert answer["tokens_predicted"] == 1
    assert spill_files(folder) == before  # the spilled copy is gone


async def test_a_big_body_over_the_limit_is_a_413_and_leaves_nothing(
    client: aiohttp.ClientSession, llama_server: LlamaServer, tmp_path: Path
) -> None:
    settings = load_settings(
        upstreams=[llama_server.url], state_dir=tmp_path / "state", max_body_bytes=3 << 20
    )
    before = spill_files(settings.body_spill_dir())
    async with serving(settings) as (url, _):
        body = orjson.dumps({"prompt": "x" * (4 << 20)})
        async with client.post(url + "/completion", data=body) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == 413
    assert spill_files(settings.body_spill_dir()) == before
