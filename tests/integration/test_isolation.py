"""Tenant isolation on a real llama-server: each test pairs a hit with a miss.

A proxy that never reused anything would pass every "other tenant misses" check alone, so each
is paired with the same tenant's hit, on the same slot. A one-slot server forces every request
onto the slot the previous one left, so nothing but the proxy's isolation can cause a miss.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from yarl import URL

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import Tenant, TenantRegistry
from tests.support.metrics import proxy_counters
from tests.support.restarts import found_under_a_request
from tests.support.servers import LlamaServer, StartServer, serving, serving_tenants
from tests.support.sse import collect_sse
from tests.support.waiting import wait_for

ADMIN_KEY = "admin-key-for-tests-0123456789"
PREFIX = [random.Random(4).randrange(300, 31000) for _ in range(1024)]


@dataclass
class Proxy:
    url: str
    registry: TenantRegistry
    server: LlamaServer


@dataclass
class Client:
    tenant: Tenant
    key: str


def tail(seed: int, length: int = 16) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 31000) for _ in range(length)]


@pytest.fixture
async def proxy(start_server: StartServer, tmp_path: Path) -> AsyncIterator[Proxy]:
    server = start_server(parallel=1)
    async with serving_tenants(server.url, tmp_path, ADMIN_KEY) as (url, registry):
        yield Proxy(url, registry, server)


def new_tenant(proxy: Proxy, name: str, **options: object) -> Client:
    tenant, key = proxy.registry.create(name, **options)
    return Client(tenant, key)


async def complete(
    http: aiohttp.ClientSession, proxy: Proxy, client: Client, prompt: list[int], **extra: object
) -> dict:
    body = {"prompt": prompt, "n_predict": 2, **extra}
    headers = {"Authorization": f"Bearer {client.key}"}
    async with http.post(proxy.url + "/completion", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_same_tenant_reuses_other_tenant_does_not(
    client: aiohttp.ClientSession, proxy: Proxy
) -> None:
    alice, bob = new_tenant(proxy, "alice"), new_tenant(proxy, "bob")
    await complete(client, proxy, alice, PREFIX + tail(1))
    assert (await complete(client, proxy, alice, PREFIX + tail(2)))["timings"]["cache_n"] >= 1024
    assert (await complete(client, proxy, bob, PREFIX + tail(3)))["timings"]["cache_n"] == 0
    # the other order, on the slot bob left: bob hits, alice misses
    assert (await complete(client, proxy, bob, PREFIX + tail(4)))["timings"]["cache_n"] >= 1024
    assert (await complete(client, proxy, alice, PREFIX + tail(5)))["timings"]["cache_n"] == 0


async def test_isolation_survives_slot_moves(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Four slots and traffic in between: the prefix moves between slots, isolation holds."""
    server = start_server(parallel=4)
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        proxy = Proxy(url, registry, server)
        alice, bob = new_tenant(proxy, "alice"), new_tenant(proxy, "bob")
        for round_ in range(6):
            await complete(client, proxy, alice, PREFIX + tail(100 + round_))
            for filler in range(4):  # other prompts of alice's push the slots around
                await complete(client, proxy, alice, tail(200 + 10 * round_ + filler, 300))
            hit = await complete(client, proxy, alice, PREFIX + tail(300 + round_))
            miss = await complete(client, proxy, bob, PREFIX + tail(400 + round_))
            assert hit["timings"]["cache_n"] >= 1024
            assert miss["timings"]["cache_n"] == 0


