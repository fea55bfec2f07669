"""The cache layer's request shapes, wired end to end on a fake llama-server: the proxy built by
its app factory on a real socket, asserted on what the upstream was sent and what it answered.

Single (one prompt pinned to a slot), split (`n` > 1, batches), opaque (`/infill`), whole
upstream (a request the proxy cannot pin) and chunked prefill. The fake computes `cache_n` as
llama-server does (the common prefix with what the slot holds), so a prediction that matches
here matches the server's rule; the real server's exact figures are judged in tests/integration.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.completions import bearer, complete
from tests.support.fake_llama_server import FakeLlamaServer, fake_llama_server
from tests.support.fake_stack import proxy_before
from tests.support.metrics import sample
from tests.support.sse import sse_payloads

PROMPT_TOKENS = 600


def ids(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


@pytest.fixture
async def fake() -> FakeLlamaServer:
    async with fake_llama_server() as server:
        yield server


@pytest.fixture
async def client() -> aiohttp.ClientSession:
    async with aiohttp.ClientSession() as session:
        yield session


def predictions(app: object, result: str) -> float:
    return sample(app, "cacheproxy_predictions_total", result=result)


async def test_a_second_turn_goes_to_the_same_slot_and_its_reuse_is_predicted(
    fake: FakeLlamaServer, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with proxy_before(fake, tmp_path) as (url, app):
        first = await complete(client, url, ids(1), return_tokens=False)
        assert first["tokens"] == []  # the ids the proxy asked for are not shown
        turn = [*ids(1), 11, 12, 13]
        again = await complete(client, url, turn)
    sent = fake.bodies("/completion")[-2:]
    assert [body["prompt"] for body in sent] == [ids(1), turn]
    assert sent[0]["id_slot"] == sent[1]["id_slot"] == first["id_slot"]
    assert sent[0]["return_tokens"] is True  # added: the table learns the generated ids
    assert "cache_prompt" not in sent[1]  # the tenant's own text: reused
    # the slot held the prompt and 3 of the 4 generated tokens; the turn shares the prompt
    assert again["timings"]["cache_n"] == PROMPT_TOKENS
    assert predictions(app, "match") == 2 and predictions(app, "mismatch") == 0


async def test_a_chat_turn_continues_the_answer_the_table_learnt(
    fake: FakeLlamaServer, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    messages = [{"role": "user", "content": "a question " * 40}]
    async with proxy_before(fake, tmp_path) as (url, app):
        first = await complete(client, url, None, path="/v1/chat/completions", messages=messages)
        assert "__verbose" not in first
        reply = first["choices"][0]["message"]["content"]
        turn = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "on"},
        ]
        again = await complete(client, url, None, path="/v1/chat/completions", messages=turn)
        assert "__verbose" not in again
    sent = fake.bodies("/v1/chat/completions")
    assert sent[0]["id_slot"] == sent[1]["id_slot"]
    assert sent[1]["verbose"] is True  # learnt that the server sends none by default: asked
    # the slot holds the first prompt and the reply but its last token: the turn reuses that
    assert again["timings"]["cache_n"] == first["usage"]["prompt_tokens"] + len(reply) - 1
    assert predictions(app, "match") == 2 and predictions(app, "mismatch") == 0


async def test_a_streamed_turn_is_pinned_and_read_on_the_side(
    fake: FakeLlamaServer, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with proxy_before(fake, tmp_path) as (url, app):
        body = {"prompt": ids(2), "n_predict": 4, "stream": True}
        async with client.post(url + "/completion", json=body) as response:
            events = [orjson.loads(data) async for data in sse_payloads(response)]
        generated = [event["tokens"][0] for event in events[:-1]]
        assert len(generated) == 4 and events[-1]["stop"] is True
        again = await complete(client, url, [*ids(2), *generated[:3], 7])
        table = app[CACHE].tables[0]
        slot = table.slots[events[-1]["id_slot"]]
        assert slot.known == [*ids(2), *generated[:3], 7, *again["tokens"][:3]]
    sent = fake.bodies("/completion")[-2:]
    assert sent[0]["id_slot"] == sent[1]["id_slot"] == events[-1]["id_slot"]
    assert "return_tokens" not in sent[0]  # a stream's events carry the ids
    assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3
    assert predictions(app, "match") == 2


@pytest.mark.parametrize("count_field", ["n", "n_cmpl"])
async def test_several_completions_run_each_on_a_slot_of_its_own(
    fake: FakeLlamaServer, client: aiohttp.ClientSession, tmp_path: Path, count_field: str
) -> None:
    async with proxy_before(fake, tmp_path) as (url, app):
        answers = await complete(client, url, ids(3), **{count_field: 3})
    sent = fake.bodies("/completion")[-3:]
    assert [body["prompt"] for body in sent] == [ids(3)] * 3
    assert all(count_field not in body for body in sent)  # each a single task
    assert sorted(body["id_slot"] for body in sent) == sorted({b["id_slot"] for b in sent})
    # the native answer to several completions: llama-server's array, in index order
    assert [answer["index"] for answer in answers] == [0, 1, 2]
    assert {answer["id_slot"] for answer in answers} == {body["id_slot"] for body in sent}
    assert predictions(app, "match") == 3


async def test_a_batch_of_prompts_is_split_and_merged_back(
    fake: FakeLlamaServer, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    prompts = [ids(4), "some text", ids(5)]
    async with proxy_before(fake, tmp_path) as (url, app):
        answer = await complete(client, url, prompts, path="/v1/completions")
        again = await complete(client, url, [*ids(5), 1, 2], path="/v1/completions")
    sent = fake.bodies("/v1/completions")
    batch = sent[:3]
    assert sorted(map(orjson.dumps, (b["prompt"] for b in batch))) == sorted(
        map(orjson.dumps, prompts)
    )
    assert len({body["id_slot"] for body in batch}) == 3
    # OpenAI's merge: one answer, a choice per prompt, numbered as the server numbers them
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    # each prompt's slot is known: the third one's next turn goes where it ran
    [third] = [body for body in batch if body["prompt"] == ids(5)]
    assert sent[3]["id_slot"] == third["id_slot"]
    assert again["timings"]["cache_n"] == PROMPT_TOKENS
    assert predictions(app, "mismatch") == 0


async def test_an_infill_is_pinned_to_the_slot_of_its_file(
    fake: FakeLlamaServer, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    body = {"input_prefix": "def f(x):\n" * 30, "input_suffix": "return x\n", "n_predict": 2}
    async with proxy_before(fake, tmp_path) as (url, app):
        first = await complete(client, url, "", path="/infill", **body)
        again = await complete(client, url, "", path="/infill", **body)
        slot = app[CACHE].tables[0].slots[first["id_slot"]]
        assert slot.n_tokens == first["tokens_cached"]  # nothing known of its ids but their count
    sent = fake.bodies("/infill")
    assert sent[0]["id_slot"] == sent[1]["id_slot"] == first["id_slot"]
    evaluated = again["tokens_evaluated"]
    assert again["timings"]["cache_n"] == evaluated - 1  # the whole prompt again: N - 1
    # its prompt's ids are never known: any reuse up to the slot's context is expected
    assert predictions(app, "match") == 2 and predictions(app, "mismatch") == 0


async def test_a_request_the_proxy_cannot_pin_is_relabelled_from_the_slots_report(
    fake: FakeLlamaServer, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with proxy_before(fake, tmp_path) as (url, app):
        # no such slot: llama-server's own answer (its id wraps around), on the whole upstream
        answer = await complete(client, url, ids(6), id_slot=9)
        table = app[CACHE].tables[0]
        held = {slot.slot_id: slot.n_tokens for slot in table.slots}
    [body] = fake.bodies("/completion")[-1:]
    assert body["id_slot"] == 9 and body.get("return_tokens") is True  # as the client sent it
    assert answer["id_slot"] == 9 % 4
    # GET /slots before and after it, and the slot it wrote holds as many tokens as the server's
    paths = [(r.method, r.path) for r in fake.received]
    at = paths.index(("POST", "/completion"), len(paths) - 3)
    assert paths[at - 1] == paths[at + 1] == ("GET", "/slots")
    assert held[9 % 4] == answer["tokens_cached"]
    assert (
        sample(app, "cacheproxy_requests_total", tenant="default", placement="whole_upstream") == 1
    )


async def test_a_request_on_the_whole_upstream_first_erases_other_tenants_text(
    client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (tmp_path / "slots").mkdir()
    async with fake_llama_server(slot_save_path=tmp_path / "slots") as fake:
        with TenantRegistry(tmp_path / "tenants.db") as registry:
            _, alice = registry.create("alice")
            _, bob = registry.create("bob")
        tenants = {"database": tmp_path / "tenants.db"}
        async with proxy_before(fake, tmp_path, disk={"enabled": False}, tenants=tenants) as (
            url,
            _,
        ):
            first = await complete(client, url, ids(7), bearer(alice))
            # a prompt the proxy cannot tokenize as the server will: it cannot be pinned
            await complete(client, url, {"prompt_string": "hello"}, bearer(bob))
    actions = fake.slot_actions()
    erased = [slot for slot, action, _ in actions if action == "erase"]
    assert first["id_slot"] in erased
    # erased before bob's request went out
    order = [(r.path, r.query.get("action")) for r in fake.received if r.method == "POST"]
    assert order.index((f"/slots/{first['id_slot']}", "erase")) < len(order) - 1
    assert order[-1] == ("/completion", None)


CHUNK_MS = 40.0  # at the fake's 0.1 ms a prompt token: 400 tokens a chunk
HEAVY_TOKENS = 1800


@pytest.fixture
def tenants(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Tenant name -> (id, key); heavy's share of the four slots is one."""
    with TenantRegistry(tmp_path / "tenants.db") as registry:
        heavy, heavy_key = registry.create("heavy")
        light, light_key = registry.create("light", weight=3)
    return {"heavy": (heavy.id, heavy_key), "light": (light.id, light_key)}


