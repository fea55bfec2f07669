"""Chunked prefill on a real llama-server: a light tenant's request starts between a heavy
tenant's chunks, the heavy answer is llama-server's own but for the reuse it shows (what an
unchunked run would show: chunks happen only while another tenant is active), every prompt
token is counted once, and the slot table stays exact (also when the client leaves between
chunks).

The server runs one thread (as `bench fairness` does), so a 1,800-token prompt takes a few
hundred ms to compute: long enough to send the light request while it is being computed."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.upstreams.slot_table import Lease
from tests.support.fair_share import ADMIN_KEY, Proxy, busy_slots, fair_proxy
from tests.support.metrics import sample
from tests.support.servers import StartServer
from tests.support.upstream_slots import wait_until_idle
from tests.support.waiting import wait_for as until

ONE_THREAD = ("--threads", "1", "--threads-batch", "1")
HEAVY_TOKENS = 1800  # under n_batch (2048): llama-server would compute it in one batch
CHUNK_MS = 40.0

_rng = random.Random(1414)


def ids(n: int) -> list[int]:
    return [_rng.randrange(300, 31000) for _ in range(n)]


def words(n: int) -> str:
    return " ".join(f"w{_rng.randrange(100000)}" for _ in range(n))


async def stream(
    http: aiohttp.ClientSession, proxy: Proxy, key: str, path: str, body: dict
) -> tuple[float, list[dict]]:
    """When the first event came (time.monotonic), and every event's JSON."""
    first, events = 0.0, []
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(
        proxy.url + path, json={**body, "stream": True}, headers=headers
    ) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                first = first or time.monotonic()
                events.append(orjson.loads(line[6:]))
    return first, events


def heavy_body(path: str) -> dict:
    if path == "/completion":
        return {"prompt": ids(HEAVY_TOKENS), "n_predict": 4}
    # about 1,800 tokens of chat: the mirror tokenizes it exactly, the chunks carry its ids
    body = {"messages": [{"role": "user", "content": words(600)}], "max_tokens": 4}
    return {**body, "model": "any"} if path == "/v1/messages" else body


class _OnPause(list):
    """The scheduler's list of chunk pauses, calling `paused` when the first one begins."""

    def __init__(self, paused: Callable[[], object]) -> None:
        super().__init__()
        self._paused = paused

    def append(self, woken: object) -> None:
        super().append(woken)
        self._paused()