async def test_a_public_prefix_is_shared_with_those_allowed(
    client: aiohttp.ClientSession, proxy: Proxy
) -> None:
    alice, bob = new_tenant(proxy, "alice"), new_tenant(proxy, "bob")
    carol = new_tenant(proxy, "carol", may_use_public_prefixes=False)
    proxy.registry.add_public_prefix("system-prompt", PREFIX)
    await complete(client, proxy, alice, PREFIX + tail(1))
    assert (await complete(client, proxy, bob, PREFIX + tail(2)))["timings"]["cache_n"] == 1024
    assert (await complete(client, proxy, carol, PREFIX + tail(3)))["timings"]["cache_n"] == 0
    # alice's own continuation past the public prefix stays hers
    await complete(client, proxy, alice, PREFIX + tail(4, 64))
    shared_past_prefix = PREFIX + tail(4, 64)[:32] + tail(5)
    assert (await complete(client, proxy, bob, shared_past_prefix))["timings"]["cache_n"] == 0


@pytest.mark.parametrize("presented", [None, "Bearer nope", "Bearer cpk_revoked", "disabled"])
async def test_bad_keys_get_401_in_the_envelope(
    client: aiohttp.ClientSession, proxy: Proxy, presented: str | None
) -> None:
    alice = new_tenant(proxy, "alice")
    old_key = alice.key
    proxy.registry.rotate_key(alice.tenant.id)
    headers = {}
    if presented == "Bearer cpk_revoked":
        headers["Authorization"] = f"Bearer {old_key}"
    elif presented == "disabled":
        dave = new_tenant(proxy, "dave")
        proxy.registry.set_disabled(dave.tenant.id, True)
        headers["X-Api-Key"] = dave.key
    elif presented is not None:
        headers["Authorization"] = presented
    for method, path in (("POST", "/completion"), ("POST", "/tokenize"), ("GET", "/props")):
        async with client.request(
            method, proxy.url + path, json={"prompt": [1, 2]}, headers=headers
        ) as response:
            assert response.status == 401
            assert await response.json() == {
                "error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
            }
    async with client.get(proxy.url + "/health") as response:
        assert response.status == 200  # public, as llama-server's


async def test_tenants_cannot_see_slots_or_metrics(
    client: aiohttp.ClientSession, proxy: Proxy
) -> None:
    alice = new_tenant(proxy, "alice")
    headers = {"Authorization": f"Bearer {alice.key}"}
    for method, path in (("GET", "/slots"), ("POST", "/slots/0?action=erase")):
        async with client.request(method, proxy.url + path, headers=headers) as response:
            assert response.status == 403
            assert (await response.json())["error"]["type"] == "permission_error"
    async with client.get(proxy.url + "/metrics", headers=headers) as response:
        assert response.status == 401
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with client.get(proxy.url + "/metrics", headers=admin) as response:
        assert response.status == 200


# What changes the server for every tenant: the operator's once tenants exist.
OPERATOR_ONLY = [
    ("POST", "/lora-adapters", []),
    ("POST", "/models/unload", {"model": "any"}),
    ("POST", "/tools", {"tool": "read_file", "params": {"path": "/etc/hostname"}}),
    ("GET", "/cors-proxy?url=http://127.0.0.1:1/", None),
    ("POST", "/props", {}),  # global properties (`--props`)
]
# Tasks llama-server places on a slot of its own choosing: closed to tenants.
UNPLACED_TASKS = [
    ("POST", "/v1/systemone", {"questions": []}),
    ("POST", "/v1/audio/transcriptions", {"model": "any"}),
    ("POST", "/audio/transcriptions", {"model": "any"}),
]


@pytest.mark.parametrize(("method", "path", "body"), OPERATOR_ONLY + UNPLACED_TASKS)
async def test_routes_acting_on_every_tenant_or_unplaced_are_closed_to_tenants(
    client: aiohttp.ClientSession, proxy: Proxy, method: str, path: str, body: object
) -> None:
    alice = new_tenant(proxy, "alice")
    for headers in ({"Authorization": f"Bearer {alice.key}"}, {"X-Api-Key": alice.key}):
        async with client.request(method, proxy.url + path, json=body, headers=headers) as response:
            assert response.status == 403, await response.text()
            error = (await response.json())["error"]
            assert (error["code"], error["type"]) == (403, "permission_error")
    # the same path written otherwise reaches the same route of llama-server: refused too
    encoded = f"/%{ord(path[1]):02X}{path[2:]}"
    headers = {"Authorization": f"Bearer {alice.key}"}
    async with client.request(
        method, URL(proxy.url + encoded, encoded=True), json=body, headers=headers
    ) as response:
        assert response.status == 403, (encoded, await response.text())
    # a bad key is told so first, as on every route
    async with client.request(method, proxy.url + path, json=body) as response:
        assert response.status == 401