async def test_a_prompt_over_the_tenants_share_is_computed_in_chunks_on_its_slot(
    fake: FakeLlamaServer, client: aiohttp.ClientSession, tmp_path: Path, tenants: dict
) -> None:
    scheduling = {"share_window_s": 600, "prefill_chunk_ms": CHUNK_MS}
    settings = {"tenants": {"database": tmp_path / "tenants.db"}, "scheduling": scheduling}
    heavy, light = bearer(tenants["heavy"][1]), bearer(tenants["light"][1])
    background = fake.hold(lambda body: body.get("n_predict") == 3000)
    async with proxy_before(fake, tmp_path, **settings) as (url, app):
        await complete(client, url, ids(10, 64), light)  # the light tenant is active
        # the heavy tenant holds its one slot
        held = asyncio.ensure_future(complete(client, url, ids(11, 16), heavy, n_predict=3000))
        await asyncio.wait_for(background.arrived.wait(), 30)
        # its next prompt waits in the fake after its first chunk; the light tenant's request
        # is served meanwhile
        first_chunk = fake.hold(lambda body: body.get("n_predict") == 0, stage="prefill")
        prompt = ids(12, HEAVY_TOKENS)
        chunked = asyncio.ensure_future(complete(client, url, prompt, heavy))
        await asyncio.wait_for(first_chunk.arrived.wait(), 30)
        await complete(client, url, ids(13, 64), light)
        first_chunk.release()
        answer = await chunked
        background.release()
        await held
        heavy_usage = app[CACHE].usage_of(tenants["heavy"][0])
    sent = [body for body in fake.bodies("/completion") if len(body["prompt"]) > 64]
    chunks, final = sent[:-1], sent[-1]
    assert [len(body["prompt"]) for body in chunks] == [400, 800, 1200, 1600]
    assert all(body["prompt"] == prompt[: len(body["prompt"])] for body in chunks)
    assert all(body["n_predict"] == 0 and body["stream"] is True for body in chunks)
    assert {body["id_slot"] for body in sent} == {final["id_slot"]}
    assert final["prompt"] == prompt and final["n_predict"] == 4
    # the light request went out between the first chunk and the second
    order = [len(body["prompt"]) for body in fake.bodies("/completion")]
    assert order.index(64, order.index(400)) < order.index(800)
    # the request reused what the chunks computed, yet its answer shows what an unchunked run
    # would (a prompt nobody sent before: no reuse), and every prompt token counted once
    assert answer["timings"]["cache_n"] == 0
    assert answer["timings"]["prompt_n"] == HEAVY_TOKENS
    assert heavy_usage["decoded_tokens"] == HEAVY_TOKENS + 16