def timings(events: list[dict]) -> dict:
    return next(event["timings"] for event in reversed(events) if "timings" in event)


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions", "/v1/messages"])
async def test_a_light_request_starts_between_a_heavy_prompts_chunks(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, path: str
) -> None:
    server = start_server(parallel=4, extra_args=ONE_THREAD)
    async with fair_proxy(server, tmp_path, share_window_s=60, prefill_chunk_ms=CHUNK_MS) as proxy:
        heavy_tenant, heavy = await proxy.create("heavy")
        light_tenant, light = await proxy.create("light", weight=3)  # heavy's share: 1 slot
        cache = proxy.app[CACHE]
        # the light tenant is active (the window), and the prefill rate is measured
        await stream(client, proxy, light, "/completion", {"prompt": ids(256), "n_predict": 1})
        # the heavy tenant holds its one slot: a long generation
        background = asyncio.ensure_future(
            stream(client, proxy, heavy, "/completion", {"prompt": ids(16), "n_predict": 3000})
        )
        await until(lambda: busy_slots(proxy) == 1, "the heavy tenant's first slot")
        await asyncio.sleep(0.3)  # its prompt computed: it is generating
        heavy_request = asyncio.ensure_future(stream(client, proxy, heavy, path, heavy_body(path)))
        await until(lambda: busy_slots(proxy) == 2, "the heavy tenant's second slot")
        await asyncio.sleep(0.05)  # its prompt (in chunks or whole) is being computed
        light_first, _ = await stream(
            client, proxy, light, "/completion", {"prompt": ids(32), "n_predict": 2}
        )
        heavy_first, heavy_events = await heavy_request
        # the light request did not wait for the heavy prompt: it started between two chunks
        assert light_first < heavy_first
        # the background request is cut (or it ended first, on a fast machine): either way its
        # 16 prompt tokens were computed (it was generating), and they count
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)
        background_prompt = 16
        await until(lambda: busy_slots(proxy) == 0, "the slots to be given back")
        assert sample(proxy.app, "cacheproxy_prefill_chunks_total") > 0  # it was chunked

        # each prompt token counted once, as computed: the chunks' and the request's, and the
        # cut request's
        usage = cache.usage_of(heavy_tenant.id)
        prompt_length = usage["prompt_tokens"] - background_prompt
        assert prompt_length > 1000
        assert usage["decoded_tokens"] == prompt_length + background_prompt
        # the ledger too
        await cache.meter.flush()
        async with client.get(
            proxy.url + "/admin/usage",
            params={"tenant": heavy_tenant.id, "group_by": "tenant"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ) as response:
            [row] = (await response.json())["rows"]
        assert row["prompt_tokens"] == row["computed_tokens"] == prompt_length + background_prompt
        assert row["reused_tokens"] == 0
        # the answer shows what an unchunked run shows: a prompt nobody sent before reuses
        # nothing (the server's own figure, the chunks' prefix, would tell that another
        # tenant was active)
        if path != "/v1/messages":
            heavy_timings = timings(heavy_events)
            assert heavy_timings["cache_n"] == 0
            assert heavy_timings["prompt_n"] == prompt_length
        else:
            assert heavy_events[0]["type"] == "message_start"
            start_usage = heavy_events[0]["message"]["usage"]
            assert start_usage["cache_read_input_tokens"] == 0
            assert start_usage["input_tokens"] == prompt_length
        assert usage["reused_tokens"] == 0
        assert cache.usage_of(light_tenant.id)["reused_tokens"] == 0
        # the table knows exactly what the heavy slot holds: the server's count agrees
        held = {slot.slot_id: slot.n_tokens for slot in cache.tables[0].slots}
        report = await (await client.get(server.url + "/slots")).json()
        for entry in report:
            if held[entry["id"]] == prompt_length + 3:  # prompt and generated, last not kept
                assert entry["n_prompt_tokens"] == prompt_length + 3
                break
        else:
            raise AssertionError(f"no slot holds the heavy prompt: {held}, {report}")


async def test_a_client_leaving_between_chunks_frees_the_slot_and_leaves_it_exact(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=4, extra_args=ONE_THREAD)
    async with fair_proxy(server, tmp_path, share_window_s=60, prefill_chunk_ms=CHUNK_MS) as proxy:
        heavy_tenant, heavy = await proxy.create("heavy")
        _, light = await proxy.create("light", weight=3)
        cache = proxy.app[CACHE]
        await stream(client, proxy, light, "/completion", {"prompt": ids(256), "n_predict": 1})
        background = asyncio.ensure_future(
            stream(client, proxy, heavy, "/completion", {"prompt": ids(16), "n_predict": 3000})
        )
        await until(lambda: busy_slots(proxy) == 1, "the heavy tenant's first slot")
        prompt = ids(HEAVY_TOKENS)
        scheduler = cache.scheduler
        real_turn = scheduler.chunk_turn

        async def light_request_first(lease: Lease, remaining: int) -> None:
            # past its first chunk, the heavy prompt goes on only once the light request holds
            # its slot, however slowly this machine sends that: the pause is then certain
            if lease.prompt == prompt and remaining < len(prompt):
                await until(lambda: busy_slots(proxy) == 3, "the light request's slot")
            await real_turn(lease, remaining)

        scheduler.chunk_turn = light_request_first  # type: ignore[method-assign]
        leaving = asyncio.ensure_future(
            stream(client, proxy, heavy, "/completion", {"prompt": prompt, "n_predict": 4})
        )
        slots = cache.tables[0].slots
        # the first chunk ended: a busy slot holds a prefix of the prompt, exactly
        await until(
            lambda: any(
                s.busy
                and 0 < len(s.known) < HEAVY_TOKENS
                and not s.unknown_tail
                and s.known == prompt[: len(s.known)]
                for s in slots
            ),
            "a chunk to end",
        )
        # the client leaves the moment the heavy request pauses between its chunks (a poll
        # could miss a pause that ends as soon as the light prompt is computed)
        cache.scheduler._pacing._chunk_pauses = _OnPause(leaving.cancel)
        # a long light prompt, expected (at a rate set slow) to take far longer than it does:
        # the heavy request pauses between its chunks until the light request ends. Over
        # n_batch (2048) tokens, the server computes it in more than the one batch a chunk
        # ending beside it shares
        cache.tables[0].prefill_ms_per_token.value = 20.0
        light_request = asyncio.ensure_future(
            stream(client, proxy, light, "/completion", {"prompt": ids(3500), "n_predict": 1})
        )
        await asyncio.gather(leaving, return_exceptions=True)
        assert leaving.cancelled(), "the heavy request ended without pausing between chunks"
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)
        await light_request
        await until(lambda: busy_slots(proxy) == 0, "the slots to be given back")
        chunked = [s for s in slots if s.known and s.known == prompt[: len(s.known)]]
        assert len(chunked) == 1
        slot = chunked[0]
        assert slot.tenant == heavy_tenant.id
        # cut between chunks: the server holds what the chunks computed, no more; cut inside
        # one, the table would say unknown (never a wrong count)
        # (the server notices a cut stream at its next write: wait for it to end its tasks)
        report = await wait_until_idle(client, server, within_s=10)
        assert report[slot.slot_id]["n_prompt_tokens"] == slot.n_tokens


