"""The shadow of llama-server's own RAM cache (`--cache-ram`, on by default), against a real one.

A conversation evicted from its slot by another is kept by the server's RAM cache: the proxy
predicts the restore the server will make (its `cache_n` exactly), and the disk tier does not
save what that cache keeps. A RAM cache smaller than the proxy believes drops the entry: the
server's answer shows it, the table and the shadow are corrected, and `/metrics` counts it.
"""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp

from cacheproxy.settings import load_settings
from tests.support.metrics import proxy_counters
from tests.support.servers import LlamaServer, StartServer, serving

PROMPT_TOKENS = 600
TWO_SLOTS = {"parallel": 2, "ctx_size": 8192}


def conversation(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


async def complete(client: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "return_tokens": True}
    async with client.post(url + "/completion", json=body) as response:
        answer = await response.json()
        assert response.status == 200, answer
    return answer


def with_disk_tier(server: LlamaServer, tmp_path: Path):  # noqa: ANN201
    return load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        disk={
            "directory": server.slot_save_path,
            "database": tmp_path / "archive.db",
            "min_tokens": 128,
        },
    )


def count(counters: dict[str, float], name: str, label: str, value: str) -> float:
    return counters.get(f'cacheproxy_{name}_total{{{label}="{value}"}}', 0.0)


async def evict_and_return(client: aiohttp.ClientSession, url: str) -> tuple[dict, list[int]]:
    """Conversation A, then B takes A's slot (the router pins a slot that holds something,
    so the server's RAM cache keeps A), then A's next turn: the answer, and A's next prompt."""
    first = conversation(1)
    answer = await complete(client, url, first)
    await complete(client, url, conversation(2))
    follow_up = first + answer["tokens"] + conversation(3, 40)
    return await complete(client, url, follow_up), follow_up


async def test_ram_cache_restore_is_predicted_and_not_saved_to_disk(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(cache_ram_mib=8192, **TWO_SLOTS)  # llama-server's default budget
    async with serving(with_disk_tier(server, tmp_path)) as (url, _):
        before = await proxy_counters(client, url)
        returned, _ = await evict_and_return(client, url)
        after = await proxy_counters(client, url)
    # the server brought A back from its RAM cache: all of A and the answer's cached tokens
    assert returned["timings"]["cache_n"] >= PROMPT_TOKENS
    # ... and the proxy predicted exactly that: every prediction held
    assert (
        count(after, "predictions", "result", "match")
        - count(before, "predictions", "result", "match")
        == 3
    )
    assert count(after, "predictions", "result", "ram_load") == 0
    assert count(after, "shadow_mispredictions", "upstream", server.url) == 0
    # the disk tier left A to the RAM cache: no save, no restore from disk
    assert count(after, "archive_saves", "outcome", "saved") == 0
    assert count(after, "archive_saves", "outcome", "ram_cache") >= 1
    assert count(after, "archive_restores", "outcome", "restored") == 0


async def test_a_ram_cache_smaller_than_believed_is_corrected_and_counted(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """1 MiB holds one 600-token state of the small model, not two: saving B drops A, so the
    server cannot restore A where the shadow (told 8192 MiB) expects it to."""
    server = start_server(cache_ram_mib=1, **TWO_SLOTS)
    async with serving(with_disk_tier(server, tmp_path)) as (url, _):
        returned, prompt = await evict_and_return(client, url)
        assert returned["timings"]["cache_n"] == 0
        counters = await proxy_counters(client, url)
        assert count(counters, "shadow_mispredictions", "upstream", server.url) == 1
        assert count(counters, "predictions", "result", "mismatch") == 1
        # corrected: the slot's row is what the server holds, so the next turn is predicted
        again = prompt + returned["tokens"] + conversation(4, 40)
        answer = await complete(client, url, again)
        assert answer["timings"]["cache_n"] >= len(prompt)
        after = await proxy_counters(client, url)
    assert count(after, "shadow_mispredictions", "upstream", server.url) == 1
    assert (
        count(after, "predictions", "result", "match")
        - count(counters, "predictions", "result", "match")
        == 1
    )
