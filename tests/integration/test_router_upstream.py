"""Several models: a router-mode llama-server (`--models-dir`) with two test models beside a
plain llama-server with a third, behind one proxy; every model's weights its own.

Each server is asked for its own account of what ran where (its `/slots`, its `/metrics`, for
a router of each model instance), and what a model answers tells it apart from the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from cacheproxy.http.app_keys import CACHE, METER
from cacheproxy.provision.make_model import model_folder
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.tenancy.usage import aggregate
from tests.support.completions import bearer, complete
from tests.support.metrics import sample
from tests.support.routers import (
    SEEDS,
    instance_slots,
    model_statuses,
    prompt_tokens_total,
    start_plain,
    start_router,
)
from tests.support.serve_process import start_serve
from tests.support.servers import LlamaServer, serving, start_llama_server
from tests.support.sse import sse_payloads
from tests.support.waiting import wait_for

IDLE_WITHIN_S = 30.0  # bound for the server to see a client gone (it looks about once a second)


def ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 31000) for _ in range(length)]


@dataclass
class Bed:
    router: LlamaServer
    plain: LlamaServer | None
    proxy: str
    app: web.Application
    registry: TenantRegistry

    def server_of(self, model: str) -> tuple[LlamaServer, str | None]:
        """Where `model` runs: the router (and the model, for its instance), or the plain one."""
        if model == "gamma":
            assert self.plain is not None
            return self.plain, None
        return self.router, model


@contextlib.asynccontextmanager
async def bed(
    binary: Path, workdir: Path, models_max: int, plain: bool = True
) -> AsyncIterator[Bed]:
    """A router of alpha and beta and, with `plain`, a plain server of gamma, both saving into
    the proxy's archive folder, behind a proxy with a tenant registry."""
    archive = workdir / "archive"
    archive.mkdir()
    router = start_router(binary, workdir, models_max=models_max, slot_save_path=archive)
    gamma = start_plain(binary, workdir, "gamma", slot_save_path=archive) if plain else None
    try:
        settings = load_settings(
            upstreams=[router.url, *([gamma.url] if gamma else [])],
            state_dir=workdir / "state",
            disk={"directory": archive},
            tenants={"database": workdir / "tenants.db"},
        )
        with TenantRegistry(settings.tenant_database()) as registry:
            async with serving(settings) as (url, app):
                yield Bed(router, gamma, url, app, registry)
    finally:
        router.stop()
        if gamma is not None:
            gamma.stop()


def all_built(app: web.Application) -> bool:
    """Whether every model's table is built (the router's instances loaded, probed)."""
    return all(t.healthy for t in app[CACHE].tables if not t.router)


async def direct_tokens(
    client: aiohttp.ClientSession, server: LlamaServer, model: str | None, prompt: list[int]
) -> list[int]:
    """What the model answers to `prompt`, asked directly (nothing cached)."""
    extra = {} if model is None else {"model": model}
    answer = await complete(client, server.url, prompt, cache_prompt=False, **extra)
    return answer["tokens"]


async def test_requests_by_model_land_on_their_instance_and_reuse_its_slot(
    client: aiohttp.ClientSession, llama_server_binary: Path, tmp_path: Path
) -> None:
    async with bed(llama_server_binary, tmp_path, models_max=2) as b:
        prompts = {model: ids(seed, 300) for seed, model in enumerate(("alpha", "beta", "gamma"))}
        expected = {
            model: await direct_tokens(client, *b.server_of(model), prompts[model])
            for model in prompts
        }
        assert len({tuple(tokens) for tokens in expected.values()}) == 3  # three models
        # the proxy reads (probes) an instance when a request for its model first comes: one
        # each, before the test counts
        for model in prompts:
            await complete(client, b.proxy, ids(50, 20), model=model)
        assert all_built(b.app)
        for model, prompt in prompts.items():
            counted = {m: await prompt_tokens_total(client, *b.server_of(m)) for m in prompts}
            server, instance = b.server_of(model)
            before = await instance_slots(client, server, instance)
            first = await complete(client, b.proxy, prompt, model=model)
            assert first["tokens"] == expected[model]
            # a slot of that server (or model instance) ran it, and holds it
            tasks = {slot["id"]: slot.get("id_task") for slot in before}
            after = await instance_slots(client, server, instance)
            ran = [slot for slot in after if slot.get("id_task") != tasks[slot["id"]]]
            assert [slot["n_prompt_tokens"] for slot in ran] == [first["tokens_cached"]]
            # the prompt was decoded there, and nowhere else
            for other in prompts:
                now = await prompt_tokens_total(client, *b.server_of(other))
                assert now - counted[other] == (len(prompt) if other == model else 0), other
            # the conversation's next turn reuses its slot
            history = [*prompt, *first["tokens"]]
            second = await complete(client, b.proxy, [*history, *ids(99, 20)], model=model)
            assert second["timings"]["cache_n"] == first["tokens_cached"]
            assert sample(b.app, "cacheproxy_model_requests_total", model=model) == 3
        statuses = await model_statuses(client, b.router)
        assert statuses == {"alpha": "loaded", "beta": "loaded"}
        # the ledger counts each model's tasks apart
        rows = await b.app[METER].rows(None, None, None, by_model=True)
        summed = aggregate(rows, "tenant", by_model=True)
        assert {row["model"]: row["requests"] for row in summed} == dict.fromkeys(prompts, 3)


