"""Slot routing against real llama-servers: the table matches the server, request for request."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.ops.logs import REQUEST_LOG, JsonFormatter
from cacheproxy.settings import load_settings
from cacheproxy.upstreams.client import probe_prompts
from tests.support.metrics import proxy_counters
from tests.support.servers import LlamaServer, StartServer, serving
from tests.support.sse import collect_sse
from tests.support.waiting import wait_for

# llama-server logs this (at -lv 4) when a task names a slot that is busy: the trap to avoid
PINNED_BUSY_SLOT = "requested slot is unavailable"
DEBUG_LOG = ("--verbosity", "5")
WORDS = "the sky is blue and green leaves fall on quiet water while birds sing".split()


def proxy_settings(*servers: LlamaServer, tmp_path: Path, **overrides: object):  # noqa: ANN201
    return load_settings(
        upstreams=[server.url for server in servers], state_dir=tmp_path / "state", **overrides
    )


def predictions(counters: dict[str, float], result: str) -> float:
    return counters.get(f'cacheproxy_predictions_total{{result="{result}"}}', 0.0)


@dataclass
class Conversation:
    """A client that keeps talking: each turn sends everything so far plus a new question."""

    name: str
    rng: random.Random
    route: str
    stream: bool
    history: list[int] = field(default_factory=list)
    history_text: str = ""
    messages: list[dict] = field(default_factory=list)

    def next_body(self) -> dict:
        common = {"n_predict": 8, "temperature": 0, "stream": self.stream}
        if self.route == "/completion":
            question = [self.rng.randrange(300, 31000) for _ in range(self.rng.randrange(20, 80))]
            self.history = self.history + question
            return {"prompt": self.history, "return_tokens": True, **common}
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randrange(5, 20)))
        if self.route == "/v1/completions":
            self.history_text += " " + words
            return {"prompt": self.history_text, **common}
        self.messages = [*self.messages, {"role": "user", "content": words}]
        return {"messages": self.messages, **common}

    def absorb(self, answer: dict | list[str]) -> None:
        if isinstance(answer, list):  # a stream: the text of each event
            text = "".join(
                (event.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                if "choices" in event
                else event.get("content", "")
                for event in (orjson.loads(p) for p in answer if p != "[DONE]")
            )
        elif "choices" in answer:
            choice = answer["choices"][0]
            text = choice.get("message", {}).get("content") or choice.get("text", "")
        else:
            text = answer.get("content", "")
            self.history = self.history + answer.get("tokens", [])
        if self.route == "/v1/completions":
            self.history_text += text
        elif self.route.endswith("chat/completions"):
            self.messages = [*self.messages, {"role": "assistant", "content": text}]


async def take_turn(client: aiohttp.ClientSession, base_url: str, talk: Conversation) -> None:
    body = talk.next_body()
    async with client.post(base_url + talk.route, json=body) as response:
        assert response.status == 200, await response.text()
        talk.absorb(await collect_sse(response) if talk.stream else await response.json())


ODD_TASKS = 4  # what `odd_requests` places: two tasks each


async def odd_requests(client: aiohttp.ClientSession, base_url: str, rng: random.Random) -> None:
    """Requests of several tasks, each placed on a slot of its own: n > 1, a batch of prompts."""
    ids = [rng.randrange(300, 31000) for _ in range(40)]
    for body in (
        {"prompt": ids, "n_predict": 4, "n_cmpl": 2},
        {"prompt": [ids, ids[:20]], "n_predict": 4},
    ):
        async with client.post(base_url + "/completion", json=body) as response:
            assert response.status == 200, await response.text()


def conversations(seed: int, count: int) -> list[Conversation]:
    routes = [
        ("/completion", False),
        ("/completion", True),
        ("/v1/completions", False),
        ("/v1/completions", True),
        ("/v1/chat/completions", False),
        ("/v1/chat/completions", True),
    ]
    return [
        Conversation(f"c{i}", random.Random(seed * 100 + i), *routes[i % len(routes)])
        for i in range(count)
    ]


async def run_mixed_traffic(
    client: aiohttp.ClientSession,
    base_url: str,
    seed: int,
    turns: int,
    in_flight: int,
    talkers: int = 6,
) -> int:
    """Conversations (more than slots), several requests at once; returns the tasks placed
    (each task of a request with several counts)."""
    talks = conversations(seed, count=talkers)
    rng = random.Random(seed)
    sent = 0
    for turn in range(turns):
        order = rng.sample(talks, len(talks))
        for start in range(0, len(order), in_flight):
            await asyncio.gather(
                *(take_turn(client, base_url, t) for t in order[start : start + in_flight])
            )
            sent += len(order[start : start + in_flight])
        if turn % 3 == 1:
            await odd_requests(client, base_url, rng)
            sent += ODD_TASKS
    return sent


async def test_table_matches_the_server_over_mixed_traffic(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(extra_args=DEBUG_LOG)
    async with serving(proxy_settings(server, tmp_path=tmp_path)) as (proxy_url, app):
        sent = await run_mixed_traffic(client, proxy_url, seed=1, turns=40, in_flight=3, talkers=5)
        counters = await proxy_counters(client, proxy_url)
        assert app[CACHE].tables[0].ram_cache is False
    assert sent == 200 + 13 * ODD_TASKS  # 40 turns of 5 conversations, odd requests every 3rd
    assert predictions(counters, "mismatch") == 0
    assert predictions(counters, "match") == sent
    reused = counters['cacheproxy_reused_tokens_total{tenant="default"}']
    prompt = counters['cacheproxy_prompt_tokens_total{tenant="default"}']
    assert reused > 0.3 * prompt  # conversations came back to the slots that held them
    assert PINNED_BUSY_SLOT not in server.log_path.read_text(errors="replace")


async def test_the_busy_slot_trap_is_visible_in_the_log(
    client: aiohttp.ClientSession, start_server: StartServer
) -> None:
    """Control for the check above: pinning a busy slot directly does log the deferral."""
    server = start_server(extra_args=DEBUG_LOG)
    long = {"prompt": [1, 2, 3], "n_predict": 300, "ignore_eos": True, "id_slot": 1}
    await asyncio.gather(*(client.post(server.url + "/completion", json=long) for _ in range(2)))
    assert PINNED_BUSY_SLOT in server.log_path.read_text(errors="replace")


async def test_a_conversation_returns_to_the_slot_that_holds_it(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server()
    rng = random.Random(7)
    prompts = {name: [rng.randrange(300, 31000) for _ in range(300)] for name in "ABCD"}
    async with serving(proxy_settings(server, tmp_path=tmp_path)) as (proxy_url, _):
        held = {}
        for name, prompt in prompts.items():  # four conversations fill the four slots
            async with client.post(
                proxy_url + "/completion",
                json={"prompt": prompt, "n_predict": 4, "return_tokens": True},
            ) as response:
                answer = await response.json()
            held[name] = (answer["id_slot"], prompt + answer["tokens"])
        for name in "DBCA":
            slot, history = held[name]
            body = {"prompt": [*history, 11, 12, 13], "n_predict": 4}
            async with client.post(proxy_url + "/completion", json=body) as response:
                answer = await response.json()
            assert answer["id_slot"] == slot
            assert (
                answer["timings"]["cache_n"] == len(prompts[name]) + 3
            )  # all it generated but the last


async def test_two_upstreams_share_the_load_and_stay_exact(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    first, second = start_server(parallel=2), start_server(parallel=2)
    async with serving(proxy_settings(first, second, tmp_path=tmp_path)) as (proxy_url, _):
        sent = await run_mixed_traffic(client, proxy_url, seed=2, turns=8, in_flight=4)
        counters = await proxy_counters(client, proxy_url)
    assert predictions(counters, "mismatch") == 0
    assert predictions(counters, "match") == sent
    # every request generates the same number of tokens: generated tokens count requests served
    generated = []
    for server in (first, second):
        async with client.get(server.url + "/metrics") as response:
            text = await response.text()
        found = re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.MULTILINE)
        assert found is not None
        generated.append(float(found.group(1)))
    # four slots in all, four requests in flight: neither upstream may sit idle while the
    # other queues, whatever prefixes each holds
    assert min(generated) >= 0.25 * sum(generated), generated


async def test_upstream_restart_mid_run_rebuilds_the_table(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server()
    settings = proxy_settings(server, tmp_path=tmp_path, routing={"health_interval_s": 0.2})
    async with serving(settings) as (proxy_url, app):
        await run_mixed_traffic(client, proxy_url, seed=3, turns=3, in_flight=4)
        table = app[CACHE].tables[0]
        assert not all(slot.empty for slot in table.slots)

        server.kill()
        await wait_for(lambda: not table.healthy, "the proxy to see the upstream gone")
        async with client.post(proxy_url + "/completion", json={"prompt": [1, 2, 3]}) as response:
            assert response.status == 502
        restarted = start_server(port=server.port)
        await wait_for(lambda: table.healthy, "the proxy to see the upstream back")
        assert all(slot.empty for slot in table.slots)  # a restarted server holds nothing

        before = await proxy_counters(client, proxy_url)
        sent = await run_mixed_traffic(client, proxy_url, seed=4, turns=3, in_flight=4)
        after = await proxy_counters(client, proxy_url)
    assert predictions(after, "mismatch") == predictions(before, "mismatch") == 0
    assert predictions(after, "match") - predictions(before, "match") == sent
    assert restarted.process.poll() is None


async def test_full_queue_answers_503_with_retry_after(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1, ctx_size=65536)
    settings = proxy_settings(server, tmp_path=tmp_path, routing={"max_queue": 1})
    # prompts of their own: one that kept the running prompt would wait at the server instead
    # (lined up behind it, docs/placement.md)
    long = [
        {"prompt": prompt, "n_predict": 20000, "ignore_eos": True}
        for prompt in ([1, 2, 3], [4, 5, 6], [7, 8, 9])
    ]
    async with serving(settings) as (proxy_url, app):
        running = asyncio.ensure_future(client.post(proxy_url + "/completion", json=long[0]))
        await wait_for(lambda: app[CACHE].tables[0].slots[0].busy, "the slot to be taken")
        queued = asyncio.ensure_future(client.post(proxy_url + "/completion", json=long[1]))
        await wait_for(lambda: app[CACHE].scheduler.queued == 1, "a request to queue")
        async with client.post(proxy_url + "/completion", json=long[2]) as response:
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
            error = (await response.json())["error"]
        assert error["type"] == "unavailable_error"
        for pending in (running, queued):
            pending.cancel()


@pytest.mark.parametrize(("cache_ram", "expected"), [(0, False), (64, True)])
async def test_server_ram_cache_is_detected(
    start_server: StartServer, tmp_path: Path, cache_ram: int, expected: bool
) -> None:
    server = start_server(cache_ram_mib=cache_ram)
    async with serving(proxy_settings(server, tmp_path=tmp_path)) as (_, app):
        assert app[CACHE].tables[0].ram_cache is expected
        assert all(slot.empty for slot in app[CACHE].tables[0].slots)  # the probe cleaned up


async def test_a_server_that_clears_idle_slots_picks_the_slot_itself_and_is_predicted(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Without -np, llama-server unifies the KV cache and empties idle slots at every task: the
    probe finds it, tasks go without `id_slot`, and the server's picks are predicted."""
    server = start_server(parallel=None, cache_ram_mib=256)
    rng = random.Random(5)
    first, second = ([rng.randrange(300, 20000) for _ in range(500)] for _ in range(2))
    async with serving(proxy_settings(server, tmp_path=tmp_path)) as (proxy_url, app):
        assert app[CACHE].tables[0].clears_idle
        for prompt in (first, second, [*first, 9, 9], [*second, 8, 8]):
            body = {"prompt": prompt, "n_predict": 2, "temperature": 0}
            async with client.post(proxy_url + "/completion", json=body) as response:
                answer = await response.json()
        assert answer["timings"]["cache_n"] >= len(second)  # back from the RAM cache
        counters = await proxy_counters(client, proxy_url)
    assert counters['cacheproxy_predictions_total{result="match"}'] == 4


