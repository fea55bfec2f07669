"""The embedded engine on the real llama-cpp-python library and the generated test model."""

from __future__ import annotations

import asyncio
import queue
import random
import threading
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from cacheproxy.disk.slot_file import read_slot_file
from cacheproxy.embedded.engine import EmbeddedEngine, EngineConfig, EngineError
from cacheproxy.embedded.server import EmbeddedServer
from cacheproxy.plugins import load_plugin
from cacheproxy.prompt_cache import PromptCacheDeps
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.settings import EmbeddedSettings
from tests.support.embedded import N_PREDICT, complete, converse, embedded
from tests.support.waiting import wait_for


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(count)]


async def test_cache_n_is_what_the_policy_restored(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """One slot, two conversations: the second pushes the first into the RAM cache, and the
    first's next turn is restored from it, reusing exactly the entry's common prefix."""
    first, second = tokens(1, 300), tokens(2, 300)
    follow_up = [*first, *tokens(3, 20)]
    async with embedded(tiny_model, tmp_path, parallel=1) as server:
        url = server.base_url
        assert (await complete(client, url, first))["timings"]["cache_n"] == 0
        assert (await complete(client, url, second))["timings"]["cache_n"] == 0
        assert server.engine is not None
        cached = [entry.tokens for entry in server.engine.policy.entries()]
        # the slot held the first prompt and all but the last generated token
        assert [len(entry) for entry in cached] == [300 + N_PREDICT - 1]
        answer = await complete(client, url, follow_up)
        assert answer["timings"]["cache_n"] == 300
        assert answer["timings"]["prompt_n"] == 20
        # the restored entry left the cache, and the slot that was overwritten went in
        assert [entry.tokens[:300] for entry in server.engine.policy.entries()] == [tuple(second)]
        assert server.engine.stats.ram_cache_restores == 1

    async with embedded(
        tiny_model, tmp_path, parallel=1, prompt_cache_options={"limit_bytes": 0}
    ) as server:
        for prompt in (first, second):
            await complete(client, server.base_url, prompt)
        answer = await complete(client, server.base_url, follow_up)
        assert answer["timings"]["cache_n"] == 0  # no RAM cache: the whole prompt again


async def test_a_repeated_prompt_reevaluates_one_token(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    prompt = tokens(4, 200)
    async with embedded(tiny_model, tmp_path) as server:
        cold = await complete(client, server.base_url, prompt)
        warm = await complete(client, server.base_url, prompt)
    assert (cold["timings"]["cache_n"], cold["timings"]["prompt_n"]) == (0, 200)
    assert (warm["timings"]["cache_n"], warm["timings"]["prompt_n"]) == (199, 1)
    assert warm["id_slot"] == cold["id_slot"]
    assert warm["tokens_cached"] == 200 + N_PREDICT - 1


async def test_greedy_output_is_the_same_with_and_without_the_cache(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Turns of three conversations on two slots: reused and restored KV gives the tokens a
    full prefill gives.

    Each turn extends the previous prompt, not the previous answer: KV written by one-token
    decode steps differs from batched prefill in the last bits (other CPU kernels), and on the
    random-weight model's near-tied logits that alone can flip a greedy pick, cache or not; it
    does in llama-server too, and `test_embedded_differential` checks the engine flips alike.
    """
    openings = [tokens(10 + user, 150) for user in range(3)]
    questions = [[tokens(20 + 3 * user + turn, 30) for turn in range(3)] for user in range(3)]

    async with embedded(tiny_model, tmp_path) as server:
        cached_outputs, cached_reuse = await converse(
            client, server.base_url, openings, questions, cache_prompt=True
        )
        assert server.engine is not None and server.engine.stats.ram_cache_restores > 0
        fresh_outputs, fresh_reuse = await converse(
            client, server.base_url, openings, questions, cache_prompt=False
        )
    assert sum(cached_reuse) > 0 and sum(fresh_reuse) == 0
    assert cached_outputs == fresh_outputs


async def test_concurrent_streams_run_on_separate_slots(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    prompts = [tokens(30 + index, 120) for index in range(3)]

    async def stream(prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
        body = {"prompt": prompt, "n_predict": 16, "temperature": 0, "stream": True}
        streamed: list[int] = []
        final: dict[str, Any] = {}
        async with client.post(url + "/completion", json=body) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            async for line in response.content:
                if line.startswith(b"data: "):
                    event = orjson.loads(line[6:])
                    if event["stop"]:
                        final = event
                    else:
                        assert event["id_slot"] == -1
                        streamed += event["tokens"]
        return streamed, final

    async with embedded(tiny_model, tmp_path, parallel=3) as server:
        url = server.base_url
        results = await asyncio.gather(*(stream(prompt) for prompt in prompts))
        alone = [await complete(client, url, prompt, n_predict=16) for prompt in prompts]
    assert sorted(final["id_slot"] for _, final in results) == [0, 1, 2]
    for (streamed, final), reference in zip(results, alone, strict=True):
        assert final["timings"]["predicted_n"] == 16
        assert final["tokens_cached"] == 120 + 15
        # chunks carry the ids of tokens with text; the greedy sequence is the one run alone
        assert streamed and set(streamed) <= set(reference["tokens"])


async def test_oai_routes_and_template(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0}
    async with embedded(tiny_model, tmp_path) as server:
        url = server.base_url
        async with client.post(url + "/apply-template", json=chat) as response:
            prompt = (await response.json())["prompt"]
        assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        async with client.post(url + "/v1/chat/completions", json=chat) as response:
            answer = await response.json()
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] == 3
        async with client.post(
            url + "/tokenize", json={"content": prompt, "add_special": True}
        ) as response:
            prompt_tokens = (await response.json())["tokens"]
        assert answer["usage"]["prompt_tokens"] == len(prompt_tokens)
        async with client.post(url + "/v1/chat/completions", json=chat) as response:
            again = await response.json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt_tokens) - 1
        stream_body = {**chat, "stream": True}
        async with client.post(url + "/v1/chat/completions", json=stream_body) as response:
            events = [line async for line in response.content if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]\n"
        assert orjson.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


async def test_slot_file_round_trip_and_bad_file(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    prompt = tokens(40, 250)
    async with embedded(tiny_model, tmp_path) as server:
        url = server.base_url
        first = await complete(client, url, prompt, id_slot=0)
        async with client.post(url + "/slots/0?action=save", json={"filename": "a.bin"}) as reply:
            saved = await reply.json()
        held = 250 + N_PREDICT - 1
        assert saved["n_saved"] == held
        header = read_slot_file(server.slot_save_path / "a.bin")
        assert list(header.tokens) == prompt + first["tokens"][:-1]
        assert header.n_stream == 2 and header.cells == held

        async with client.post(
            url + "/slots/1?action=restore", json={"filename": "a.bin"}
        ) as reply:
            assert (await reply.json())["n_restored"] == held
        answer = await complete(client, url, prompt, id_slot=1)
        assert answer["id_slot"] == 1 and answer["timings"]["cache_n"] == 249
        assert answer["tokens"] == first["tokens"]

        (server.slot_save_path / "bad.bin").write_bytes(b"not a slot file at all")
        async with client.post(
            url + "/slots/1?action=restore", json={"filename": "bad.bin"}
        ) as reply:
            assert reply.status == 400
            error = (await reply.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("Unable to restore slot")
        async with client.get(url + "/slots") as reply:
            assert (await reply.json())[1]["n_prompt_tokens"] == 0  # cleared, as llama-server does
        async with client.post(url + "/slots/0?action=erase") as reply:
            assert (await reply.json()) == {"id_slot": 0, "n_erased": held}
        async with client.post(url + "/slots/0?action=save", json={"filename": "../x"}) as reply:
            assert reply.status == 400


async def test_tasks_wait_for_a_slot_and_a_dropped_stream_frees_its_slot(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    async with embedded(tiny_model, tmp_path, parallel=1) as server:
        url = server.base_url
        both = await asyncio.gather(
            complete(client, url, tokens(50, 100), n_predict=24),
            complete(client, url, tokens(51, 100), n_predict=24),
        )
        assert [answer["id_slot"] for answer in both] == [0, 0]  # the second waited its turn

        endless = {"prompt": tokens(52, 100), "n_predict": -1, "ignore_eos": True, "stream": True}
        async with client.post(url + "/completion", json=endless) as response:
            await response.content.readline()  # generating now; then the client goes away

        async def slot_free() -> bool:
            async with client.get(url + "/slots") as reply:
                return not (await reply.json())[0]["is_processing"]

        # a hang guard, not a bound: the generation is endless unless the engine stops it
        await wait_for(slot_free, "the slot freed after its client left", within_s=120)
        answer = await complete(client, url, tokens(53, 50))
        assert answer["id_slot"] == 0


async def test_service_routes_and_errors(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    async with embedded(tiny_model, tmp_path) as server:
        url = server.base_url
        async with client.get(url + "/health") as reply:
            assert await reply.json() == {"status": "ok"}
        async with client.get(url + "/props") as reply:
            props = await reply.json()
        assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 2048
        async with client.post(
            url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        ) as reply:
            text = await reply.json()
        assert text["object"] == "text_completion" and text["usage"]["prompt_tokens"] == 2
        assert text["timings"]["prompt_n"] == 2
        async with client.post(url + "/detokenize", json={"tokens": [15043, 3186]}) as reply:
            assert (await reply.json())["content"] == " Hello world"
        async with client.post(
            url + "/tokenize", json={"content": "Hello", "with_pieces": True}
        ) as reply:
            assert (await reply.json())["tokens"] == [{"id": 15043, "piece": " Hello"}]
        async with client.get(url + "/metrics") as reply:
            metrics = await reply.text()
        assert "llamacpp:prompt_tokens_total 2" in metrics
        async with client.post(url + "/completion", data=b"{not json") as reply:
            assert reply.status == 400
            assert (await reply.json())["error"]["type"] == "invalid_request_error"
        too_long = {"prompt": tokens(60, 2100), "n_predict": 1}
        async with client.post(url + "/completion", json=too_long) as reply:
            assert reply.status == 400
            assert (await reply.json())["error"]["type"] == "exceed_context_size_error"
        async with client.get(url + "/nowhere") as reply:
            assert reply.status == 404
            assert (await reply.json())["error"]["type"] == "not_found_error"
        # several completions or prompts in one request: refused, never answered with one
        for path, body in (
            ("/completion", {"prompt": "Hello", "n_predict": 1, "n": 2}),
            ("/completion", {"prompt": ["Hello", "world"], "n_predict": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}),
            ("/completion", {"prompt": "Hello", "grammar": 'root ::= "yes"'}),
            (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_object"},
                },
            ),
        ):
            async with client.post(url + path, json=body) as reply:
                assert reply.status == 501, body
                assert (await reply.json())["error"]["type"] == "not_supported_error"
        async with client.get(url + "/v1/models") as reply:
            [model] = (await reply.json())["data"]
        assert model["meta"]["n_vocab"] == 32000 and model["meta"]["n_embd"] == 128


async def test_stop_strings_and_seeded_sampling(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    prompt = tokens(70, 40)
    async with embedded(tiny_model, tmp_path) as server:
        url = server.base_url
        full = await complete(client, url, prompt, n_predict=12)
        content = full["content"]
        assert full["stop_type"] == "limit" and len(content) > 6
        stop = content[3:6]
        cut = await complete(client, url, prompt, n_predict=12, stop=[stop])
        assert cut["stop_type"] == "word" and cut["stopping_word"] == stop
        assert cut["content"] == content[: content.index(stop)]

        sampled = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "n_predict": 12}
        runs = [await complete(client, url, prompt, seed=seed, **sampled) for seed in (1, 1, 2)]
        assert runs[0]["tokens"] == runs[1]["tokens"] != runs[2]["tokens"]


def engine_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "embedded-engine"}


def test_the_worker_thread_loads_and_frees_the_model_and_says_when(tiny_model: Path) -> None:
    """The llama.cpp context is made, used and freed on the engine's own thread; a caller that
    must not wait (an event loop) is told when the model is loaded and when it is freed."""
    loaded_on: list[str] = []

    def policy(deps: PromptCacheDeps) -> Any:
        loaded_on.append(threading.current_thread().name)
        return load_plugin("prompt_cache", "llama-server", {}, deps)

    config = EngineConfig(tiny_model, n_slots=1, ctx_size=512, n_threads=1)
    reports: queue.Queue[object] = queue.Queue()
    engine = EmbeddedEngine(config, policy, on_loaded=reports.put)
    assert reports.get(timeout=120) is None
    assert loaded_on == ["embedded-engine"]
    engine.close(on_closed=lambda: reports.put("freed"))
    assert reports.get(timeout=120) == "freed"
    engine.close(on_closed=lambda: reports.put("freed already"))  # told at once
    assert reports.get_nowait() == "freed already"


def test_a_model_that_does_not_load_is_reported_or_raised(tmp_path: Path) -> None:
    config = EngineConfig(tmp_path / "missing.gguf", n_slots=1, ctx_size=512, n_threads=1)

    def policy(deps: PromptCacheDeps) -> Any:
        return load_plugin("prompt_cache", "llama-server", {}, deps)

    reports: queue.Queue[object] = queue.Queue()
    EmbeddedEngine(config, policy, on_loaded=reports.put)
    error = reports.get(timeout=120)
    assert isinstance(error, EngineError) and "cannot load model" in str(error)
    with pytest.raises(EngineError, match="cannot load model"):
        EmbeddedEngine(config, policy)  # no callback: the constructor waits, and raises


async def test_a_start_cut_while_the_model_loads_frees_it_once_loaded(
    tiny_model: Path, tmp_path: Path
) -> None:
    before = engine_threads()
    server = EmbeddedServer(
        EmbeddedSettings(parallel=1, ctx_size=512, threads=1), tiny_model, tmp_path
    )
    starting = asyncio.create_task(server.start())
    await asyncio.sleep(0)  # the worker is loading the model
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert server.engine is None
    for _ in range(1200):  # the worker finishes the load, sees the stop, frees, ends
        if not engine_threads() - before:
            break
        await asyncio.sleep(0.05)
    assert engine_threads() - before == set()


async def test_a_sliding_window_state_from_the_ram_cache_is_reused_only_whole(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """A state copied into the RAM cache holds only the last 64 cells (the window) of the
    sliding-window model's window layers: a prompt that branches off it earlier is computed
    whole (reusing it would leave those layers part of their window: another answer), one that
    continues all of it reuses it. (The first answer is of one token, so the entry holds the
    prompt alone: no KV written by decode steps, which may differ in the last bits from a
    prefill's, as `test_greedy_output_is_the_same_with_and_without_the_cache` says.)"""
    model = ensure_model("swa")
    first, second = tokens(1, 600), tokens(2, 600)
    async with embedded(model, tmp_path, parallel=1) as server:
        url = server.base_url
        await complete(client, url, first, n_predict=1)
        await complete(client, url, second)  # the first goes into the RAM cache
        continued = [*first, *tokens(4, 20)]
        follow_up = await complete(client, url, continued, n_predict=1)
        await complete(client, url, second)  # the follow-up goes into the RAM cache
        branch = [*first[:560], *tokens(3, 20)]  # 60 tokens before the entry's end
        branched = await complete(client, url, branch)
        fresh = [
            (await complete(client, url, prompt, cache_prompt=False, n_predict=n))["tokens"]
            for prompt, n in ((continued, 1), (branch, N_PREDICT))
        ]
    assert [follow_up["tokens"], branched["tokens"]] == fresh
    assert follow_up["timings"]["cache_n"] == 600  # the whole entry
    assert branched["timings"]["cache_n"] == 0


async def test_a_recurrent_state_is_reused_only_whole(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """A recurrent state (the test bed's Mamba-layout model) holds the whole sequence in one
    state, which cannot be cut short: a prompt that continues all of a slot's text reuses it,
    one that branches off it is computed whole (before: the decode failed, a 500)."""
    model = ensure_model("recurrent")
    first = tokens(1, 300)
    async with embedded(model, tmp_path, parallel=1) as server:
        url = server.base_url
        await complete(client, url, first, n_predict=1)  # the slot holds the prompt alone
        follow_up = await complete(client, url, [*first, *tokens(4, 20)], n_predict=1)
        branch = [*first[:200], *tokens(3, 20)]
        branched = await complete(client, url, branch)
        fresh = await complete(client, url, branch, cache_prompt=False)
    assert follow_up["timings"]["cache_n"] == 300
    assert branched["timings"]["cache_n"] == 0
    assert branched["tokens"] == fresh["tokens"]