@pytest.mark.parametrize(("method", "path", "body"), OPERATOR_ONLY)
async def test_the_operator_reaches_what_changes_the_server_for_every_tenant(
    client: aiohttp.ClientSession, proxy: Proxy, method: str, path: str, body: object
) -> None:
    """With the admin key the request goes to llama-server, which answers as it answers
    directly (the test server has no LoRA adapter, no router, no tools, no MCP proxy)."""
    new_tenant(proxy, "alice")
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with client.request(method, proxy.url + path, json=body, headers=admin) as response:
        proxied = (response.status, await response.read())
    async with client.request(method, proxy.server.url + path, json=body) as response:
        direct = (response.status, await response.read())
    assert proxied == direct


async def test_a_server_started_with_tools_lends_them_to_the_operator_only(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """llama-server's own tools (`--tools`) read any file it can, another tenant's archives
    in its slot folder among them: once tenants exist, only the admin key reaches them."""
    server = start_server(parallel=1, extra_args=("--tools", "read_file"))
    kept = tmp_path / "another-tenants-archive.bin"
    kept.write_text("what the operator may read")
    body = {"tool": "read_file", "params": {"path": str(kept)}}
    async with serving_tenants(server.url, tmp_path / "proxy", ADMIN_KEY) as (url, registry):
        _, key = registry.create("alice")
        async with client.post(
            url + "/tools", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            assert response.status == 403
            assert "what the operator may read" not in await response.text()
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with client.post(url + "/tools", json=body, headers=admin) as response:
            assert response.status == 200
            assert "what the operator may read" in await response.text()


async def test_hidden_cache_signals(client: aiohttp.ClientSession, proxy: Proxy) -> None:
    quiet = new_tenant(proxy, "quiet", hide_cache_signals=True)
    await complete(client, proxy, quiet, PREFIX + tail(1))
    prompt = PREFIX + tail(2)
    answer = await complete(client, proxy, quiet, prompt)
    # shown as an uncached run: nothing reused, the whole prompt decoded, no prompt timings
    assert (answer["timings"]["cache_n"], answer["timings"]["prompt_n"]) == (0, len(prompt))
    assert "prompt_ms" not in answer["timings"]
    headers = {"Authorization": f"Bearer {quiet.key}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "n_predict": 2, "stream": True}
    async with client.post(
        proxy.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        events = await collect_sse(response)
    assert events[-1] == "[DONE]"
    assert not any('"cache_n":0' not in event for event in events if "cache_n" in event)
    assert not any('"prompt_ms"' in event for event in events)
    # the tenant's cache still works, and the proxy still reads what it hides
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    usage_path = f"/admin/tenants/{quiet.tenant.id}/usage"
    async with client.get(proxy.url + usage_path, headers=admin) as response:
        figures = (await response.json())["usage"]
    assert figures["reused_tokens"] >= 1024


async def test_a_shared_server_ram_cache_is_refused_with_tenants(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, cache_ram_mib=64)
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        _, key = registry.create("alice")
        headers = {"Authorization": f"Bearer {key}"}
        async with client.post(
            url + "/completion", json={"prompt": [1, 2, 3]}, headers=headers
        ) as response:
            assert response.status == 503
            assert "--cache-ram 0" in (await response.json())["error"]["message"]


async def test_a_server_back_with_a_ram_cache_under_requests_is_refused_to_tenants(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """llama-server run with `--cache-ram 0` comes back at once with its RAM cache on (its
    default), found by its slots' task ids while a tenant's request already runs on the new
    process, so the table is emptied in place and the upstream kept in service: what the
    start-up probe found of the old process is not taken for the new one. Tenants are refused
    (503) from then on, before and after the probe has looked at the new process."""
    server = start_server(parallel=2, cache_ram_mib=0)
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        tenants={"database": tmp_path / "tenants.db"},
        # no check looks on its own: only the request path, and `wake` below as a misprediction
        routing={"health_interval_s": 3600, "reconcile_interval_s": 3600, "recheck_idle_s": 0},
    )
    with TenantRegistry(settings.tenant_database()) as registry:
        _, key = registry.create("alice")
        headers = {"Authorization": f"Bearer {key}"}

        async def status(prompt: list[int], n_predict: int = 2) -> int:
            body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True}
            async with client.post(url + "/completion", json=body, headers=headers) as response:
                await response.read()
                return response.status

        async with serving(settings) as (url, app):
            for seed in (1, 2, 3):  # three tasks answered: the new process's ids begin below
                assert await status(tail(seed, 64)) == 200
            table = app[CACHE].tables[0]
            assert table.ram_cache_state == "off"
            server.kill()
            start_server(port=server.port, parallel=2, cache_ram_mib=None)
            # 6000 tokens: running through what follows, on a slow machine too
            long_answer = asyncio.create_task(status(tail(20, 64), n_predict=6000))
            await found_under_a_request(app, long_answer)
            assert table.healthy  # kept in service
            assert await status(tail(30, 64)) == 503  # its RAM cache not known yet
            assert await long_answer == 200
            app[CACHE].monitor.wake()  # the next check probes the idle slots
            await wait_for(lambda: table.ram_cache_known, "the probe of the new process")
            assert table.ram_cache_state == "on"
            assert await status(tail(31, 64)) == 503


@pytest.mark.parametrize(
    ("asked_by", "n"), [("body", 1), ("server", 1), ("body", 2), ("server", 2)]
)
async def test_chunks_past_a_public_prefix_are_not_reused_by_kv_shifting(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, asked_by: str, n: int
) -> None:
    """llama-server reuses chunks of the slot's text past the common prefix by shifting their
    KV (text dropped from the middle of a prompt), as a body's `n_cache_reuse` or its own
    `--cache-reuse` asks: after a public prefix shared with another tenant, those chunks are
    the other tenant's. One task, or two (`n`: split over the slots, one of them on the slot
    holding the other tenant's text)."""
    reuse_flag = ("--cache-reuse", "16") if asked_by == "server" else ()
    server = start_server(parallel=n, ctx_size=n * 4096, extra_args=reuse_flag)
    async with serving_tenants(server.url, tmp_path, ADMIN_KEY) as (url, registry):
        proxy = Proxy(url, registry, server)
        alice, bob = new_tenant(proxy, "alice"), new_tenant(proxy, "bob")
        proxy.registry.add_public_prefix("system-prompt", PREFIX)
        extra = {"n_cache_reuse": 16} if asked_by == "body" else {}
        document = tail(10, 256)
        await complete(client, proxy, alice, PREFIX + tail(11, 64) + document)
        # alice's own text: the document after the part she dropped is hers to reuse
        mine = await complete(client, proxy, alice, PREFIX + document, **extra)
        assert mine["timings"]["cache_n"] >= 1024 + 128
        await complete(client, proxy, alice, PREFIX + tail(12, 64) + document)
        theirs = await complete(client, proxy, bob, PREFIX + document, n=n, **extra)
        results = theirs if isinstance(theirs, list) else [theirs]
        assert len(results) == n
        assert max(result["timings"]["cache_n"] for result in results) == 1024
        # alice's reuse past the prediction is told as what it was, not as a misprediction
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        counters = await proxy_counters(client, url, admin)
        assert counters['cacheproxy_predictions_total{result="shifted"}'] == 1
        assert counters.get('cacheproxy_predictions_total{result="mismatch"}', 0) == 0
