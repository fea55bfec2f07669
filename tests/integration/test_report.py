"""`cacheproxy bench report`: rendering from synthetic figures, and one tiny run end to end.

The synthetic figures are built from the cache benchmark's own objects and `report_as_json`, so
they have the real JSON shape; the rendering must then say what the numbers say.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cacheproxy.bench.cache_client import ArmRun, Completion
from cacheproxy.bench.cache_config import CacheBenchConfig
from cacheproxy.bench.cache_report import CacheReport, report_as_json
from cacheproxy.bench.isolation import Trial, ks_two_sample
from cacheproxy.bench.report import isolation_as_json, run_from_options
from cacheproxy.bench.report_figures import reading
from cacheproxy.bench.report_render import render_report
from cacheproxy.bench.workloads import Request

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")
PREFIX = tuple(range(1000, 1100))  # 100 tokens every prompt of a run shares
REQUESTS = 8
# Each request's prompt is PREFIX + 10 tokens of its own: the oracle decodes 110 + 7 * 10 = 180.
ORACLE = 180
# What each arm decodes: "wasteful" misses the prefix half of the time, "thrifty" only once.
WASTEFUL = [110, 110, 10, 110, 10, 110, 10, 110]  # 580
THRIFTY = [110, 10, 10, 10, 10, 10, 10, 10]  # 180


def completion(index: int, prompt_n: int, ttft_ms: float) -> Completion:
    question = tuple(range(5000 + 10 * index, 5010 + 10 * index))
    prompt = PREFIX + question
    return Completion(
        request=Request(prompt=prompt, n_predict=2, tenant="tenant-0", conversation=f"c{index}"),
        issue_index=index,
        output=(7, 8),
        prompt_n=prompt_n,
        cache_n=len(prompt) - prompt_n,
        ttft_s=ttft_ms / 1000,
        total_s=ttft_ms / 1000 + 0.05,
    )


def arm_run(workload: str, cache_ram_mib: int, arm: str, decoded: list[int], slow: bool) -> ArmRun:
    rng = random.Random(f"{workload}{cache_ram_mib}{arm}")
    ttfts = [(400 if slow else 40) * rng.uniform(0.8, 1.5) for _ in decoded]
    return ArmRun(
        workload=workload,
        cache_ram_mib=cache_ram_mib,
        arm=arm,
        completions=tuple(map(completion, range(len(decoded)), decoded, ttfts)),
        wall_s=20.0 if slow else 10.0,
        restarts=0,
        llama_server_command=f"llama-server --port 81{len(arm)} --cache-ram {cache_ram_mib}",
        proxy_command="python -m cacheproxy serve --upstream http://h:1 --port 2"
        if arm == "proxy"
        else None,
        server_cache_ram_mib=cache_ram_mib,
    )


def trials(count: int, ttft_ms: float, cache_n: int, seed: int) -> list[Trial]:
    rng = random.Random(seed)
    return [Trial("", ttft_ms * rng.uniform(0.9, 1.1), cache_n) for _ in range(count)]


def synthetic_figures(*, proxy_thrifty: bool = True, leak: bool = False) -> dict[str, Any]:
    """W1 and W2 at cache-ram 0 and 8192, the proxy decoding less (or, swapped, more), and W4."""
    proxy_decoded, direct_decoded = (THRIFTY, WASTEFUL) if proxy_thrifty else (WASTEFUL, THRIFTY)
    runs = [
        arm_run(workload, cache_ram_mib, arm, decoded, slow=decoded is WASTEFUL)
        for workload in ("W1", "W2")
        for cache_ram_mib in (0, 8192)
        for arm, decoded in (("direct", direct_decoded), ("proxy", proxy_decoded))
    ]
    report = CacheReport(
        command="cacheproxy bench report --out /tmp/x",
        cpu_count=2,
        load_average=(0.5, 0.25, 0.125),
        platform="Linux-test",
        model="tiny.gguf",
        config=CacheBenchConfig(workloads=("W1", "W2"), cache_ram_mib=(0, 8192)),
        runs=runs,
    )
    results = {
        "primed": trials(40, 8 if leak else 70, 1024 if leak else 0, seed=1),
        "cold": trials(40, 70, 0, seed=2),
        "self-primed": trials(10, 8, 1024, seed=3),
    }
    figures = report_as_json(report) | {
        "isolation": isolation_as_json(
            results,
            trials=40,
            seed=1,
            model="tiny.gguf",
            llama_server_command="llama-server --port 9 --parallel 1",
            proxy_command="python -m cacheproxy serve --upstream http://h:9 --port 10",
        )
    }
    return json.loads(json.dumps(figures))  # as read back from figures.json: lists, no tuples


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR", f"{path.name} has no IHDR first"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def check_report_folder(out_dir: Path) -> str:
    """report.md links every PNG in the folder (relatively), each a sensible image; its text."""
    report = (out_dir / "report.md").read_text()
    links = IMAGE_LINK.findall(report)
    assert links, "no image in the report"
    assert all(not link.startswith(("/", "http")) for link in links)
    assert sorted(links) == sorted(path.name for path in out_dir.glob("*.png"))
    for link in links:
        width, height = png_size(out_dir / link)
        assert 400 <= width <= 3000 and 250 <= height <= 2000, (link, width, height)
    return report


def test_report_links_every_plot(tmp_path: Path) -> None:
    path = render_report(synthetic_figures(), tmp_path)
    assert path == tmp_path / "report.md"
    check_report_folder(tmp_path)
    names = {png.name for png in tmp_path.glob("*.png")}
    assert names == {
        "W1-decoded.png",
        "W1-ttft.png",
        "W2-decoded.png",
        "W2-ttft.png",
        "W4-ttft.png",
    }
    assert json.loads((tmp_path / "figures.json").read_text())["runs"][0]["workload"] == "W1"


def test_tables_show_the_input_figures(tmp_path: Path) -> None:
    figures = synthetic_figures()
    report = render_report(figures, tmp_path).read_text()
    direct = next(r for r in figures["runs"] if r["arm"] == "direct" and r["workload"] == "W1")
    assert direct["oracle"] == ORACLE and direct["tokens_decoded"] == sum(WASTEFUL)
    row = (
        f"| 0 | direct | {REQUESTS} | 880 | {sum(WASTEFUL)} | {ORACLE} |"
        f" {sum(WASTEFUL) / ORACLE:.2f} | 20.0 | {direct['ttft_p50_ms']:.0f} |"
    )
    assert row in report
    assert f"| 0 | {sum(THRIFTY) / sum(WASTEFUL):.3f} | 0.500 |" in report  # proxy/direct
    isolation = figures["isolation"]["trials"]
    distance, p_value = ks_two_sample(
        [t["ttft_ms"] for t in isolation["primed"]], [t["ttft_ms"] for t in isolation["cold"]]
    )
    assert f"| another tenant primed vs nobody | {distance:.3f} | {p_value:.3g} |" in report
    assert "`cacheproxy bench report --out /tmp/x`" in report
    assert "2 CPUs" in report and "0.50, 0.25, 0.12" in report
    assert "--port <port>" in report  # the commands, ports as placeholders


def test_reading_follows_the_numbers(tmp_path: Path) -> None:
    thrifty = render_report(synthetic_figures(), tmp_path / "a").read_text()
    wasteful = render_report(synthetic_figures(proxy_thrifty=False), tmp_path / "b").read_text()
    fewer = sum(THRIFTY) / sum(WASTEFUL)
    assert (
        f"W1 at cache-ram 0: the proxy decoded {fewer:.2f}x the tokens of llama-server alone"
        f" (fewer: {sum(THRIFTY)} vs {sum(WASTEFUL)})" in thrifty
    )
    assert (
        f"W1 at cache-ram 0: the proxy decoded {1 / fewer:.2f}x the tokens of llama-server"
        f" alone (more: {sum(WASTEFUL)} vs {sum(THRIFTY)})" in wasteful
    )
    assert "fewer prompt tokens than llama-server alone in 4, more in 0" in thrifty
    assert "fewer prompt tokens than llama-server alone in 0, more in 4" in wasteful


def test_reading_of_the_isolation_audit() -> None:
    held = " ".join(reading(synthetic_figures()))
    assert "cannot be told apart" in held and "does see a real cache hit" in held
    leaked = " ".join(reading(synthetic_figures(leak=True)))
    assert "DIFFER" in leaked and "cannot be told apart" not in leaked


def test_options_that_cannot_run_exit_2(tmp_path: Path) -> None:
    common: dict[str, Any] = dict(
        out_dir=tmp_path, cache_ram_mib=[0], size="small", seed=1, server_args=""
    )
    assert run_from_options(workloads=["W4"], trials=2, scale=1.0, **common) == 2
    assert run_from_options(workloads=["W1"], trials=200, scale=0.0, **common) == 2
    assert run_from_options(workloads=["W2"], trials=200, scale=5.0, **common) == 2  # too long
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(180)
def test_end_to_end_tiny(tmp_path: Path) -> None:
    """W1 scaled down and a short W4, cache-ram 0, both arms, on real llama-servers."""
    out_dir = tmp_path / "report"
    options = "--workload W1 W4 --cache-ram 0 --trials 12 --scale 0.25".split()
    command = [
        sys.executable,
        "-m",
        "cacheproxy",
        "bench",
        "report",
        "--out",
        str(out_dir),
        *options,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[bench] part 1/2" in done.stderr and "[bench] part 2/2" in done.stderr
    assert done.stdout.strip() == str(out_dir / "report.md")
    report = check_report_folder(out_dir)
    assert {png.name for png in out_dir.glob("*.png")} == {
        "W1-decoded.png",
        "W1-ttft.png",
        "W4-ttft.png",
    }
    figures = json.loads((out_dir / "figures.json").read_text())
    assert {run["arm"] for run in figures["runs"]} == {"direct", "proxy"}
    assert figures["config"]["shared_prefix"]["prefix_tokens"] == 256  # 1024 x 0.25
    assert len(figures["isolation"]["trials"]["cold"]) == 12
    assert "--workload W1 W4 --cache-ram 0 --trials 12 --scale 0.25" in report
    assert "W1 at cache-ram 0: the proxy decoded" in report
