"""A llama-server started with only what the proxy documents it needs (-np, /slots): no
--slot-save-path, so no slot actions (erase answers 501), and no --metrics."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import load_settings
from cacheproxy.upstreams.managed import free_port
from tests.support.servers import serving, wait_for_health


@pytest.fixture
def plain_server(llama_server_binary: Path, tiny_model: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    args = [str(llama_server_binary), "--model", str(tiny_model), "--port", str(port)]
    args += ["--host", "127.0.0.1", "-np", "2", "-c", "1024", "--threads", "1"]
    with open(tmp_path / "llama-server.log", "wb") as log:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_an_upstream_without_slot_actions_is_served_from_the_start(
    plain_server: str, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    settings = load_settings(upstreams=[plain_server], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        table = app[CACHE].tables[0]
        # the start-up probe erases its two slots afterwards; a server that cannot erase must
        # not make the proxy take it for a dead one (requests would get 502 until a re-check)
        assert table.healthy
        assert len(table.slots) == 2
        body = {"prompt": "Hello there", "n_predict": 2}
        async with client.post(url + "/completion", json=body) as response:
            assert response.status == 200, await response.text()
