"""The upstream monitor outlives a real fault in one of its rounds.

The archive folder turns read-only (a read-only bind mount: permission bits do not stop root)
while the disk tier is on, and the llama-server restarts: re-attaching the disk tier fails
inside the monitor's round. The proxy must go on serving, notice a later restart, and still
drain and exit 0 on SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from cacheproxy.upstreams.managed import free_port
from tests.support.servers import LlamaServer, StartServer, wait_for_health
from tests.support.waiting import wait_for_sync


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def complete(base_url: str, prompt: list[int]) -> int:
    body = json.dumps({"prompt": prompt, "n_predict": 2}).encode()
    request = urllib.request.Request(base_url + "/completion", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


def restart(start_server: StartServer, server: LlamaServer, log: Callable[[], str]) -> LlamaServer:
    downs = log().count("is down")
    server.kill()
    wait_for_sync(lambda: log().count("is down") > downs, "the proxy to see the upstream go")
    return start_server(ctx_size=4096, port=server.port)


def test_a_fault_in_a_monitor_round_does_not_stop_the_monitor(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(ctx_size=4096)
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {
        **os.environ,
        "CACHEPROXY_STATE_DIR": str(tmp_path / "state"),
        "CACHEPROXY_DISK__DIRECTORY": str(server.slot_save_path),
        "CACHEPROXY_ROUTING__HEALTH_INTERVAL_S": "0.2",
    }
    with open(log_path, "wb") as log_file:
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cacheproxy",
                "serve",
                "--upstream",
                server.url,
                "--port",
                str(port),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def log() -> str:
        return log_path.read_text(errors="replace")

    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url)
        assert "disk tier on" in log()
        with read_only(server.slot_save_path):
            server = restart(start_server, server, log)
            wait_for_sync(lambda: log().count("table rebuilt") >= 1, "the table to be rebuilt")
            # the disk tier turns itself off for the folder; the monitor goes on
            assert "disk tier off" in log()
            assert complete(url, [5, 6, 7, 8]) == 200
        server = restart(start_server, server, log)  # noticed: the monitor still runs
        wait_for_sync(lambda: log().count("table rebuilt") >= 2, "the second rebuild")
        assert complete(url, [5, 6, 7, 9]) == 200
        proxy.send_signal(signal.SIGTERM)
        assert proxy.wait(timeout=30) == 0, log()
        assert "drain:" in log()
        assert "Traceback" not in log()
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
