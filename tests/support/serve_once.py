"""`cacheproxy serve` started once as a process of its own, to see whether it refuses to start:
a refusal must be one line on stderr, a non-zero exit, no traceback, and nothing ever served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cacheproxy.upstreams.managed import free_port
from tests.support.servers import http_status

START_TIMEOUT_S = 30.0


@dataclass
class Started:
    exit_code: int | None  # None: it was serving (stopped by the test afterwards)
    stderr: str
    keyless_status: int | None  # what a request without a key got while it served


def serve_once(
    state_dir: Path,
    upstream: str | None,
    *flags: str,
    port: int | None = None,
    command: str = "serve",
    **env: str,
) -> Started:
    """Start `cacheproxy serve` (with `--upstream`, unless None); if it comes up, send one
    request without a key, then stop it. `command` "check-config" runs that instead."""
    port = port or free_port()
    environment = {**os.environ, "CACHEPROXY_STATE_DIR": str(state_dir), **env}
    arguments = [sys.executable, "-m", "cacheproxy", command, "--port", str(port), *flags]
    if upstream is not None:
        arguments += ["--upstream", upstream]
    process = subprocess.Popen(
        arguments, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    keyless = None
    deadline = time.monotonic() + START_TIMEOUT_S
    while command == "serve" and process.poll() is None and time.monotonic() < deadline:
        if http_status(url + "/health") == 200:
            keyless = _post_status(url + "/completion", {"prompt": "hello", "n_predict": 1})
            break
        time.sleep(0.05)
    if process.poll() is None and command == "serve":
        process.terminate()
        _, stderr = process.communicate(timeout=30)
        return Started(None, stderr, keyless)
    _, stderr = process.communicate(timeout=60)
    return Started(process.returncode, stderr, keyless)


def _post_status(url: str, body: dict) -> int:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def assert_refused(started: Started, naming: str, exit_code: int | None = None) -> None:
    """Refused to start: one line on stderr naming `naming`, no traceback, nothing served."""
    assert started.exit_code not in (None, 0), f"it served: {started}"
    if exit_code is not None:
        assert started.exit_code == exit_code, started
    assert started.keyless_status is None
    lines = started.stderr.strip().splitlines()
    assert len(lines) == 1, started.stderr
    assert naming in lines[0], lines[0]
    assert "Traceback" not in started.stderr and "listening" not in started.stderr


def assert_refused_naming(started: Started, path: Path) -> None:
    assert_refused(started, str(path))
