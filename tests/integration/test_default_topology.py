"""`llama-server -m MODEL` with no other flag, behind the proxy: the server's default topology.

It runs 4 slots on one unified KV cache and, after every task launch, copies each idle slot
into its 8 GiB RAM cache and empties it (`--cache-idle-slots`). The proxy finds this with its
probe, lets the server pick the slot (a task pinned to an emptied slot would never load from
the RAM cache), predicts that pick and what the RAM cache brings back, and follows the slots
the server empties. A shared-prefix trace through the proxy decodes no more than the server
alone, and every `cache_n` is predicted.
"""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import load_settings
from tests.support.metrics import sample
from tests.support.servers import LlamaServer, StartServer, serving

GROUPS, PER_GROUP, PREFIX, QUESTION = 4, 5, 512, 64


def shared_prefix_trace(seed: int = 1) -> list[list[int]]:
    """W1's shape, smaller: groups of prompts sharing a prefix, shuffled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(300, 20000) for _ in range(PREFIX)] for _ in range(GROUPS)]
    trace = [
        prefix + [rng.randrange(300, 20000) for _ in range(QUESTION)]
        for prefix in prefixes
        for _ in range(PER_GROUP)
    ]
    rng.shuffle(trace)
    return trace


async def decoded(client: aiohttp.ClientSession, url: str, trace: list[list[int]]) -> list[int]:
    """The trace sent one request after another: each answer's `prompt_n`."""
    counts = []
    for prompt in trace:
        body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "ignore_eos": True}
        async with client.post(url + "/completion", json=body) as response:
            assert response.status == 200, await response.text()
            counts.append((await response.json())["timings"]["prompt_n"])
    return counts


def settings_for(server: LlamaServer, tmp_path: Path):  # noqa: ANN201
    return load_settings(upstreams=[server.url], state_dir=tmp_path / "state")


async def test_a_server_with_no_flag_is_served_and_its_ram_cache_predicted(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    trace = shared_prefix_trace()
    alone = start_server(bare=True)
    direct = await decoded(client, alone.url, trace)
    alone.stop()

    server = start_server(bare=True)
    async with serving(settings_for(server, tmp_path)) as (url, app):
        table = app[CACHE].tables[0]
        assert table.healthy and table.clears_idle and len(table.slots) == 4
        proxied = await decoded(client, url, trace)
        predicted = {
            result: sample(app, "cacheproxy_predictions_total", result=result)
            for result in ("match", "mismatch", "ram_load", "unchecked")
        }
        misses = sample(app, "cacheproxy_shadow_mispredictions_total", upstream=server.url)
        # the slots the table says are empty are the server's emptied ones
        async with client.get(server.url + "/slots") as response:
            held = {slot["id"]: slot.get("n_prompt_tokens", 0) for slot in await response.json()}
        assert {slot.slot_id: slot.n_tokens for slot in table.slots} == held
    assert sum(proxied) <= sum(direct)
    # the RAM cache did the work: every group's prefix decoded once, whatever slot came next
    assert sum(proxied) < GROUPS * PER_GROUP * (PREFIX + QUESTION) / 2
    assert predicted == {"match": len(trace), "mismatch": 0, "ram_load": 0, "unchecked": 0}
    assert misses == 0


async def test_a_server_with_no_flag_gets_no_id_slot_and_its_own_slot_choice_is_followed(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Two conversations, the second's turn launched while the first's slot is idle: the
    server empties it into its RAM cache and loads it back for the first's next turn, on the
    slot it picks; the table names that slot, as the server's answer does."""
    rng = random.Random(3)
    first, second = ([rng.randrange(300, 20000) for _ in range(600)] for _ in range(2))
    server = start_server(bare=True)
    async with serving(settings_for(server, tmp_path)) as (url, app):
        table = app[CACHE].tables[0]
        answers = []
        for prompt in (first, second, [*first, 5, 6, 7]):
            body = {"prompt": prompt, "n_predict": 2, "temperature": 0}
            async with client.post(url + "/completion", json=body) as response:
                answers.append(await response.json())
        # the first conversation came back from the RAM cache, as predicted
        assert answers[2]["timings"]["cache_n"] >= len(first)
        assert sample(app, "cacheproxy_predictions_total", result="match") == 3
        held = [slot for slot in table.slots if not slot.empty]
        assert [slot.slot_id for slot in held] == [answers[2]["id_slot"]]
        assert held[0].known[: len(first)] == first
