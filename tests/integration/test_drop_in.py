"""Differences llama.cpp's own server tests found between llama-server and the proxy in front of
it, each checked here against a real llama-server: the proxy answers as the server would.

- a field the server sends by its own default (`__verbose` under `--verbose`) is kept;
- GET /metrics with one upstream is the server's own, live, plus the proxy's families (501 when
  the server runs without `--metrics`);
- the proxy's polling never keeps an idle server (`--sleep-idle-seconds`) awake, and the table
  follows the sleep, which empties every slot;
- a client's own `id_slot` is honoured with no tenants, and its slot actions keep the table right;
- an empty answer (204) passes through as it is.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import load_settings
from tests.support.metrics import proxy_counters
from tests.support.servers import StartServer, serving, serving_tenants
from tests.support.waiting import wait_for

CHAT = {
    "messages": [
        {"role": "system", "content": "Book"},
        {"role": "user", "content": "What is the best book"},
    ],
    "max_tokens": 2,
}
PROMPT = [(7 * index) % 900 + 20 for index in range(60)]


def settings_for(server_url: str, tmp_path: Path, **overrides: Any):  # noqa: ANN201
    return load_settings(
        upstreams=[server_url], state_dir=tmp_path / "state", disk={"enabled": False}, **overrides
    )


async def post(client: aiohttp.ClientSession, url: str, body: dict, **kwargs: Any) -> dict:
    async with client.post(url, json=body, **kwargs) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def mismatches(counters: dict[str, float]) -> float:
    return counters.get('cacheproxy_predictions_total{result="mismatch"}', 0.0)


# -- __verbose ---------------------------------------------------------------------------------


async def test_verbose_sent_by_the_servers_default_is_kept(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Under `--verbose` llama-server answers every OAI request with `__verbose` unless it asks
    for `verbose: false` (server-schema.cpp: `params.verbose = params_base.verbosity > 9`,
    then the request's `verbose` field): the proxy, which asks for it to read the slot, must
    not take away what the server would have sent anyway."""
    server = start_server(extra_args=("--verbose",))
    direct = await post(client, server.url + "/v1/chat/completions", CHAT)
    assert "__verbose" in direct
    async with serving(settings_for(server.url, tmp_path)) as (url, _):
        for _ in range(2):  # the first teaches the proxy the server's default, the second uses it
            proxied = await post(client, url + "/v1/chat/completions", CHAT)
            assert "__verbose" in proxied
            assert "Book" in proxied["__verbose"]["prompt"]
            assert set(proxied) == set(direct)
            assert set(proxied["__verbose"]) == set(direct["__verbose"])
            assert proxied["__verbose"]["tokens"] == direct["__verbose"]["tokens"] == []
        quiet = await post(client, url + "/v1/chat/completions", {**CHAT, "verbose": False})
        assert "__verbose" not in quiet
        counters = await proxy_counters(client, url)
    assert mismatches(counters) == 0


