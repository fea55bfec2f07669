"""A tenant that hides its cache signals sees the same answer fields whether its prompt came from
the cache or not, on every route and stream; a tenant that does not hide them sees the reuse.

Each request is sent three times: the second and third are served from the slot the first one
filled (the server's own `prompt_tokens_cached_total` proves it), so any field that follows the
cache would change between the first run and the others.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.servers import LlamaServer, StartServer, serving_tenants

# every answer field that can follow the cache, wherever it appears
CACHE_FIELDS = frozenset(
    {
        "cache_n",
        "prompt_n",
        "prompt_ms",
        "prompt_per_token_ms",
        "prompt_per_second",
        "cached_tokens",
        "input_tokens",
        "prompt_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
        "tokens_cached",
        "n_prompt_tokens_cache",
        "prompt_progress",
    }
)
REUSE_FIELDS = ("cache_n", "cached_tokens", "cache_read_input_tokens")


def text(seed: str) -> str:
    """A prompt of its own for each route, so that each route's first run is a cold one."""
    rng = random.Random(seed)
    words = ("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(220))
    return " ".join(words)


def messages(seed: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text(seed)}]


ROUTES: dict[str, dict[str, Any]] = {
    "/completion": {"prompt": text("native"), "n_predict": 4},
    "/v1/completions": {"prompt": text("completions"), "max_tokens": 4},
    "/v1/chat/completions": {"messages": messages("chat"), "max_tokens": 4},
    "/v1/messages": {"model": "m", "messages": messages("anthropic"), "max_tokens": 4},
    "/v1/responses": {"model": "m", "input": text("responses"), "max_output_tokens": 4},
}


@dataclass
class Setup:
    url: str
    server: LlamaServer
    hiding_key: str
    showing_key: str


@pytest.fixture
async def setup(start_server: StartServer, tmp_path: Path) -> AsyncIterator[Setup]:
    server = start_server(parallel=2)
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        _, hiding = registry.create("quiet", hide_cache_signals=True)
        _, showing = registry.create("open")
        yield Setup(url, server, hiding, showing)


def cache_fields(document: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every cache-dependent field of an answer or event, with where it was found."""
    found: list[tuple[str, Any]] = []
    if isinstance(document, dict):
        for key, value in document.items():
            if key in CACHE_FIELDS:
                found.append((f"{path}.{key}", value))
            found += cache_fields(value, f"{path}.{key}")
    elif isinstance(document, list):
        for index, item in enumerate(document):
            found += cache_fields(item, f"{path}[{index}]")
    return found


async def send(
    http: aiohttp.ClientSession, setup: Setup, key: str, route: str, stream: bool
) -> list[tuple[str, Any]]:
    body = {**ROUTES[route], "temperature": 0, "stream": stream}
    if stream and route.startswith("/v1/c"):
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(setup.url + route, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        if not stream:
            return cache_fields(await response.json())
        text = await response.text()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    fields = []
    for number, event in enumerate(events):
        if event != "[DONE]":
            fields += cache_fields(orjson.loads(event), f"event{number}")
    return fields


async def upstream_cached_total(http: aiohttp.ClientSession, server: LlamaServer) -> float:
    async with http.get(server.url + "/metrics") as response:
        exposition = await response.text()
    match = re.search(r"^llamacpp:prompt_tokens_cached_total (\S+)$", exposition, re.MULTILINE)
    assert match, exposition
    return float(match.group(1))


def reuse(fields: list[tuple[str, Any]]) -> int:
    return max(
        (value for path, value in fields if path.rsplit(".", 1)[-1] in REUSE_FIELDS), default=0
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_hidden_cache_signals_do_not_change_with_the_cache(
    setup: Setup, stream: bool
) -> None:
    failures = {}
    async with aiohttp.ClientSession() as http:
        for route in ROUTES:
            before = await upstream_cached_total(http, setup.server)
            hidden = [await send(http, setup, setup.hiding_key, route, stream) for _ in range(3)]
            reused_while_hidden = await upstream_cached_total(http, setup.server) - before
            shown = [await send(http, setup, setup.showing_key, route, stream) for _ in range(3)]
            if problem := judge(hidden, reused_while_hidden, shown):
                failures[route] = problem
    assert not failures, failures


def judge(
    hidden: list[list[tuple[str, Any]]], reused_while_hidden: float, shown: list[list]
) -> str | None:
    """What is wrong with one route's answers, or None."""
    if reused_while_hidden <= 0:
        return "the server did not reuse the hiding tenant's prompt: the test proves nothing"
    if not hidden[0]:
        return "no usage or timings in the answer at all"
    if not hidden[0] == hidden[1] == hidden[2] or reuse(hidden[0]) != 0:
        return f"the hiding tenant sees the cache: {hidden}"
    if max(reuse(fields) for fields in shown) <= 0:
        return f"the showing tenant sees no reuse: {shown}"
    return None
