"""The start-up probe on every llama-server configuration: with and without --slot-save-path,
with --api-key, on one slot, on slots that are already full or busy. A RAM cache is reported
"on" or "unknown", never "off" when it is there, and tenants are refused while it may be shared.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.metrics import sample
from tests.support.servers import (
    LlamaServer,
    StartServer,
    serving,
    serving_tenants,
    wait_for_health,
)
from tests.support.waiting import wait_for

UPSTREAM_KEY = "upstream-key-for-tests-0123456789"
SECRET = [random.Random(7).randrange(300, 31000) for _ in range(200)]


def settings_for(server: LlamaServer, tmp_path: Path, **overrides: object):  # noqa: ANN201
    return load_settings(upstreams=[server.url], state_dir=tmp_path / "state", **overrides)


async def completion(
    http: aiohttp.ClientSession, url: str, prompt: list[int], **extra: object
) -> tuple[int, dict]:
    headers = extra.pop("headers", None) or {}
    async with http.post(
        url + "/completion", json={"prompt": prompt, "n_predict": 1, **extra}, headers=headers
    ) as response:
        return response.status, await response.json(content_type=None)


async def server_slots(http: aiohttp.ClientSession, server: LlamaServer) -> list[dict]:
    async with http.get(server.url + "/slots") as response:
        return await response.json()


async def test_without_slot_save_path_the_ram_cache_is_found_and_requests_are_served(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """llama-server as most people start it: no --slot-save-path (erase answers 501) and the
    default 8 GiB RAM cache."""
    server = start_server(slot_actions=False, cache_ram_mib=8192)
    caplog.set_level(logging.INFO, logger="cacheproxy")
    async with serving(settings_for(server, tmp_path)) as (url, app):
        table = app[CACHE].tables[0]
        assert table.healthy
        assert table.ram_cache is True and table.ram_cache_state == "on"
        assert "server RAM cache on" in caplog.text and "not answering" not in caplog.text
        # the probe's prompts stay in the slots it used: the table knows them, as nobody's
        held = {
            entry["id"]: entry.get("n_prompt_tokens", 0)
            for entry in await server_slots(client, server)
        }
        for slot in table.slots:
            assert slot.n_tokens == held[slot.slot_id]
            assert slot.tenant is None
        status, answer = await completion(client, url, [5, 6, 7, 8])
        assert status == 200, answer


async def test_without_slot_save_path_tenants_are_refused_with_the_fix(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(slot_actions=False, cache_ram_mib=8192)
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        _, key = registry.create("alice")
        status, answer = await completion(
            client, url, SECRET, headers={"Authorization": f"Bearer {key}"}
        )
        assert status == 503
        message = answer["error"]["message"]
        assert "--cache-ram 0" in message and "routing.server_ram_cache" in message
        # no upstream can serve a tenant: a load balancer is told so, the fix named
        async with client.get(url + "/health") as response:
            assert response.status == 503
            assert (await response.json())["error"]["message"] == message
        async with client.get(url + "/livez") as response:
            assert response.status == 200


@pytest.mark.parametrize(("cache_ram", "state"), [(0, "off"), (64, "on")])
async def test_one_slot_ram_cache_is_found(
    start_server: StartServer, tmp_path: Path, cache_ram: int, state: str
) -> None:
    server = start_server(parallel=1, cache_ram_mib=cache_ram)
    async with serving(settings_for(server, tmp_path)) as (_, app):
        assert app[CACHE].tables[0].ram_cache is (state == "on")
        assert app[CACHE].tables[0].ram_cache_state == state


@pytest.mark.parametrize(("cache_ram", "state"), [(0, "off"), (64, "on")])
async def test_slots_already_full_at_start_up(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    cache_ram: int,
    state: str,
) -> None:
    server = start_server(parallel=2, cache_ram_mib=cache_ram)
    for slot_id in (0, 1):  # another client, or the proxy before a restart, filled them
        rng = random.Random(slot_id)
        prompt = [rng.randrange(3000, 31000) for _ in range(64)]
        assert (await completion(client, server.url, prompt, id_slot=slot_id))[0] == 200
    async with serving(settings_for(server, tmp_path)) as (_, app):
        assert app[CACHE].tables[0].ram_cache is (state == "on")
        assert app[CACHE].tables[0].ram_cache_state == state


async def test_busy_slots_at_start_up_give_unknown_then_the_monitor_finds_out(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = start_server(parallel=1, cache_ram_mib=64)
    caplog.set_level(logging.INFO, logger="cacheproxy")
    # a long generation holds the only slot while the proxy starts
    body = {"prompt": [5, 6, 7], "n_predict": 15000, "ignore_eos": True, "stream": True}
    running = await client.post(server.url + "/completion", json=body)
    assert running.status == 200
    await running.content.readline()  # it has started
    database = tmp_path / "tenants.db"
    with TenantRegistry(database) as registry:
        _, key = registry.create("alice")
        # the disk tier is left out: its probe save on a busy slot waits for the slot to free
        settings = settings_for(
            server,
            tmp_path,
            tenants={"database": database},
            routing={"health_interval_s": 0.2},
            disk={"enabled": False},
        )
        async with serving(settings) as (url, app):
            table = app[CACHE].tables[0]
            assert table.ram_cache_state == "unknown" and table.ram_cache is True
            assert "server RAM cache unknown" in caplog.text
            assert "server RAM cache off" not in caplog.text
            status, answer = await completion(
                client, url, SECRET, headers={"Authorization": f"Bearer {key}"}
            )
            assert status == 503
            assert "RAM cache unknown" in answer["error"]["message"]
            running.close()  # the slot frees: the monitor probes again
            await wait_for(lambda: table.ram_cache_state != "unknown", "the probe to run again")
            assert table.ram_cache_state == "on"


async def test_with_an_upstream_api_key(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(
        parallel=1, cache_ram_mib=64, slot_actions=False, extra_args=("--api-key", UPSTREAM_KEY)
    )
    settings = settings_for(server, tmp_path, upstream_api_key=UPSTREAM_KEY)
    async with serving(settings) as (url, app):
        table = app[CACHE].tables[0]
        assert table.healthy and table.ram_cache is True
        assert table.ram_cache_state == "on"
        # no tenants: clients present the key the server itself accepts
        status, answer = await completion(client, url, [5, 6, 7, 8])
        assert status == 401, answer
        key = {"Authorization": f"Bearer {UPSTREAM_KEY}"}
        status, answer = await completion(client, url, [5, 6, 7, 8], headers=key)
        assert status == 200, answer


@pytest.mark.parametrize("server_reuses", [True, False])
async def test_a_tenant_never_reads_another_tenants_prefix_from_the_ram_cache(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, server_reuses: bool
) -> None:
    """Paired: straight to the server, the RAM cache hands a second caller the first one's
    prefix; through the proxy, with tenants, the second tenant never gets any of it. Also
    with a server started with `--no-cache-prompt`, whose requests reuse nothing unless they
    ask for it: the RAM cache is there for those that ask."""
    tail_a = [random.Random(1).randrange(300, 31000) for _ in range(8)]
    tail_b = [random.Random(2).randrange(300, 31000) for _ in range(8)]
    other = [random.Random(3).randrange(300, 31000) for _ in range(200)]
    flags = () if server_reuses else ("--no-cache-prompt",)
    asks = {} if server_reuses else {"cache_prompt": True}
    control = start_server(parallel=1, cache_ram_mib=8192, slot_actions=False, extra_args=flags)
    await completion(client, control.url, SECRET + tail_a, id_slot=0, **asks)
    await completion(client, control.url, other, id_slot=0, **asks)  # the secret moves to RAM
    _, leaked = await completion(client, control.url, SECRET + tail_b, id_slot=0, **asks)
    assert leaked["timings"]["cache_n"] >= len(SECRET)  # the leak the proxy must prevent

    server = start_server(parallel=2, cache_ram_mib=8192, slot_actions=False, extra_args=flags)
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        _, key_a = registry.create("alice")
        _, key_b = registry.create("bob")
        for key, prompt in ((key_a, SECRET + tail_a), (key_a, other)) * 3:
            await completion(
                client, url, prompt, headers={"Authorization": f"Bearer {key}"}, **asks
            )
        for _ in range(3):
            status, answer = await completion(
                client, url, SECRET + tail_b, headers={"Authorization": f"Bearer {key_b}"}, **asks
            )
            assert status != 200 or answer["timings"]["cache_n"] == 0, answer
            assert status == 503, answer


@pytest.mark.parametrize("server_reuses", [True, False])
async def test_a_request_that_does_not_say_reuses_as_the_server_does_by_default(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, server_reuses: bool
) -> None:
    """`--no-cache-prompt` makes reuse opt-in: a body without `cache_prompt` is served with
    nothing reused, as straight from the server, and the table predicts just that; a body
    that asks is still reused, and predicted."""
    flags = () if server_reuses else ("--no-cache-prompt",)
    server = start_server(parallel=2, extra_args=flags)
    async with serving(settings_for(server, tmp_path)) as (url, app):
        for turn in range(3):  # a conversation, one turn longer each time, the field left out
            status, answer = await completion(client, url, SECRET[: 100 + 50 * turn])
            assert status == 200, answer
            assert (answer["timings"]["cache_n"] > 0) is (server_reuses and turn > 0)
        status, answer = await completion(client, url, SECRET[:190], cache_prompt=True)
        assert answer["timings"]["cache_n"] >= 150
        assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 0
        assert sample(app, "cacheproxy_predictions_total", result="match") == 4
        assert app[CACHE].tables[0].reuses_by_default is server_reuses


async def test_a_server_started_with_an_api_prefix_is_served_through_its_base_url(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """`--api-prefix /llama` puts every route of llama-server under the prefix: the upstream is
    configured with it in its URL, and clients call the proxy's usual paths."""
    server = start_server(parallel=2, extra_args=("--api-prefix", "/llama"), wait=False)
    base = server.url + "/llama"
    wait_for_health(base, server)
    async with serving(load_settings(upstreams=[base], state_dir=tmp_path / "state")) as (
        url,
        app,
    ):
        assert app[CACHE].tables[0].healthy and app[CACHE].tables[0].n_vocab
        for turn in range(2):  # a conversation: its second turn is reused, as predicted
            status, answer = await completion(client, url, SECRET[: 100 + 50 * turn])
            assert status == 200, answer
        assert answer["timings"]["cache_n"] >= 100
        assert sample(app, "cacheproxy_predictions_total", result="match") == 2
        for path in ("/props", "/v1/models", "/slots"):
            async with client.get(url + path) as proxied, client.get(base + path) as direct:
                assert proxied.status == direct.status == 200
        # a route under no prefix is not llama-server's: answered as it answers it
        async with client.get(server.url + "/props") as direct:
            assert direct.status == 404