async def test_verbose_the_proxy_adds_is_removed_again(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server()
    async with serving(settings_for(server.url, tmp_path)) as (url, app):
        for _ in range(3):
            proxied = await post(client, url + "/v1/chat/completions", CHAT)
            assert "__verbose" not in proxied
        asked = await post(client, url + "/v1/chat/completions", {**CHAT, "verbose": True})
        assert "Book" in asked["__verbose"]["prompt"]
        assert asked["__verbose"]["tokens"] == []  # return_tokens was the proxy's, not asked
        counters = await proxy_counters(client, url)
        slot = app[CACHE].tables[0].slots[asked["__verbose"]["id_slot"]]
    assert mismatches(counters) == 0
    assert slot.unknown_tail == 0  # the generated ids were read: the table holds them all


async def test_hidden_cache_signals_are_hidden_inside_the_servers_own_verbose(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(extra_args=("--verbose",))
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        _, key = registry.create("quiet", hide_cache_signals=True)
        headers = {"Authorization": f"Bearer {key}"}
        answers = [
            await post(client, url + "/v1/chat/completions", CHAT, headers=headers)
            for _ in range(3)
        ]
    for answer in answers:
        assert "__verbose" in answer
        assert answer["__verbose"]["timings"]["cache_n"] == 0
        assert answer["timings"]["cache_n"] == 0
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- /metrics ----------------------------------------------------------------------------------


def samples(text: str) -> dict[str, float]:
    """llama-server's unlabelled samples, by name."""
    found = re.findall(r"^(llamacpp:\w+) (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in found}


async def test_metrics_with_one_upstream_are_the_servers_own_and_live(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server()
    async with serving(settings_for(server.url, tmp_path)) as (url, _):
        answer = await post(client, url + "/completion", {"prompt": PROMPT, "n_predict": 8})
        async with client.get(url + "/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            started = response.headers["Process-Start-Time-Unix"]
            proxied = await response.text()
        async with client.get(server.url + "/metrics") as response:
            direct = await response.text()
            assert started == response.headers["Process-Start-Time-Unix"]
    # the server's samples as it writes them, not labelled by upstream (the proxy's own may be)
    servers = [line for line in proxied.splitlines() if "llamacpp:" in line]
    assert servers and not [line for line in servers if "upstream=" in line]
    assert "cacheproxy_requests_total" in proxied
    for name in ("prompt_tokens_total", "tokens_predicted_total", "n_decode_total"):
        assert samples(proxied)[f"llamacpp:{name}"] == samples(direct)[f"llamacpp:{name}"]
    assert samples(proxied)["llamacpp:tokens_predicted_total"] >= answer["timings"]["predicted_n"]
    for line in direct.splitlines():
        if line.startswith("# "):
            assert line in proxied  # every HELP and TYPE line, as the server writes it


async def test_metrics_of_a_server_without_metrics_answer_501(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(metrics=False)
    async with client.get(server.url + "/metrics") as response:
        assert response.status == 501
        direct = await response.json()
    async with serving(settings_for(server.url, tmp_path)) as (url, _):
        async with client.get(url + "/metrics") as response:
            assert response.status == 501
            assert await response.json() == direct


# -- sleep -------------------------------------------------------------------------------------


async def test_an_idle_server_sleeps_behind_the_proxy_and_the_table_follows(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """llama-server sleeps after `--sleep-idle-seconds` without a task (server-queue.cpp,
    start_loop) and frees its context (server-context.cpp handle_sleeping_state: destroy()):
    the proxy's polling must not wake it, and after it the slots hold nothing."""
    server = start_server(parallel=2, extra_args=("--sleep-idle-seconds", "1"))

    async def sleeping() -> bool:
        async with client.get(server.url + "/props") as response:  # does not wake it
            return (await response.json())["is_sleeping"]

    settings = settings_for(
        server.url, tmp_path, routing={"health_interval_s": 0.2, "reconcile_interval_s": 0.4}
    )
    async with serving(settings) as (url, app):
        table = app[CACHE].tables[0]
        first = await post(client, url + "/completion", {"prompt": PROMPT, "n_predict": 2})
        assert not all(slot.empty for slot in table.slots)
        await wait_for(sleeping, "the server to go to sleep")

        async def table_emptied() -> bool:
            return all(slot.empty for slot in table.slots)

        await wait_for(table_emptied, "the table to see the slots emptied")
        await asyncio.sleep(2.0)  # several rounds of the proxy's polling
        assert await sleeping()
        before = await proxy_counters(client, url)
        again = await post(client, url + "/completion", {"prompt": PROMPT, "n_predict": 2})
        after = await proxy_counters(client, url)
    assert first["timings"]["cache_n"] == 0
    assert again["timings"]["cache_n"] == 0  # the sleep took the slot's content
    assert mismatches(after) == mismatches(before) == 0


# -- a client's id_slot and slot actions ------------------------------------------------------


async def test_a_clients_id_slot_and_slot_actions_are_honoured_without_tenants(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2)
    async with serving(settings_for(server.url, tmp_path)) as (url, app):
        table = app[CACHE].tables[0]
        first = await post(
            client, url + "/completion", {"prompt": PROMPT, "id_slot": 1, "n_predict": 2}
        )
        assert first["id_slot"] == 1
        saved = await post(client, url + "/slots/1?action=save", {"filename": "one.bin"})
        assert saved["n_saved"] == first["tokens_cached"]
        restored = await post(client, url + "/slots/0?action=restore", {"filename": "one.bin"})
        assert restored["n_restored"] == saved["n_saved"]
        assert table.slots[0].n_tokens == restored["n_restored"]
        again = await post(
            client, url + "/completion", {"prompt": PROMPT, "id_slot": 0, "n_predict": 2}
        )
        assert again["id_slot"] == 0
        assert again["timings"]["cache_n"] == len(PROMPT) - 1
        await post(client, url + "/slots/0?action=erase", {})
        assert table.slots[0].empty
        cold = await post(
            client, url + "/completion", {"prompt": PROMPT, "id_slot": 0, "n_predict": 2}
        )
        assert cold["timings"]["cache_n"] == 0
        counters = await proxy_counters(client, url)
    assert mismatches(counters) == 0


async def test_a_tenants_id_slot_is_still_the_proxys_choice(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Tenants never choose a slot: it would let one reach another's text."""
    server = start_server(parallel=2)
    async with serving_tenants(server.url, tmp_path) as (url, registry):
        _, key = registry.create("acme")
        headers = {"Authorization": f"Bearer {key}"}
        body = {"prompt": PROMPT, "n_predict": 2}
        first = await post(client, url + "/completion", body, headers=headers)
        other = 1 - first["id_slot"]
        again = await post(client, url + "/completion", {**body, "id_slot": other}, headers=headers)
    assert again["id_slot"] == first["id_slot"]  # where its prompt is, not where it asked


# -- empty answers -----------------------------------------------------------------------------


@pytest.fixture
def no_content_server() -> Iterator[int]:
    class NoContent(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the name http.server calls
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    target = ThreadingHTTPServer(("127.0.0.1", 0), NoContent)
    thread = threading.Thread(target=target.serve_forever, daemon=True)
    thread.start()
    yield target.server_port
    target.shutdown()
    target.server_close()


async def test_a_204_from_the_upstream_passes_through(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    no_content_server: int,
) -> None:
    """llama-server's CORS proxy relays a 204 with `Transfer-Encoding: chunked` and a chunk
    terminator, which a 204 cannot have: the proxy still relays the 204, as clients read it."""
    server = start_server(extra_args=("--ui-mcp-proxy",))
    target = f"/cors-proxy?url=http://127.0.0.1:{no_content_server}/"
    async with serving(settings_for(server.url, tmp_path)) as (url, _):
        for _ in range(2):  # and the connection to the upstream stays usable
            async with client.post(url + target, json={}) as response:
                assert response.status == 204
                assert await response.read() == b""
        async with client.get(url + "/health") as response:
            assert response.status == 200