async def test_each_request_leaves_one_log_line_without_prompt_text(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    llama_server = start_server()  # fresh: the first request finds nothing cached
    secret = "zebra quartz lantern"
    body = {"messages": [{"role": "user", "content": secret}], "n_predict": 2}
    async with serving(proxy_settings(llama_server, tmp_path=tmp_path)) as (proxy_url, _):
        with caplog.at_level(logging.INFO, logger=REQUEST_LOG):
            for _ in range(2):
                async with client.post(proxy_url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200
    lines = [record for record in caplog.records if record.name == REQUEST_LOG]
    assert len(lines) == 2
    first, second = (record.fields for record in lines)
    assert first["tenant"] == "default" and first["upstream"] == llama_server.url
    assert first["action"] == "cold" and second["action"] == "hit"  # the same prompt again
    assert second["reused"] + second["decoded"] == second["prompt"]
    assert all(secret not in record.getMessage() for record in caplog.records)
    formatted = json.loads(JsonFormatter().format(lines[1]))
    assert formatted["slot"] == second["slot"] and formatted["logger"] == REQUEST_LOG


def test_probe_prompts_share_no_token_for_any_upstream() -> None:
    """The RAM-cache probe reads any reuse as a RAM cache: its prompts must share no prefix,
    whatever the upstream's address (random ones once shared a first token for 1 port in 500)."""
    for port in range(20000, 23000):
        held, other, overwrite = probe_prompts(f"http://127.0.0.1:{port}")
        assert not set(held) & set(other) and not set(held) & set(overwrite)
