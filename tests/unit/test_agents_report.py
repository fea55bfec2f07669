"""W5's figures written up: its own report and its section of `cacheproxy bench report`, from
figures built with the benchmark's own objects (so they have the real JSON shape)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from cacheproxy.bench.agents_bench import AgentsArmRun, AgentsBenchConfig, agents_as_json
from cacheproxy.bench.agents_client import TurnResult
from cacheproxy.bench.agents_report import render_markdown
from cacheproxy.bench.report import machine_figures
from cacheproxy.bench.report_figures import reading
from cacheproxy.bench.report_render import render_report

MACHINE = {
    "command": "cacheproxy bench agents",
    "cpu_count": 2,
    "load_average_at_start": [0.5, 0.25, 0.125],
    "platform": "Linux-test",
}


# One agent's three turns: the prompt grows by the 8-token answer plus 492, then plus 592, so
# an infinite cache would decode 1000 + 492 + 592 = 2084.
PROMPTS = (1000, 1500, 2100)
ORACLE = 2084


def arm(api: str, arm_name: str, decoded: list[int], wall_s: float) -> AgentsArmRun:
    turns = tuple(
        TurnResult(
            agent="agent-0",
            turn=index,
            answer="",
            prompt_tokens=prompt,
            cached_tokens=prompt - count,
            output_tokens=8,
            started_s=index / 10,
            ttft_s=0.05 * (index + 1),
            total_s=0.2,
        )
        for index, (prompt, count) in enumerate(zip(PROMPTS, decoded, strict=True))
    )
    proxy = arm_name == "proxy"
    return AgentsArmRun(
        api=api,
        arm=arm_name,
        turns=turns,
        wall_s=wall_s,
        server_cache_ram_mib=0 if proxy else 8192,
        llama_server_command=f"llama-server --port 9{len(api)} --cache-ram {0 if proxy else 8192}",
        proxy_command="python -m cacheproxy serve --upstream http://h:1 --port 2"
        if proxy
        else None,
        disk={"saves": 3, "save_bytes": 2**20, "save_s": 0.01, "restores": 1}
        | {"restore_bytes": 2**19, "restore_s": 0.005, "failed_restores": 0}
        if proxy
        else {},
        server_cpu_s=wall_s / 2,
        proxy_cpu_s=wall_s / 10 if proxy else None,
    )


def figures() -> dict[str, Any]:
    """Messages: the proxy decodes 1.02x in 0.9x the time (targets met); Responses: 3x in 2x."""
    runs = [
        arm("messages", "direct", [1000, 200, 300], 10.0),
        arm("messages", "proxy", [1000, 220, 290], 9.0),
        arm("responses", "proxy", [1000, 1000, 1000], 20.0),
        arm("responses", "direct", [1000, 0, 0], 10.0),
    ]
    agents = agents_as_json(AgentsBenchConfig(), runs, "tiny.gguf")
    return json.loads(json.dumps(agents))  # as read back from JSON


def test_table_ratios_and_verdicts() -> None:
    text = render_markdown(MACHINE, figures())
    # then llama-server's CPU and the proxy's (none for llama-server alone)
    assert (
        f"| messages | direct | 8192 | 3 | 4600 | 1500 | {ORACLE} | 0.72 | 10.0 | 5.0 | — |" in text
    )
    assert f"| messages | proxy | 0 | 3 | 4600 | 1510 | {ORACLE} | 0.72 | 9.0 | 4.5 | 0.9 |" in text
    # rows in API then arm order, whatever order the arms ran in
    assert text.index("| responses | direct |") < text.index("| responses | proxy |")
    assert "| messages | 1.007 | met | 0.900 | met |" in text
    assert "| responses | 3.000 | missed | 2.000 | missed |" in text
    assert "10 agents on 4 slots, 3-6 turns each" in text
    assert "disk tier: 3 saves (1.0 MiB" in text
    assert "--port <port>" in text and "(W5/messages/direct, W5/responses/direct)" in text


def test_reading_follows_the_numbers() -> None:
    sentences = " ".join(reading(machine_figures("x", (0, 0, 0)) | {"agents": figures()}))
    assert (
        "W5 over /v1/messages (anthropic SDK): the proxy decoded 1.01x the prompt tokens of"
        " llama-server alone (1510 vs 1500, target <= 1.05x: met) and took 0.90x its wall time"
    ) in sentences
    assert "(3000 vs 1000, target <= 1.05x: missed) and took 2.00x" in sentences


def test_bench_report_has_a_w5_section(tmp_path: Path) -> None:
    path = render_report(
        machine_figures("cacheproxy bench report", (0, 0, 0)) | {"agents": figures()}, tmp_path
    )
    text = path.read_text()
    assert "## W5 agents: 10 agents on 4 slots" in text
    assert "| responses | 3.000 | missed | 2.000 | missed |" in text
    assert "W5 over /v1/responses (openai SDK): the proxy decoded 3.00x" in text
    assert "(W5/messages/proxy, W5/responses/proxy)" in text
    assert json.loads((tmp_path / "figures.json").read_text())["agents"]["slots"] == 4
    assert "![W5: tokens decoded and wall time per API and arm](W5.png)" in text
    assert (tmp_path / "W5.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rounds_sum_and_show_each() -> None:
    """With --rounds, each round's ratio is shown and the verdict is over the sums of them all:
    a round over the target does not decide it, nor does one under."""
    rounds = [(10.0, 9.0), (10.0, 12.0), (10.0, 8.0)]  # (direct, proxy) wall per round
    runs = [
        dataclasses.replace(arm("messages", name, [1000, 200, 300], wall), round=index)
        for index, walls in enumerate(rounds)
        for name, wall in zip(("direct", "proxy"), walls, strict=True)
    ]
    config = AgentsBenchConfig(apis=("messages",), rounds=3)
    agents = json.loads(json.dumps(agents_as_json(config, runs, "tiny.gguf")))
    text = render_markdown(MACHINE, agents)
    assert "| messages, round 1 | 1.000 | met | 1.200 | missed |" in text
    assert "| messages, all rounds (sums) | 1.000 | met | 0.967 | met |" in text
    assert "| 2 | messages | proxy | 0 | 3 | 4600 | 1500 |" in text  # each run, its round first
    assert "took 0.97x its wall time (29.0 s vs 30.0 s over 3 rounds" in text
    assert "round by round 0.90, 1.20, 0.80x (2 of 3 at or under the target)" in text
    assert "- messages, proxy, round 2: disk tier: 3 saves" in text
