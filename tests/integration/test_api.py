"""Every llama-server route family answers through the proxy as it answers directly."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.completions import without
from tests.support.servers import LlamaServer

PROMPT_IDS = [450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]
# cache_prompt false: every run decodes the whole prompt the same way, so greedy output is
# identical between the direct and the proxied request whatever the slots held before.
GREEDY = {"temperature": 0, "n_predict": 8, "cache_prompt": False, "seed": 1}

# Fields that differ between two identical requests: clocks, ids, which slot served it, and how
# much of the prompt that slot happened to hold (usage reports cached tokens).
VOLATILE = frozenset(
    {
        "timings",
        "created",
        "created_at",
        "id",
        "id_slot",
        "system_fingerprint",
        "tokens_cached",
        "t_start",
        "id_task",
        "completed_at",
        "usage",
    }
)


def stable(document: Any) -> Any:
    return without(document, VOLATILE)


async def call(
    client: aiohttp.ClientSession, method: str, url: str, body: dict | None
) -> tuple[int, str, bytes]:
    async with client.request(method, url, json=body) as response:
        return response.status, response.content_type, await response.read()


ROUTES: list[tuple[str, str, dict | None]] = [
    ("GET", "/health", None),
    ("GET", "/v1/health", None),
    ("GET", "/props", None),
    ("GET", "/models", None),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"content": "Hello world", "add_special": True}),
    ("POST", "/detokenize", {"tokens": PROMPT_IDS}),
    ("POST", "/apply-template", {"messages": MESSAGES}),
    ("POST", "/completion", {"prompt": PROMPT_IDS, **GREEDY}),
    ("POST", "/completions", {"prompt": "The sky is", **GREEDY}),
    ("POST", "/v1/completions", {"prompt": "The sky is", **GREEDY}),
    ("POST", "/chat/completions", {"messages": MESSAGES, **GREEDY}),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, **GREEDY}),
    ("POST", "/v1/messages", {"messages": MESSAGES[1:], "max_tokens": 8, **GREEDY}),
    ("POST", "/v1/responses", {"input": "Name three colours.", **GREEDY}),
    ("POST", "/infill", {"input_prefix": "def f(", "input_suffix": "):", **GREEDY}),
    ("POST", "/embedding", {"content": "Hello"}),
    ("POST", "/embeddings", {"content": "Hello"}),
    ("POST", "/v1/embeddings", {"input": "Hello"}),
    ("POST", "/rerank", {"query": "sky", "documents": ["blue", "green"]}),
    ("POST", "/v1/rerank", {"query": "sky", "documents": ["blue", "green"]}),
    ("GET", "/no-such-route", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
async def test_route_answers_as_llama_server_does(
    client: aiohttp.ClientSession,
    llama_server: LlamaServer,
    proxy: str,
    method: str,
    path: str,
    body: dict | None,
) -> None:
    direct = await call(client, method, llama_server.url + path, body)
    proxied = await call(client, method, proxy + path, body)
    assert proxied[0] == direct[0]
    assert proxied[1] == direct[1]
    if direct[1] == "application/json":
        assert stable(orjson.loads(proxied[2])) == stable(orjson.loads(direct[2]))
    else:
        assert proxied[2] == direct[2]


async def test_generation_routes_really_generate(client: aiohttp.ClientSession, proxy: str) -> None:
    """Guards the comparison above: the generation routes answered 200 with text, not an error."""
    status, _, body = await call(
        client, "POST", proxy + "/completion", {"prompt": PROMPT_IDS, **GREEDY}
    )
    answer = orjson.loads(body)
    assert status == 200
    assert answer["tokens_predicted"] == GREEDY["n_predict"]
    status, _, body = await call(
        client, "POST", proxy + "/v1/chat/completions", {"messages": MESSAGES, **GREEDY}
    )
    assert status == 200
    assert orjson.loads(body)["choices"][0]["message"]["content"]


async def test_slots_and_metrics_pass_through(
    client: aiohttp.ClientSession, llama_server: LlamaServer, proxy: str
) -> None:
    async with client.get(proxy + "/slots") as response:
        slots = await response.json()
    assert response.status == 200
    assert [slot["id"] for slot in slots] == [0, 1, 2, 3]

    async with client.get(proxy + "/metrics") as response:
        text = await response.text()
    assert response.status == 200
    assert response.content_type == "text/plain"
    assert "llamacpp:prompt_tokens_total" in text


async def test_slot_actions_pass_through(
    client: aiohttp.ClientSession, llama_server: LlamaServer, proxy: str
) -> None:
    async with client.post(
        proxy + "/completion", json={"prompt": PROMPT_IDS, "n_predict": 2, "id_slot": 3}
    ) as response:
        assert response.status == 200
    async with client.post(proxy + "/slots/3?action=save", json={"filename": "t.bin"}) as response:
        saved = await response.json()
    assert response.status == 200
    assert saved["n_saved"] >= len(PROMPT_IDS)
    assert (llama_server.slot_save_path / "t.bin").stat().st_size == saved["n_written"]
    async with client.post(proxy + "/slots/3?action=erase") as response:
        assert (await response.json())["n_erased"] == saved["n_saved"]
