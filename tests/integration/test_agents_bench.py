"""W5 end to end, tiny: `cacheproxy bench agents` and `cacheproxy bench report --workload W5` on
real llama-servers and a real proxy, driven by the real SDKs; the figures must be there for both
APIs and both arms, and plausible."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from cacheproxy.bench.agents_trace import AgentSpec, DrawRange, agent_trace

TINY = (
    "--agents 3 --slots 2 --turns 2 3 --system-words 100 200 --tool-output-lines 2 4"
    " --answer-tokens 8 --seed 4"
).split()
TINY_SPEC = AgentSpec(
    agents=3,
    turns=DrawRange(2, 3),
    system_words=DrawRange(100, 200),
    tool_output_lines=DrawRange(2, 4),
    answer_tokens=8,
)


def cacheproxy(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "cacheproxy", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def check_plausible(agents: dict[str, Any], turns_expected: int) -> None:
    runs = {(run["api"], run["arm"]): run for run in agents["runs"]}
    assert set(runs) == {
        (api, arm) for api in ("messages", "responses") for arm in ("direct", "proxy")
    }
    for (api, arm), run in runs.items():
        where = f"{api}/{arm}"
        assert run["requests"] == turns_expected, where
        assert 0 < run["tokens_decoded"] <= run["prompt_tokens"], where
        assert 0 < run["oracle_estimate"] <= run["prompt_tokens"], where
        assert run["wall_s"] > 0 and run["output_tokens"] > 0, where
        assert run["server_cache_ram_mib"] == (8192 if arm == "direct" else 0), where
        if arm == "proxy":  # a server without a RAM cache: no shadow of one
            assert "ram_cache_budget_bytes" not in run["disk_tier"], where
        assert (run["proxy_command"] is not None) == (arm == "proxy"), where
        by_agent: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for detail in run["requests_detail"]:
            # llama-server decodes at least one token of every prompt
            assert 0 < detail["decoded"] <= detail["prompt_tokens"], (where, detail)
            by_agent[detail["agent"]].append(detail)
        for agent, details in by_agent.items():
            prompts = [d["prompt_tokens"] for d in sorted(details, key=lambda d: d["turn"])]
            # each turn adds an answer, a tool call and its output
            assert prompts == sorted(set(prompts)), (where, agent, prompts)
    ratios = agents["proxy_over_direct"]
    assert set(ratios) == {"messages", "responses"}
    assert all(r["tokens_decoded"] > 0 and r["wall_time"] > 0 for r in ratios.values())


@pytest.mark.timeout(300)
def test_bench_agents_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "w5.json"
    done = cacheproxy("bench", "agents", *TINY, "--json", str(json_path), timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(json_path.read_text())
    expected = sum(agent.turns for agent in agent_trace(TINY_SPEC, 4))
    check_plausible(figures["agents"], expected)
    report = done.stdout
    for api in ("messages", "responses"):
        for arm in ("direct", "proxy"):
            assert f"| {api} | {arm} |" in report
    assert "Proxy / direct (targets: wall time <= 1.0x, tokens decoded <= 1.05x)" in report
    assert "W5 over /v1/messages (anthropic SDK): the proxy decoded" in report
    assert "python -m cacheproxy bench agents --agents 3" in report
    # the SDKs' first use is over before any arm is timed
    warmed = [done.stderr.index(f"W5 warm-up over /v1/{api}") for api in ("messages", "responses")]
    assert max(warmed) < done.stderr.index("W5-messages-direct: 3 agents over")


@pytest.mark.timeout(300)
def test_bench_report_runs_w5(tmp_path: Path) -> None:
    out_dir = tmp_path / "report"
    args = ("bench", "report", "--out", str(out_dir), "--workload", "W5", "--scale", "0.1")
    done = cacheproxy(*args, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[bench] part 1/1: W5 agents, 2 agents on 1 slots" in done.stderr
    figures = json.loads((out_dir / "figures.json").read_text())
    scaled = AgentSpec().scaled(0.1)
    check_plausible(figures["agents"], sum(agent.turns for agent in agent_trace(scaled, 1)))
    report = (out_dir / "report.md").read_text()
    assert "## W5 agents: 2 agents on 1 slots" in report
    assert "(W5.png)" in report and (out_dir / "W5.png").is_file()
    assert "W5 over /v1/responses (openai SDK): the proxy decoded" in report


@pytest.mark.timeout(300)
def test_bench_agents_rounds(tmp_path: Path) -> None:
    """`--rounds 2`: each arm twice, the first arm alternating, the ratio over the sums."""
    json_path = tmp_path / "w5.json"
    args = ("bench", "agents", *TINY, "--api", "messages", "--rounds", "2")
    done = cacheproxy(*args, "--json", str(json_path), timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    agents = json.loads(json_path.read_text())["agents"]
    runs = agents["runs"]
    assert [(run["round"], run["arm"]) for run in runs] == [
        (0, "direct"),
        (0, "proxy"),
        (1, "proxy"),
        (1, "direct"),
    ]
    walls = {(run["round"], run["arm"]): run["wall_s"] for run in runs}
    by_round = agents["proxy_over_direct_by_round"]["messages"]
    for index, ratios in enumerate(by_round):
        assert ratios["wall_time"] == pytest.approx(walls[index, "proxy"] / walls[index, "direct"])
    total = agents["proxy_over_direct"]["messages"]["wall_time"]
    assert total == pytest.approx(
        (walls[0, "proxy"] + walls[1, "proxy"]) / (walls[0, "direct"] + walls[1, "direct"])
    )
    assert "| messages, all rounds (sums) |" in done.stdout
    assert "over 2 rounds" in done.stdout


@pytest.mark.timeout(300)
def test_bench_agents_in_front_of_a_servers_ram_cache(tmp_path: Path) -> None:
    """`--proxy-cache-ram 64`: the proxy arm's llama-server keeps a RAM cache (single-user, as
    `llama-server -m` starts); the report says so, and gives that cache as the proxy follows it:
    the budget its shadow holds (the 8192 MiB it starts from, learnt down only by a surprise)
    and how much of it the server has shown it keeps."""
    json_path = tmp_path / "w5.json"
    args = ("bench", "agents", *TINY, "--api", "messages", "--arms", "proxy")
    done = cacheproxy(*args, "--proxy-cache-ram", "64", "--json", str(json_path), timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = json.loads(json_path.read_text())["agents"]["runs"]
    assert run["server_cache_ram_mib"] == 64
    assert "--cache-ram 64 " in run["llama_server_command"]
    disk = run["disk_tier"]
    assert disk["ram_cache_budget_bytes"] > 0 and disk["ram_cache_shown_bytes"] >= 0, disk
    assert "proxy with `--cache-ram 64` behind `cacheproxy serve`" in done.stdout
    assert "the server's RAM cache followed at a budget of" in done.stdout
