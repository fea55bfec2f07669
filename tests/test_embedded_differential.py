"""The `llama-server` prompt-cache policy in the embedded engine against a real llama-server.

One sequential multi-turn trace, more conversations than slots, a 1 MiB RAM cache (about a
thousand tokens of the test model's KV, so entries are evicted): every request's
`timings.cache_n` must be the same on both.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp

from tests.servers import StartServer
from tests.test_embedded_engine import embedded

SLOTS = 4
CACHE_RAM_MIB = 1
CONVERSATIONS = 6
TURNS = 4
OPENING_TOKENS = 96
QUESTION_TOKENS = 24
N_PREDICT = 8


def sequential_trace(seed: int) -> list[tuple[str, list[int]]]:
    """(conversation, prompt) in issue order. Each turn extends the previous prompt by a new
    question, not by the answer, so both servers see identical prompts whatever they generate;
    the turns of different conversations are interleaved in a shuffled order."""
    rng = random.Random(seed)
    prompts: dict[str, list[int]] = {}
    order = [
        f"user-{user}"
        for turn in range(TURNS)
        for user in rng.sample(range(CONVERSATIONS), CONVERSATIONS)
    ]
    trace = []
    for user in order:
        grown = prompts.get(user) or [rng.randrange(100, 30000) for _ in range(OPENING_TOKENS)]
        grown = grown + [rng.randrange(100, 30000) for _ in range(QUESTION_TOKENS)]
        prompts[user] = grown
        trace.append((user, grown))
    # a prompt sent again in full: llama-server's n-1 rule, once the slot was restored
    trace.append(trace[2])
    return trace


async def cache_n_sequence(
    client: aiohttp.ClientSession, url: str, trace: list[tuple[str, list[int]]]
) -> list[int]:
    reused = []
    for _, prompt in trace:
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": N_PREDICT,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with client.post(url + "/completion", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["timings"]["predicted_n"] == N_PREDICT
        reused.append(answer["timings"]["cache_n"])
    return reused


async def test_cache_n_matches_llama_server_request_by_request(
    start_server: StartServer, tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    trace = sequential_trace(seed=7)
    server = start_server(parallel=SLOTS, cache_ram_mib=CACHE_RAM_MIB)
    reference = await cache_n_sequence(client, server.url, trace)
    server.stop()

    async with embedded(
        tiny_model,
        tmp_path,
        parallel=SLOTS,
        prompt_cache="llama-server",
        prompt_cache_options={"limit_bytes": CACHE_RAM_MIB << 20},
    ) as engine_server:
        ours = await cache_n_sequence(client, engine_server.base_url, trace)
        engine = engine_server.engine
        assert engine is not None
        restores = engine.stats.ram_cache_restores
        saves = engine.stats.ram_cache_saves
        cached_bytes = engine.policy.size_bytes()

    print("cache_n, llama-server:", reference)
    print("cache_n, embedded:    ", ours)
    assert ours == reference
    # the trace exercised the RAM tier, and it was too small to keep everything
    assert restores >= 3
    assert saves > len(engine.policy.entries()) + restores
    assert 0 < cached_bytes <= CACHE_RAM_MIB << 20
