"""The `shared-prefix` prompt cache on the real engine: prefixes held once in a unified KV
cache, shared by slots and cached entries, with llama-server's API and slot files unchanged."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import aiohttp
import llama_cpp

from cacheproxy.disk.slot_file import read_slot_file
from cacheproxy.embedded.server import EmbeddedServer
from cacheproxy.settings import EmbeddedSettings
from tests.support.embedded import complete, converse, embedded
from tests.support.servers import serving_tenants

# 8 MiB of cached prefixes: ~8,000 cells of the tiny model, reserved in the context. Cells stay
# in the KV cache here (these tests are about sharing them there); SPILLING moves every cell
# out as soon as one token passes it by, whatever the engine measures.
RESIDENT = {"limit_bytes": 8 << 20, "spill_after_tokens": 1e12}
SHARED: dict[str, Any] = {"prompt_cache": "shared-prefix", "prompt_cache_options": RESIDENT}
SPILLING: dict[str, Any] = {
    "prompt_cache": "shared-prefix",
    "prompt_cache_options": {"limit_bytes": 8 << 20, "spill_after_tokens": 1},
}
ADMIN_KEY = "admin-key-for-tests-0123456789"


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 30000) for _ in range(count)]


async def metrics(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with client.get(url + "/metrics") as response:
        text = await response.text()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def test_follow_ups_from_a_shared_prefix_equal_a_full_recompute(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Three users on two slots share a system prompt: after the first, every prompt starts
    from it whatever slot it lands on, and greedy outputs are those of a full prefill.

    Turns extend the previous prompt, not the previous answer (see the same test for the
    copying policies in test_embedded_engine: one-token decode steps may differ from batched
    prefill in the last bits, cache or not)."""
    system = tokens(1, 400)
    questions = [[tokens(10 + 3 * user + turn, 30) for turn in range(3)] for user in range(3)]

    async with embedded(tiny_model, tmp_path, **SHARED) as server:
        cached_outputs, cached_reuse = await converse(
            client, server.base_url, [system] * 3, questions, cache_prompt=True
        )
        report = await metrics(client, server.base_url)
        fresh_outputs, fresh_reuse = await converse(
            client, server.base_url, [system] * 3, questions, cache_prompt=False
        )
    # turn 0: the first user decodes the system prompt, the other two start from it
    assert cached_reuse[:3] == [0, 400, 400]
    # later turns: each user's whole previous prompt, from a slot or a spare sequence
    assert cached_reuse[3:] == [400 + 30 * turn for turn in (1, 1, 1, 2, 2, 2)]
    assert sum(fresh_reuse) == 0
    assert cached_outputs == fresh_outputs
    assert report["llamacpp:kv_cells_shared"] >= 400
    assert report['llamacpp:kv_cells_held_by{holder="slot_0"}'] > 0