async def test_a_model_nobody_serves_gets_the_routers_answer(
    client: aiohttp.ClientSession, llama_server_binary: Path, tmp_path: Path
) -> None:
    async with bed(llama_server_binary, tmp_path, models_max=2) as b:
        body = {"prompt": [1, 2, 3], "n_predict": 1, "model": "delta"}
        answers = []
        for url in (b.router.url, b.proxy):
            async with client.post(url + "/completion", json=body) as response:
                answers.append((response.status, await response.json()))
        assert answers[0] == answers[1]
        assert answers[1][0] == 400
        assert answers[1][1]["error"]["message"] == "model 'delta' not found"
        # no model named: the plain server serves it, as it always did
        before = await prompt_tokens_total(client, b.plain)
        await complete(client, b.proxy, ids(7, 50))
        assert await prompt_tokens_total(client, b.plain) - before == 50


async def test_an_unloaded_model_comes_back_from_its_archives_and_only_to_its_tenant(
    client: aiohttp.ClientSession, llama_server_binary: Path, tmp_path: Path
) -> None:
    async with bed(llama_server_binary, tmp_path, models_max=1, plain=False) as b:
        _, owner = b.registry.create("owner")
        _, other = b.registry.create("other")
        prompt = ids(1, 600)
        first = await complete(client, b.proxy, prompt, bearer(owner), model="alpha")
        assert first["timings"]["cache_n"] == 0
        # the other model: the router may keep one loaded, and alpha's slots go with it
        await complete(client, b.proxy, ids(2, 200), bearer(owner), model="beta")
        assert await model_statuses(client, b.router) == {"alpha": "unloaded", "beta": "loaded"}
        again = [*prompt, *first["tokens"], *ids(3, 30)]
        second = await complete(client, b.proxy, again, bearer(owner), model="alpha")
        assert await model_statuses(client, b.router) == {"alpha": "loaded", "beta": "unloaded"}
        # restored from the archive made before the unload: all of it reused
        assert second["timings"]["cache_n"] == first["tokens_cached"]
        assert sample(b.app, "cacheproxy_archive_restores_total", outcome="restored") >= 1
        # another tenant's request for the same text reuses none of it
        theirs = await complete(client, b.proxy, again, bearer(other), model="alpha")
        assert theirs["timings"]["cache_n"] == 0


async def test_a_tenant_outside_a_models_allow_list_is_refused_and_does_not_see_it(
    client: aiohttp.ClientSession, llama_server_binary: Path, tmp_path: Path
) -> None:
    async with bed(llama_server_binary, tmp_path, models_max=2) as b:
        _, limited = b.registry.create("limited", models=["alpha", "gamma"])
        _, anyone = b.registry.create("anyone")
        body = {"prompt": ids(5, 40), "n_predict": 2, "model": "beta"}
        async with client.post(b.proxy + "/completion", json=body, headers=bearer(limited)) as r:
            refused = await r.json()
            assert r.status == 403, refused
        assert refused["error"]["type"] == "permission_error"
        assert refused["error"]["code"] == 403
        # nothing ran for it: the router did not even load beta
        assert (await model_statuses(client, b.router))["beta"] == "unloaded"
        seen = {}
        for name, key in (("limited", limited), ("anyone", anyone)):
            async with client.get(b.proxy + "/v1/models", headers=bearer(key)) as response:
                assert response.status == 200
                listed = await response.json()
            seen[name] = sorted(entry["id"] for entry in listed["data"])
            assert all("value" in entry["status"] for entry in listed["data"])
        assert seen == {"limited": ["alpha", "gamma"], "anyone": ["alpha", "beta", "gamma"]}
        # the models it may use are served
        await complete(client, b.proxy, ids(6, 40), bearer(limited), model="alpha")
        await complete(client, b.proxy, ids(6, 40), bearer(limited), model="gamma")


# -- every request shape on a router upstream --------------------------------------------------

