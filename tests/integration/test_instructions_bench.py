"""`cacheproxy bench instructions`: fronts run under callgrind in front of a real llama-server,
their instructions counted per request (valgrind installed by the test bed where missing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cacheproxy.bench.instructions import FRONT_NAMES
from cacheproxy.bench.overhead_routes import ROUTES
from cacheproxy.cli import bench_instructions


def test_the_command_line_offers_every_front_and_route() -> None:
    # the command line names them without importing the benchmark
    assert bench_instructions.FRONT_NAMES == FRONT_NAMES
    assert bench_instructions.ROUTE_NAMES == tuple(ROUTES)


def test_a_proxy_counts_more_than_a_relay_and_less_without_its_limits(tmp_path: Path) -> None:
    """Also the proxy's Python bytecodes by file and function (bytecodes.py)."""
    figures_path = tmp_path / "figures.json"
    run = subprocess.run(
        [
            *(sys.executable, "-m", "cacheproxy", "bench", "instructions"),
            *("--requests", "6", "--warmup", "20", "--routes", "/completion"),
            *("--arms", "bare", "proxy", "no-limits", "--bytecodes", "5"),
            *("--json", str(figures_path)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| /completion |" in run.stdout
    figures = json.loads(figures_path.read_text())
    counted = figures["instructions_per_request"]["/completion"]
    assert set(counted) == {"bare", "proxy", "no-limits"}
    # each front was counted while it served the requests (a window that missed them would
    # count only an idle loop), and the proxy's own work shows over the relay's
    assert counted["bare"] > 100_000
    assert counted["proxy"] > 1.2 * counted["bare"]
    # the front's environment took effect: metering five limits a request costs instructions
    assert counted["no-limits"] < counted["proxy"]
    for windows in figures["windows"]["/completion"].values():
        assert 2 <= len(windows) and all(count > 0 for count in windows)
    # the proxy's main thread, traced between the signals: its request path is counted, by
    # the files and functions it runs in
    bytecodes = figures["bytecodes"]["/completion"]
    assert bytecodes["total"] > 1000
    assert bytecodes["files"]["cacheproxy/slots/scheduler.py"] > 0
    assert len(bytecodes["functions"]) == 5
    top = bytecodes["functions"][0]
    assert top["bytecodes"] > 0 and top["calls"] > 0 and top["file"] in bytecodes["files"]
