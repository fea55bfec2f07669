"""`cacheproxy serve` as a real process: managed llama-server, restart after a crash, clean stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cacheproxy.upstreams.managed import free_port
from tests.support.servers import LlamaServer, child_pids, http_status, wait_for_health
from tests.support.waiting import wait_for_sync

PROMPT_IDS = [1, 450, 4996, 17354]
Serve = Callable[..., tuple[subprocess.Popen[str], str, Path]]


def complete(base_url: str) -> dict:
    body = json.dumps({"prompt": PROMPT_IDS, "n_predict": 2}).encode()
    request = urllib.request.Request(base_url + "/completion", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Start `cacheproxy serve` with the given flags; stopped (and checked) at the end."""
    processes: list[subprocess.Popen[str]] = []

    def start(*flags: str, healthy: bool = True) -> tuple[subprocess.Popen[str], str, Path]:
        port = free_port()
        log_path = tmp_path / f"serve-{port}.log"
        env = {**os.environ, "CACHEPROXY_STATE_DIR": str(tmp_path / "state")}
        with open(log_path, "w") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "cacheproxy", "serve", "--port", str(port), *flags],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
        processes.append(process)
        base_url = f"http://127.0.0.1:{port}"
        if healthy:
            wait_for_health(base_url)
        else:  # listening, whatever its health says
            wait_for_sync(lambda: http_status(base_url + "/health") is not None, "the proxy")
        return process, base_url, log_path

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_managed_server_is_restarted_after_a_crash_and_stopped_with_the_proxy(
    serve: Serve,
    llama_server_binary: Path,
    tiny_model: Path,
) -> None:
    process, base_url, log_path = serve(
        "--llama-server", str(llama_server_binary), "-m", str(tiny_model), "-np", "2", "-c", "4096"
    )
    assert complete(base_url)["tokens_predicted"] == 2
    (server_pid,) = child_pids(process.pid)

    os.kill(server_pid, signal.SIGKILL)
    wait_for_sync(
        lambda: http_status(base_url + "/health") != 200, "the crash to show", within_s=10
    )
    wait_for_sync(lambda: http_status(base_url + "/health") == 200, "the restart", within_s=60)
    (restarted_pid,) = child_pids(process.pid)
    assert restarted_pid != server_pid
    assert complete(base_url)["tokens_predicted"] == 2

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert _has_exited(restarted_pid)
    assert "restarting" in log_path.read_text()


