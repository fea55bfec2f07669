"""The proxy in front of the embedded engine: routing, slot table and disk tier unchanged."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.cli.local_server import chosen_backend
from cacheproxy.embedded.server import EmbeddedServer, build_engine
from cacheproxy.http.app_keys import METRICS
from cacheproxy.plugins import PluginError
from cacheproxy.settings import EmbeddedSettings, load_settings
from cacheproxy.upstreams.managed import free_port
from tests.support.servers import serving, serving_tenants, wait_for_health


async def test_proxy_routes_to_the_embedded_engine(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    settings = load_settings(state_dir=tmp_path / "state")
    engine_server = EmbeddedServer(
        EmbeddedSettings(parallel=2, ctx_size=4096, threads=1), tiny_model, tmp_path / "engine"
    )
    rng = random.Random(5)
    prompt = [rng.randrange(100, 30000) for _ in range(160)]
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0}
    async with serving(settings, managed=engine_server) as (url, _):
        async with client.post(url + "/completion", json=body) as response:
            assert response.status == 200, await response.text()
            first = await response.json()
        async with client.post(url + "/completion", json=body) as response:
            second = await response.json()
        # a streamed turn, then the conversation goes on from what the slot holds
        streamed = {**body, "prompt": [*prompt, 7, 8, 9], "stream": True, "return_tokens": True}
        generated: list[int] = []
        async with client.post(url + "/completion", json=streamed) as response:
            async for line in response.content:
                if line.startswith(b"data: "):
                    event = orjson.loads(line[6:])
                    generated += event["tokens"]
                    final = event
        follow_up = {**body, "prompt": [*prompt, 7, 8, 9, *generated, 10]}
        async with client.post(url + "/completion", json=follow_up) as response:
            third = await response.json()
    assert first["id_slot"] in (0, 1)
    assert second["id_slot"] == first["id_slot"]  # the router sends the repeat to its slot
    assert (first["timings"]["cache_n"], second["timings"]["cache_n"]) == (0, 159)
    assert final["id_slot"] == third["id_slot"] == first["id_slot"]
    assert final["timings"]["cache_n"] == 160 and len(generated) == 4
    # all but the last generated token are in the slot's KV
    assert third["timings"]["cache_n"] == 163 + 3


def test_serve_with_a_model_and_no_upstream_runs_embedded(tiny_model: Path, tmp_path: Path) -> None:
    settings = load_settings(managed={"model": tiny_model})
    assert chosen_backend(settings) == "embedded"
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cacheproxy",
                "serve",
                "--port",
                str(port),
                "-m",
                str(tiny_model),
                "-np",
                "2",
                "-c",
                "4096",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "CACHEPROXY_STATE_DIR": str(tmp_path / "state")},
        )
    try:
        wait_for_health(f"http://127.0.0.1:{port}")
        assert "in front of embedded" in log_path.read_text()
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_an_unknown_prompt_cache_policy_fails_at_start(tiny_model: Path) -> None:
    with pytest.raises(PluginError, match="known: llama-server, lru-trie, radix"):
        build_engine(EmbeddedSettings(prompt_cache="fifo", threads=1, ctx_size=512), tiny_model)


def test_auto_backend_needs_a_model_and_no_llama_server_binary(tiny_model: Path) -> None:
    assert chosen_backend(load_settings()) == "llama-server"  # the demo: a managed llama-server
    assert chosen_backend(load_settings(embedded={"model": tiny_model})) == "embedded"
    with_binary = load_settings(managed={"model": tiny_model, "binary": Path("llama-server")})
    assert chosen_backend(with_binary) == "llama-server"
    assert chosen_backend(load_settings(backend="embedded")) == "embedded"
    assert chosen_backend(
        load_settings(backend="llama-server", embedded={"model": tiny_model})
    ) == ("llama-server")


async def test_disk_tier_restores_an_evicted_conversation_on_the_embedded_engine(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """The proxy's disk tier drives the engine's slot save/restore as it drives llama-server's."""
    settings = load_settings(state_dir=tmp_path / "state", disk={"min_tokens": 128})
    # the engine's own RAM cache off: only the disk tier can bring a conversation back
    no_ram_cache = EmbeddedSettings(
        parallel=2, ctx_size=4096, threads=1, prompt_cache_options={"limit_bytes": 0}
    )
    engine_server = EmbeddedServer(
        no_ram_cache, tiny_model, tmp_path / "engine", settings.archive_directory()
    )

    async def complete(prompt: list[int]) -> dict:
        body = {"prompt": prompt, "n_predict": 4, "temperature": 0}
        async with client.post(url + "/completion", json=body) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    conversations = [
        [random.Random(seed).randrange(100, 30000) for _ in range(300)] for seed in range(3)
    ]
    async with serving(settings, managed=engine_server) as (url, app):
        for prompt in conversations:  # the third takes the first one's slot
            await complete(prompt)
        again = await complete([*conversations[0], 11, 12])
        restores = app[METRICS].registry.get_sample_value(
            "cacheproxy_archive_restores_total", {"outcome": "restored"}
        )
    assert again["timings"]["cache_n"] == 300  # the prompt restored, not prefilled
    assert restores == 1


async def test_tenants_are_served_by_the_engine_with_its_ram_cache_off(
    tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """What the refusal of an engine with a RAM cache says to do (its limit 0) serves tenants:
    the probe finds no cache, and a tenant's next turn reuses its own slot."""
    engine = EmbeddedServer(
        EmbeddedSettings(
            parallel=2, ctx_size=4096, threads=1, prompt_cache_options={"limit_bytes": 0}
        ),
        tiny_model,
        tmp_path / "engine",
    )
    await engine.start()
    try:
        async with serving_tenants(engine.base_url, tmp_path) as (proxy_url, registry):
            key = registry.create("alice")[1]
            await asyncio.sleep(2 * registry.refresh_interval_s)  # the proxy's view of it
            prompt = [random.Random(1).randrange(100, 30000) for _ in range(40)]
            answers = []
            for sent in (prompt, [*prompt, 7, 8]):
                body = {"prompt": sent, "n_predict": 2, "temperature": 0}
                headers = {"Authorization": f"Bearer {key}"}
                async with client.post(
                    proxy_url + "/completion", json=body, headers=headers
                ) as response:
                    assert response.status == 200, await response.text()
                    answers.append(await response.json())
    finally:
        await engine.stop()
    assert answers[1]["timings"]["cache_n"] >= len(prompt)  # its own text, reused