async def test_a_server_taken_for_one_that_does_not_reuse_by_default_is_told_by_its_answers(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """A probe misled (a slot emptied under it by a task launched beside it, on a server that
    empties idle slots: a race this test cannot time, so the table is set as it would leave
    it): the first answer that reuses a body which did not say tells the default."""
    server = start_server(parallel=1)
    async with serving(settings_for(server, tmp_path)) as (url, app):
        table = app[CACHE].tables[0]
        table.reuses_by_default = False
        for turn in range(3):
            status, answer = await completion(client, url, SECRET[: 100 + 50 * turn])
            assert status == 200, answer
        assert answer["timings"]["cache_n"] >= 149
        assert table.reuses_by_default is True
        # one turn mispredicted (reused, unasked), the next predicted as the server reuses
        assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 1
        assert sample(app, "cacheproxy_predictions_total", result="match") == 2


async def test_a_ram_cache_that_pinned_tasks_never_reach_is_found_all_the_same(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """With `-sps 0` a pinned task never loads from the RAM cache, but one without `id_slot`
    does, and idle slots are emptied into it (the default topology): it is there, and tenants
    are refused while it is."""
    server = start_server(parallel=None, cache_ram_mib=64, extra_args=("-sps", "0"))
    async with serving(settings_for(server, tmp_path)) as (_, app):
        assert app[CACHE].tables[0].ram_cache_state == "on"
    async with serving_tenants(server.url, tmp_path / "tenants") as (url, registry):
        _, key = registry.create("alice")
        status, answer = await completion(
            client, url, SECRET, headers={"Authorization": f"Bearer {key}"}
        )
        assert status == 503, answer


async def test_a_server_restarted_with_other_flags_is_probed_for_its_default_again(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Restarted on the same port with `--no-cache-prompt`: the table built again learns that
    its bodies without the field reuse nothing, and predicts them so."""
    server = start_server(parallel=2)
    settings = settings_for(server, tmp_path, routing={"health_interval_s": 0.2})
    async with serving(settings) as (url, app):
        table = app[CACHE].tables[0]
        assert table.reuses_by_default is True
        server.kill()
        await wait_for(lambda: not table.healthy)
        start_server(port=server.port, parallel=2, extra_args=("--no-cache-prompt",))
        await wait_for(lambda: table.healthy)
        assert table.reuses_by_default is False
        for turn in range(2):
            status, answer = await completion(client, url, SECRET[: 100 + 50 * turn])
            assert status == 200, answer
        assert answer["timings"]["cache_n"] == 0
        assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 0