async def test_a_first_chunk_on_another_tenants_slot_reuses_none_of_its_text(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Three slots, heavy's share 1 (weights 1 and 2): heavy's background request holds one,
    the light tenant's text fills the other two, and heavy's chunked prompt starts with that
    text. Its chunks must compute it all again (the first chunk reuses nothing): another
    tenant's cached text is never reused, in chunks either."""
    server = start_server(parallel=3, ctx_size=3 * 4096, extra_args=ONE_THREAD)
    async with fair_proxy(server, tmp_path, share_window_s=60, prefill_chunk_ms=CHUNK_MS) as proxy:
        heavy_tenant, heavy = await proxy.create("heavy")
        light_tenant, light = await proxy.create("light", weight=2)
        cache = proxy.app[CACHE]
        background = asyncio.ensure_future(
            stream(client, proxy, heavy, "/completion", {"prompt": ids(16), "n_predict": 3000})
        )
        await until(lambda: busy_slots(proxy) == 1, "the heavy tenant's first slot")
        secret, other = ids(400), ids(400)
        for text in (secret, other):  # the light tenant's text in both other slots
            await stream(client, proxy, light, "/completion", {"prompt": text, "n_predict": 1})
        slots = cache.tables[0].slots
        assert sum(s.tenant == light_tenant.id for s in slots) == 2
        (secret_slot,) = [s.slot_id for s in slots if s.known[:400] == secret]
        probe = secret + ids(HEAVY_TOKENS - 400)
        _, events = await stream(
            client, proxy, heavy, "/completion", {"prompt": probe, "n_predict": 2}
        )
        # it went to the slot holding the text it starts with (the least recently used)
        assert slots[secret_slot].known[:HEAVY_TOKENS] == probe
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)
        # chunked: the request reused only what its own chunks computed, and shows no reuse
        assert sample(proxy.app, "cacheproxy_prefill_chunks_total") > 0
        assert timings(events)["cache_n"] == 0
        usage = cache.usage_of(heavy_tenant.id)
        assert usage["reused_tokens"] == 0
        assert usage["decoded_tokens"] == HEAVY_TOKENS


async def test_chunks_on_another_tenants_public_prefix_shift_none_of_the_text_past_it(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """As above, but heavy's prompt starts with a public prefix the light tenant's text starts
    with too, and the server reuses chunks past the common prefix by shifting their KV
    (`--cache-reuse`): the chunks reuse the public prefix and compute the rest, although the
    light tenant's text holds the document that follows in heavy's prompt."""
    server = start_server(
        parallel=3, ctx_size=3 * 4096, extra_args=(*ONE_THREAD, "--cache-reuse", "16")
    )
    async with fair_proxy(server, tmp_path, share_window_s=60, prefill_chunk_ms=CHUNK_MS) as proxy:
        public = ids(512)
        proxy.registry.add_public_prefix("system-prompt", public)
        heavy_tenant, heavy = await proxy.create("heavy")
        _, light = await proxy.create("light", weight=2)
        cache = proxy.app[CACHE]
        background = asyncio.ensure_future(
            stream(client, proxy, heavy, "/completion", {"prompt": ids(16), "n_predict": 3000})
        )
        await until(lambda: busy_slots(proxy) == 1, "the heavy tenant's first slot")
        document = ids(1024)
        for text in (public + ids(128) + document, ids(400)):  # light's texts, other slots
            await stream(client, proxy, light, "/completion", {"prompt": text, "n_predict": 1})
        probe = public + document + ids(HEAVY_TOKENS - 512 - 1024)
        _, events = await stream(
            client, proxy, heavy, "/completion", {"prompt": probe, "n_predict": 2}
        )
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)
        assert sample(proxy.app, "cacheproxy_prefill_chunks_total") > 0
        # what the server reused: the public prefix, nothing past it
        assert timings(events)["cache_n"] == 512
        assert cache.usage_of(heavy_tenant.id)["decoded_tokens"] == HEAVY_TOKENS - 512