UNCOMPARED = frozenset(
    {"id", "created", "created_at", "completed_at", "timings", "id_slot", "cached_tokens"}
)
CHAT = [{"role": "user", "content": "Name three colours."}]
SHAPES: dict[str, tuple[str, dict[str, Any], int]] = {
    # (route, body, tasks it runs as)
    "n=2": ("/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 6}, 2),
    "batch": (
        "/v1/completions",
        {"prompt": ["Once upon a time", "The sky is"], "max_tokens": 5},
        2,
    ),
    "messages": ("/v1/messages", {"messages": CHAT, "max_tokens": 6}, 1),
    "responses": ("/v1/responses", {"input": "Name three colours.", "max_output_tokens": 6}, 1),
    "stream": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "stream": True}, 1),
}


def comparable(document: Any) -> Any:
    if isinstance(document, dict):
        return {k: comparable(v) for k, v in document.items() if k not in UNCOMPARED}
    if isinstance(document, list):
        return [comparable(item) for item in document]
    return document


async def answer_of(client: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, Any]:
    async with client.post(url, json=body) as response:
        if body.get("stream"):
            return response.status, [p async for p in sse_payloads(response)]
        return response.status, await response.json(content_type=None)


@pytest.fixture(scope="module")
def twin_routers(llama_server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two identical routers: one asked directly, one behind the proxy."""
    routers = [
        start_router(llama_server_binary, tmp_path_factory.mktemp(name), parallel=3)
        for name in ("direct", "behind")
    ]
    yield routers
    for router in routers:
        router.stop()


@pytest.mark.parametrize("shape", SHAPES)
async def test_every_request_shape_is_placed_on_a_routers_instance(
    client: aiohttp.ClientSession, twin_routers: list[LlamaServer], tmp_path: Path, shape: str
) -> None:
    direct, behind = twin_routers
    path, body, tasks = SHAPES[shape]
    body = {**body, "model": "alpha", "temperature": 0}
    settings = load_settings(upstreams=[behind.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        expected = await answer_of(client, direct.url + path, body)
        proxied = await answer_of(client, url + path, body)
        assert proxied[0] == expected[0] == 200, proxied
        if body.get("stream"):
            assert proxied[1][-1] == expected[1][-1] == "[DONE]"
            assert len(proxied[1]) == len(expected[1])
        else:
            assert comparable(proxied[1]) == comparable(expected[1])
        # through the table, on the instance's slots
        assert sample(app, "cacheproxy_model_requests_total", model="alpha") == tasks
        assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 0


async def test_a_stream_cut_mid_way_on_a_routers_instance_leaves_the_table_right(
    client: aiohttp.ClientSession, twin_routers: list[LlamaServer], tmp_path: Path
) -> None:
    _, behind = twin_routers
    prompt = ids(11, 64)
    long = {"prompt": prompt, "n_predict": 30000, "ignore_eos": True, "stream": True}
    settings = load_settings(upstreams=[behind.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        response = await client.post(url + "/completion", json={**long, "model": "beta"})
        await anext(sse_payloads(response))
        response.close()  # the client leaves mid-stream
        deadline = asyncio.get_running_loop().time() + IDLE_WITHIN_S
        while any(s["is_processing"] for s in await instance_slots(client, behind, "beta")):
            assert asyncio.get_running_loop().time() < deadline, "the cut task kept running"
            await asyncio.sleep(0.1)
        await wait_for(lambda: sample(app, "cacheproxy_model_requests_total", model="beta") == 1)
        # the next turn on that text is predicted right: the table knows what the cut may
        # have left (the prompt and an unknown tail), as on a plain server
        await complete(client, url, [*prompt, *ids(12, 10)], model="beta")
        assert sample(app, "cacheproxy_predictions_total", result="match") == 1
        assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 0


async def test_a_proxy_started_in_front_of_a_router_running_a_model_serves_it(
    client: aiohttp.ClientSession, twin_routers: list[LlamaServer], tmp_path: Path
) -> None:
    _, behind = twin_routers
    for model in ("alpha", "beta"):  # every model loaded by someone else
        await complete(client, behind.url, ids(41, 20), model=model)
    assert await model_statuses(client, behind) == {"alpha": "loaded", "beta": "loaded"}
    settings = load_settings(upstreams=[behind.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        # its table is read when a request for it comes, and the request is served
        await complete(client, url, ids(42, 20), model="beta")
        assert sample(app, "cacheproxy_model_requests_total", model="beta") == 1


async def test_the_proxys_metrics_are_served_in_front_of_a_router(
    client: aiohttp.ClientSession, twin_routers: list[LlamaServer], tmp_path: Path
) -> None:
    _, behind = twin_routers
    async with client.get(behind.url + "/metrics") as response:
        assert response.status == 400  # a router has none of its own
    settings = load_settings(upstreams=[behind.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, _):
        await complete(client, url, ids(31, 20), model="alpha")
        async with client.get(url + "/metrics") as response:
            assert response.status == 200
            text = await response.text()
        assert "cacheproxy_model_requests_total" in text and "llamacpp:" not in text
        # naming a model: that instance's own, then the proxy's
        async with client.get(url + "/metrics?model=alpha") as response:
            assert response.status == 200
            text = await response.text()
        assert "llamacpp:prompt_tokens_total" in text and "cacheproxy_model_requests_total" in text


async def test_serve_with_a_models_folder_runs_a_router_as_its_managed_server(
    client: aiohttp.ClientSession, llama_server_binary: Path, tmp_path: Path
) -> None:
    folder = model_folder(tmp_path / "models", {name: SEEDS[name] for name in ("alpha", "beta")})
    served = await start_serve(
        tmp_path,
        *("--llama-server", str(llama_server_binary), "--models-dir", str(folder)),
        *("--models-max", "1", "-np", "2", "-c", "8192", "--cache-ram", "0"),
    )
    try:
        async with client.get(served.url + "/props") as response:
            props = await response.json()
        assert (props["role"], props["max_instances"]) == ("router", 1)
        prompt = ids(21, 300)
        first = await complete(client, served.url, prompt, model="alpha")
        await complete(client, served.url, ids(22, 100), model="beta")
        # alpha was unloaded for beta, its slot archived first: it comes back from the archive
        again = [*prompt, *first["tokens"], *ids(23, 10)]
        again = await complete(client, served.url, again, model="alpha")
        assert again["timings"]["cache_n"] == first["tokens_cached"]
    finally:
        await served.stop()


@pytest.mark.parametrize("size", ["small", "big"])
async def test_a_route_the_proxy_does_not_read_is_held_to_the_tenants_models_too(
    client: aiohttp.ClientSession, llama_server_binary: Path, tmp_path: Path, size: str
) -> None:
    """`/tokenize` naming a model outside the tenant's list is refused, whatever the size of
    its body (a big one is kept in a file, its model read there): the router never loads it;
    one on the list is served."""
    async with bed(llama_server_binary, tmp_path, models_max=2) as b:
        _, limited = b.registry.create("limited", models=["alpha", "gamma"])
        content = "word " * (10 if size == "small" else 300_000)  # 1.5 MB
        for model, status in (("beta", 403), ("alpha", 200)):
            body = {"model": model, "content": content}
            async with client.post(
                b.proxy + "/tokenize", json=body, headers=bearer(limited)
            ) as response:
                answer = await response.read()
                assert response.status == status, answer[:200]
            if status == 403:
                assert orjson.loads(answer)["error"]["type"] == "permission_error"
            else:
                assert len(orjson.loads(answer)["tokens"]) >= content.count("word")
        statuses = await model_statuses(client, b.router)
        assert (statuses["beta"], statuses["alpha"]) == ("unloaded", "loaded")


async def test_a_model_whose_preset_turns_off_prompt_caching_is_predicted_as_it_runs(
    client: aiohttp.ClientSession, llama_server_binary: Path, tmp_path: Path
) -> None:
    """A router's preset gives beta `--no-cache-prompt`: a body there that does not say
    `cache_prompt` reuses nothing, as the table predicts, while alpha's reuse as ever."""
    folder = model_folder(tmp_path / "models", {name: SEEDS[name] for name in ("alpha", "beta")})
    preset = tmp_path / "presets.ini"
    preset.write_text("version = 1\n\n[beta]\ncache-prompt = false\n")
    router = start_llama_server(
        llama_server_binary,
        None,
        tmp_path,
        parallel=2,
        ctx_size=8192,
        extra_args=(
            *("--models-dir", str(folder), "--models-max", "2"),
            *("--models-preset", str(preset)),
        ),
    )
    try:
        settings = load_settings(upstreams=[router.url], state_dir=tmp_path / "state")
        async with serving(settings) as (url, app):
            for model, reuses in (("alpha", True), ("beta", False)):
                prompt = ids(41, 200)
                first = await complete(client, url, prompt, model=model)
                again = await complete(
                    client, url, [*prompt, *first["tokens"], *ids(42, 10)], model=model
                )
                assert (again["timings"]["cache_n"] > 0) is reuses
            tables = {table.model_id: table for table in app[CACHE].tables if not table.router}
            assert (tables["alpha"].reuses_by_default, tables["beta"].reuses_by_default) == (
                True,
                False,
            )
            assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 0
    finally:
        router.stop()