def test_a_managed_server_on_a_unix_socket_is_restarted_over_the_socket_its_crash_left(
    serve: Serve,
    llama_server_binary: Path,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`managed.host` a socket's path, as llama-server's --host takes one: the proxy reaches it
    there; killed, it leaves its socket file behind (llama-server never removes it, and cannot
    bind over it), which the restart replaces; stopped with the proxy, the file goes too."""
    socket_path = tmp_path / "llama.sock"
    monkeypatch.setenv("CACHEPROXY_MANAGED__HOST", str(socket_path))
    process, base_url, log_path = serve(
        "--llama-server", str(llama_server_binary), "-m", str(tiny_model), "-np", "2", "-c", "4096"
    )
    assert complete(base_url)["tokens_predicted"] == 2
    assert socket_path.is_socket()
    assert f"unix://{socket_path}" in log_path.read_text()  # the address it is reached at
    (server_pid,) = child_pids(process.pid)

    os.kill(server_pid, signal.SIGKILL)
    wait_for_sync(
        lambda: http_status(base_url + "/health") != 200, "the crash to show", within_s=10
    )
    wait_for_sync(lambda: http_status(base_url + "/health") == 200, "the restart", within_s=60)
    assert complete(base_url)["tokens_predicted"] == 2

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert not socket_path.exists()


def test_managed_server_does_not_outlive_a_killed_proxy(
    serve: Serve,
    llama_server_binary: Path,
    tiny_model: Path,
) -> None:
    process, _, _ = serve(
        "--llama-server", str(llama_server_binary), "-m", str(tiny_model), "-c", "4096"
    )
    (server_pid,) = child_pids(process.pid)
    process.kill()
    process.wait()
    wait_for_sync(lambda: _has_exited(server_pid), "the orphaned llama-server to exit", within_s=15)


def _has_exited(pid: int) -> bool:
    """Gone, or a zombie waiting for a parent that is itself gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_serve_with_nothing_given_runs_the_demo(serve: Serve) -> None:
    """The README's main command: no upstream, no binary, no model -> the test-bed build and the
    demo model, and the log says so."""
    process, base_url, log_path = serve()
    assert complete(base_url)["tokens_predicted"] == 2
    log_text = log_path.read_text()
    assert "demo model" in log_text
    assert "pinned test-bed build" in log_text
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def chat_as(base_url: str, key: str) -> tuple[int, dict]:
    body = json.dumps({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
    request = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=body.encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_serve_with_nothing_given_serves_tenants(serve: Serve, tmp_path: Path) -> None:
    """The main command with a tenant: the managed llama-server starts with its RAM cache off
    (the disk tier does that cache's work, and one cache shared by all slots would be refused
    while tenants exist), so the tenant is served. A RAM cache asked for is started as asked,
    and a tenant is then refused with the setting that turns it off."""
    env = {**os.environ, "CACHEPROXY_STATE_DIR": str(tmp_path / "state")}
    created = subprocess.run(
        [sys.executable, "-m", "cacheproxy", "tenants", "create", "alice"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    key = json.loads(created.stdout[created.stdout.index("{") :])["api_key"]
    _, base_url, log_path = serve()
    status, answer = chat_as(base_url, key)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 2
    assert "--cache-ram 0 " in log_path.read_text()

    _, base_url, log_path = serve("--cache-ram", "64", healthy=False)
    # refused as soon as its start-up probe has found the cache (its health says so too)
    wait_for_sync(lambda: http_status(base_url + "/health") == 503, "the RAM cache found")
    status, answer = chat_as(base_url, key)
    assert "--cache-ram 64 " in log_path.read_text()
    assert status == 503, answer
    assert "managed.cache_ram_mib = 0" in answer["error"]["message"]


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
def test_serve_runs_on_the_event_loop_chosen_and_stops_on_sigterm(
    serve: Serve, llama_server: LlamaServer, monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    """uvloop by default (it is installed with the proxy), asyncio's loop when asked for; either
    way requests are answered and SIGTERM stops the proxy cleanly."""
    monkeypatch.setenv("CACHEPROXY_EVENT_LOOP", choice)
    process, base_url, log_path = serve("--upstream", llama_server.url)
    assert complete(base_url)["tokens_predicted"] == 2
    expected = "uvloop" if choice == "auto" else "asyncio"
    assert f"(event loop: {expected})" in log_path.read_text()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def test_serve_keeps_what_its_start_made_out_of_garbage_collection(
    serve: Serve, llama_server: LlamaServer
) -> None:
    """Once listening, the objects the start made (modules, settings, the app: tens of
    thousands) are frozen out of the garbage collector's passes, so that a full collection while
    requests run walks only what they made since."""
    _, base_url, log_path = serve("--upstream", llama_server.url, "--log-level", "debug")
    assert complete(base_url)["tokens_predicted"] == 2
    found = re.search(r"(\d+) objects made at start kept out of garbage", log_path.read_text())
    assert found is not None
    assert int(found.group(1)) > 10_000


def test_serve_listens_on_every_address_of_a_comma_separated_host(
    serve: Serve, llama_server: LlamaServer
) -> None:
    # llama-server's --host takes "127.0.0.1,::1"; the proxy takes the same value
    _, base_url, _ = serve("--host", "127.0.0.1,::1", "--upstream", llama_server.url)
    port = base_url.rsplit(":", 1)[1]
    assert http_status(f"http://127.0.0.1:{port}/health") == 200
    assert http_status(f"http://[::1]:{port}/health") == 200
