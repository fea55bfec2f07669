"""The `llama-server` prompt-cache policy in the embedded engine against a real llama-server.

One sequential multi-turn trace (each turn is the conversation so far, the previous answer
included, plus a new question), more conversations than slots, a 1 MiB RAM cache (about a
thousand tokens of the test model's KV, so entries are evicted), every fifth request pinned to a
slot as a routing proxy pins them: request by request, both must pick the same slot, reuse the
same `timings.cache_n` and generate the same greedy tokens, and their saved states must have the
same size (what the byte budget counts).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.embedded import embedded
from tests.support.servers import StartServer

SLOTS = 4
CACHE_RAM_MIB = 1
CONVERSATIONS = 6
TURNS = 4
OPENING_TOKENS = 96
QUESTION_TOKENS = 24
N_PREDICT = 8
PIN_EVERY = 5


async def run_trace(
    client: aiohttp.ClientSession, url: str, seed: int
) -> list[tuple[int, int, tuple[int, ...]]]:
    """(id_slot, cache_n, generated tokens) per request, then (-1, size of slot 0's file, ())."""
    rng = random.Random(seed)
    histories: dict[int, list[int]] = {}
    records: list[tuple[int, int, tuple[int, ...]]] = []
    for _ in range(TURNS):
        for user in rng.sample(range(CONVERSATIONS), CONVERSATIONS):
            opening = histories.get(user) or [
                rng.randrange(100, 30000) for _ in range(OPENING_TOKENS)
            ]
            prompt = opening + [rng.randrange(100, 30000) for _ in range(QUESTION_TOKENS)]
            pinned = rng.randrange(SLOTS) if len(records) % PIN_EVERY == PIN_EVERY - 1 else -1
            body: dict[str, Any] = {
                "prompt": prompt,
                "n_predict": N_PREDICT,
                "temperature": 0,
                "ignore_eos": True,
                "return_tokens": True,
                "id_slot": pinned,
            }
            async with client.post(url + "/completion", json=body) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
            histories[user] = prompt + answer["tokens"]
            records.append(
                (answer["id_slot"], answer["timings"]["cache_n"], tuple(answer["tokens"]))
            )
    async with client.post(url + "/slots/0?action=save", json={"filename": "s0.bin"}) as response:
        records.append((-1, (await response.json())["n_written"], ()))
    return records


async def test_embedded_llama_server_policy_matches_llama_server_request_by_request(
    start_server: StartServer, tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    server = start_server(
        parallel=SLOTS, cache_ram_mib=CACHE_RAM_MIB, extra_args=("--threads", "1")
    )
    reference = await run_trace(client, server.url, seed=7)
    server.stop()

    async with embedded(
        tiny_model,
        tmp_path,
        parallel=SLOTS,
        prompt_cache="llama-server",
        prompt_cache_options={"limit_bytes": CACHE_RAM_MIB << 20},
    ) as engine_server:
        ours = await run_trace(client, engine_server.base_url, seed=7)
        engine = engine_server.engine
        assert engine is not None
        restores = engine.stats.ram_cache_restores
        saves = engine.stats.ram_cache_saves
        cached_bytes = engine.policy.size_bytes()
        still_cached = len(engine.policy.entries())

    print("(id_slot, cache_n), llama-server:", [record[:2] for record in reference])
    print("(id_slot, cache_n), embedded:    ", [record[:2] for record in ours])
    assert ours == reference
    # the trace went through the RAM tier, which was too small to keep everything
    assert restores >= 3
    assert saves > still_cached + restores
    assert 0 < cached_bytes <= CACHE_RAM_MIB << 20


async def test_greedy_answers_with_and_without_the_cache_are_llama_servers(
    start_server: StartServer, tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Full multi-turn conversations (answers included), cache on and off, on both servers.

    Reusing KV that one-token decode steps wrote is not bit-identical to prefilling the same
    tokens in a batch, and on the random model's near-tied logits one greedy pick in this trace
    flips with the cache on, in llama-server itself. The engine must reproduce exactly that:
    the same tokens as llama-server with the cache, and the same without it.
    """
    openings = [random.Random(10 + user).choices(range(100, 30000), k=150) for user in range(3)]
    questions = [
        [random.Random(20 + 3 * user + turn).choices(range(100, 30000), k=30) for turn in range(3)]
        for user in range(3)
    ]

    async def conversations(url: str, cache_prompt: bool) -> list[list[int]]:
        histories = [list(opening) for opening in openings]
        answers = []
        for turn in range(3):
            for user in range(3):
                histories[user] += questions[user][turn]
                body = {
                    "prompt": histories[user],
                    "n_predict": 8,
                    "temperature": 0,
                    "return_tokens": True,
                    "cache_prompt": cache_prompt,
                }
                async with client.post(url + "/completion", json=body) as response:
                    answer = (await response.json())["tokens"]
                histories[user] += answer
                answers.append(answer)
        return answers

    server = start_server(parallel=2, ctx_size=4096, cache_ram_mib=8, extra_args=("--threads", "1"))
    reference = {cache: await conversations(server.url, cache) for cache in (True, False)}
    server.stop()
    async with embedded(tiny_model, tmp_path, parallel=2) as engine_server:
        ours = {
            cache: await conversations(engine_server.base_url, cache) for cache in (True, False)
        }
    assert ours == reference
