"""`cacheproxy bench overhead --upstream-tls`: the whole benchmark, at its smallest, against a
llama-server that serves https only (a certificate from a CA made for the run), so every arm
that completes a request reached it over https, checking its certificate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_arm_reaches_an_https_llama_server(tmp_path: Path) -> None:
    figures_path = tmp_path / "figures.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cacheproxy",
            "bench",
            "overhead",
            *("--requests", "2", "--duration", "0.3", "--rounds", "1", "--route-requests", "2"),
            *("--calibrate-us", "0", "--server-args", "", "--upstream-tls"),
            *("--json", str(figures_path)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(figures_path.read_text())
    assert figures["arms"]["direct"].startswith("https://")
    assert "--ssl-cert-file" in figures["llama_server_command"]
    # llama-server alone measured before the arms: its idle CPU and its time a token, over https
    assert figures["server_idle_cpu_ms"] >= 0 and figures["server_ms_per_token"] > 0
    for level in figures["throughput"].values():
        for arm in ("direct", "bare", "proxy"):
            # answered (an arm's failed request stops the run), and run by the server
            assert level["per_arm"][arm]["completed"] > 0
            assert level["per_arm"][arm]["server_decodes"] > 0