async def test_follow_ups_from_spilled_prefixes_equal_a_full_recompute(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """The same conversations with every unused cell spilled to host RAM at once: each turn
    starts from its whole previous prompt, brought back rather than decoded, and greedy
    outputs are those of a full prefill. A slot parked while another runs (its cells handed
    to the cache) still reports what it held, saves all of it, and resumes from it."""
    system = tokens(1, 400)
    questions = [[tokens(10 + 3 * user + turn, 30) for turn in range(3)] for user in range(3)]

    async with embedded(tiny_model, tmp_path, **SPILLING) as server:
        url = server.base_url
        cached_outputs, cached_reuse = await converse(
            client, url, [system] * 3, questions, cache_prompt=True
        )
        async with client.get(url + "/slots") as reply:
            before = [slot["n_prompt_tokens"] for slot in await reply.json()]
        await complete(client, url, tokens(5, 60), id_slot=1 - before.index(max(before)))
        report = await metrics(client, url)
        async with client.get(url + "/slots") as reply:
            after = [slot["n_prompt_tokens"] for slot in await reply.json()]
        parked = before.index(max(before))
        engine = server.engine
        assert engine is not None and engine.shared_kv is not None
        assert engine.shared_kv.held_by(parked) == 0  # its cells left the slot ...
        assert after[parked] == before[parked]  # ... what it holds did not
        async with client.post(
            url + f"/slots/{parked}?action=save", json={"filename": "parked.bin"}
        ) as reply:
            assert (await reply.json())["n_saved"] == before[parked]
        fresh_outputs, fresh_reuse = await converse(
            client, url, [system] * 3, questions, cache_prompt=False
        )
    assert read_slot_file(server.slot_save_path / "parked.bin").cells == before[parked]
    assert cached_reuse[:3] == [0, 400, 400]
    assert cached_reuse[3:] == [400 + 30 * turn for turn in (1, 1, 1, 2, 2, 2)]
    assert sum(fresh_reuse) == 0
    assert cached_outputs == fresh_outputs
    assert report["llamacpp:kv_cells_spilled"] > 0
    assert report["llamacpp:kv_spill_after_tokens"] == 1


async def test_more_tokens_held_than_the_cache_has_cells(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """The proof that seq_cp shares cells rather than copying them: the sequences together
    hold more tokens than the unified cache has cells, and every decode still finds room."""
    prefix = tokens(2, 1500)
    # ~1,000 cells of the tiny model
    options = {**RESIDENT, "limit_bytes": 1 << 20, "spare_sequences": 16}
    async with embedded(
        tiny_model, tmp_path, parallel=2, **{**SHARED, "prompt_cache_options": options}
    ) as server:
        for question in range(8):
            answer = await complete(client, server.base_url, prefix + tokens(100 + question, 40))
            assert answer["timings"]["cache_n"] == (0 if question == 0 else 1500)
        engine = server.engine
        assert engine is not None
        report = engine.kv_sharing_report()
        pool = llama_cpp.llama_n_ctx(engine._ctx)
        assert report["kv_cells_held"] > pool
        assert report["kv_cells_cached"] * engine.kv_bytes_per_cell <= 1 << 20
        assert engine.policy.size_bytes() <= 1 << 20


async def test_slot_files_keep_the_per_slot_layout_and_cross_policies(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """A slot saved from the unified cache reads as one from a llama-server with the same -np
    (one stream per slot); files cross between a copying and a sharing engine."""
    prompt = tokens(3, 250)
    held = 250 + 3
    async with embedded(tiny_model, tmp_path / "copying") as copying:
        first = await complete(client, copying.base_url, prompt, id_slot=1)
        async with client.post(
            copying.base_url + "/slots/1?action=save", json={"filename": "plain.bin"}
        ) as reply:
            assert (await reply.json())["n_saved"] == held
    plain = read_slot_file(copying.slot_save_path / "plain.bin")

    async with embedded(tiny_model, tmp_path / "copying", **SHARED) as server:
        url = server.base_url
        async with client.post(
            url + "/slots/0?action=restore", json={"filename": "plain.bin"}
        ) as reply:
            assert (await reply.json())["n_restored"] == held
        answer = await complete(client, url, prompt, id_slot=0)
        assert answer["timings"]["cache_n"] == 249 and answer["tokens"] == first["tokens"]
        # the restored cells joined the tree: another slot starts from them too
        other = await complete(client, url, [*prompt, *first["tokens"][:3], 5], id_slot=1)
        assert other["timings"]["cache_n"] == held
        async with client.post(
            url + "/slots/1?action=save", json={"filename": "shared.bin"}
        ) as reply:
            assert (await reply.json())["n_saved"] == held + 1 + 3
    shared = read_slot_file(server.slot_save_path / "shared.bin")
    assert (shared.n_stream, plain.n_stream) == (2, 2)
    assert shared.cells == held + 1 + 3

    async with embedded(tiny_model, tmp_path / "copying") as copying:
        url = copying.base_url
        async with client.post(
            url + "/slots/0?action=restore", json={"filename": "shared.bin"}
        ) as reply:
            assert (await reply.json())["n_restored"] == held + 4
        again = await complete(client, url, [*prompt, *first["tokens"][:3], 5], id_slot=0)
        assert again["timings"]["cache_n"] == held
        assert again["tokens"] == other["tokens"]


async def test_no_tenant_starts_from_another_tenants_prefix(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """The engine cannot tell tenants apart, so its sharing must never meet two of them: the
    proxy finds its RAM cache by probing and refuses to serve tenants through it; and a request
    the proxy sends with cache_prompt false (a slot holding someone else's text) starts from
    nothing."""
    prefix = tokens(4, 600)
    engine = EmbeddedServer(
        EmbeddedSettings(parallel=2, ctx_size=4096, threads=1, **SHARED),
        tiny_model,
        tmp_path / "engine",
    )
    await engine.start()
    try:
        url = engine.base_url
        # the proxy probes the fresh engine's empty slots, as it does any upstream it starts on
        async with serving_tenants(url, tmp_path, ADMIN_KEY) as (proxy_url, registry):
            await complete(client, url, prefix + tokens(5, 10))
            blind = await complete(client, url, prefix + tokens(6, 10), cache_prompt=False)
            assert blind["timings"]["cache_n"] == 0
            seen = await complete(client, url, prefix + tokens(7, 10))
            assert seen["timings"]["cache_n"] == 600  # the pair: sharing does happen otherwise

            keys = [registry.create(name)[1] for name in ("alice", "bob")]
            await asyncio.sleep(2 * registry.refresh_interval_s)  # the proxy's view of the registry
            answers = []
            for key, seed in zip(keys, (8, 9), strict=True):
                body = {"prompt": prefix + tokens(seed, 10), "n_predict": 2}
                headers = {"Authorization": f"Bearer {key}"}
                async with client.post(
                    proxy_url + "/completion", json=body, headers=headers
                ) as response:
                    answers.append((response.status, await response.json()))
        for status, body in answers:
            assert status == 503, body
            assert "shared by all tenants" in body["error"]["message"]
            # and it names the setting that turns the engine's cache off
            assert "embedded.prompt_cache_options" in body["error"]["message"]
    finally:
        await engine.stop()
