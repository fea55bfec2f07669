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


def sequential_trace(seed: int) -> list[tuple[str, list[int], int | None]]:
    """(conversation, prompt, id_slot) in issue order. Each turn extends the previous prompt by
    a new question, not by the answer, so both servers see identical prompts whatever they
    generate; the turns of different conversations are interleaved in a shuffled order, and
    every fifth request names a slot (`id_slot`), as a routing proxy does."""
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
        pinned = rng.randrange(SLOTS) if len(trace) % 5 == 4 else None
        trace.append((user, grown, pinned))
    # a prompt sent again in full: llama-server's n-1 rule, once the slot was restored
    trace.append(trace[2])
    return trace


async def cache_n_sequence(
    client: aiohttp.ClientSession, url: str, trace: list[tuple[str, list[int], int | None]]
) -> list[tuple[int, int]]:
    """(id_slot, cache_n) per request; then the size of slot 0's saved state."""
    reused = []
    for _, prompt, pinned in trace:
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": N_PREDICT,
            "temperature": 0,
            "ignore_eos": True,
            "id_slot": -1 if pinned is None else pinned,
        }
        async with client.post(url + "/completion", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["timings"]["predicted_n"] == N_PREDICT
        reused.append((answer["id_slot"], answer["timings"]["cache_n"]))
    async with client.post(url + "/slots/0?action=save", json={"filename": "s0.bin"}) as response:
        reused.append((-1, (await response.json())["n_written"]))
    return reused


async def test_cache_n_matches_llama_server_request_by_request(
    start_server: StartServer, tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    trace = sequential_trace(seed=7)
    server = start_server(
        parallel=SLOTS, cache_ram_mib=CACHE_RAM_MIB, extra_args=("--threads", "1")
    )
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
    # same slots, same reuse, and the same state sizes (what the byte budget counts)
    assert ours == reference
    # the trace exercised the RAM tier, and it was too small to keep everything
    assert restores >= 3
    assert saves > len(engine.policy.entries()) + restores
    assert 0 < cached_bytes <= CACHE_RAM_MIB << 20
