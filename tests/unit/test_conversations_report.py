"""The conversations benchmark's figures written up, from figures built with the benchmark's own
objects (so they have the real JSON shape): ratios within each round and over all of them, the
verdicts, the proxy's mispredictions, and a reading that says when the arms' prompts differ."""

from __future__ import annotations

import json
from typing import Any

from cacheproxy.bench.conversations_bench import (
    ConversationsArmRun,
    ConversationsBenchConfig,
    conversations_as_json,
)
from cacheproxy.bench.conversations_client import ChatResult
from cacheproxy.bench.conversations_corpus import RecordedConversation
from cacheproxy.bench.conversations_report import render_markdown
from cacheproxy.bench.conversations_trace import ConversationsSpec, ConversationsTrace

MACHINE = {
    "command": "cacheproxy bench conversations",
    "cpu_count": 2,
    "load_average_at_start": [0.5, 0.25, 0.125],
    "platform": "Linux-test",
}
TRACE = ConversationsTrace(
    system="one two three",
    conversations=(
        RecordedConversation("english/greetings/0", "english", ("Hi", "Hello", "How are you?")),
        RecordedConversation("spanish/saludos/3", "spanish", ("Hola", "Hola", "¿Qué tal?", "Bien")),
    ),
)
# every run: four requests, 100 + 200 + 100 + 200 = 600 prompt tokens
PROMPTS = ((TRACE.conversations[0].name, 0, 100), (TRACE.conversations[0].name, 1, 200))
PROMPTS += ((TRACE.conversations[1].name, 0, 100), (TRACE.conversations[1].name, 1, 200))


def arm(
    round_index: int, name: str, decoded: int, wall_s: float, extra: int = 0
) -> ConversationsArmRun:
    """A run decoding `decoded` of its 600 prompt tokens (+`extra` in its last prompt)."""
    per_request = [decoded // 4] * 3 + [decoded - 3 * (decoded // 4)]
    results = tuple(
        ChatResult(
            conversation=conversation,
            turn=turn,
            prompt_n=count,
            cache_n=prompt - count + (extra if index == 3 else 0),
            output_tokens=16,
            started_s=index / 10,
            latency_s=0.1 * (index + 1),
        )
        for index, ((conversation, turn, prompt), count) in enumerate(
            zip(PROMPTS, per_request, strict=True)
        )
    )
    proxy = name == "proxy"
    counters = (
        {
            "saves": 3,
            "save_bytes": 2**20,
            "save_s": 0.01,
            "restores": 1,
            "restore_bytes": 2**19,
            "restore_s": 0.005,
            "failed_restores": 0,
            'predictions_total{result="match"}': 3.0,
            'predictions_total{result="mismatch"}': 1.0,
        }
        if proxy
        else {}
    )
    return ConversationsArmRun(
        round=round_index,
        arm=name,
        results=results,
        wall_s=wall_s,
        server_cache_ram_mib=0 if proxy else 8192,
        llama_server_command=f"llama-server --port 9 --cache-ram {0 if proxy else 8192}",
        proxy_command="python -m cacheproxy serve --upstream http://h:1 --port 2"
        if proxy
        else None,
        counters=counters,
        server_cpu_s=wall_s / 2,
        proxy_cpu_s=wall_s / 10 if proxy else None,
    )


def figures(runs: list[ConversationsArmRun]) -> dict[str, Any]:
    config = ConversationsBenchConfig(spec=ConversationsSpec(conversations=5), rounds=2)
    found = conversations_as_json(config, TRACE, runs, "tiny.gguf")
    return json.loads(json.dumps(found))  # as read back from JSON


def test_table_ratios_by_round_and_over_all_rounds() -> None:
    runs = [
        arm(0, "direct", 400, 10.0),
        arm(0, "proxy", 200, 9.0),  # round 0: 0.5x decoded, 0.9x wall
        arm(1, "proxy", 440, 13.0),  # round 1 (the proxy first): 1.1x decoded, 1.3x wall
        arm(1, "direct", 400, 10.0),
    ]
    text = render_markdown(MACHINE, figures(runs))
    # CPU: llama-server's, then the proxy's (none for llama-server alone)
    assert (
        "| 0 | direct | 8192 | 4 | 600 | 400 | 1.000 | 10.0 | 1.000 | 5.0 | — | 250 | 370 | — |"
        in text
    )
    assert (
        "| 0 | proxy | 0 | 4 | 600 | 200 | 0.500 | 9.0 | 0.900 | 4.5 | 0.9 | 250 | 370 | 1 |"
        in text
    )
    assert (
        "| 1 | proxy | 0 | 4 | 600 | 440 | 1.100 | 13.0 | 1.300 | 6.5 | 1.3 | 250 | 370 | 1 |"
        in text
    )
    assert "| 0 | 0.500 | met | 0.900 | met |" in text
    assert "| 1 | 1.100 | missed | 1.300 | missed |" in text
    assert "| all (sums) | 0.800 | met | 1.100 | missed |" in text
    assert "2 recorded conversations (english, spanish), 4 requests" in text
    assert "behind one system prompt of 3 words, on 4 slots with 4 clients" in text
    assert "Every run sent the same 4 requests, 600 prompt tokens in all." in text
    assert (
        "The proxy over 2 rounds decoded 0.800x the prompt tokens of llama-server alone"
        " (640 vs 800, target <= 1.05x: met) and took 1.100x its wall time (22.0 s vs 20.0 s,"
        " target <= 1.0x: missed)."
    ) in text
    assert 'result="match" 3, result="mismatch" 1' in text
    assert "disk tier: 3 saves (1.0 MiB" in text
    assert "(round 0/proxy, round 1/proxy)" in text and "--port <port>" in text


def test_the_reading_says_when_the_arms_prompts_differ() -> None:
    runs = [arm(0, "direct", 400, 10.0), arm(0, "proxy", 400, 10.0, extra=5)]
    text = render_markdown(MACHINE, figures(runs))
    assert "The runs' prompts differ (prompt tokens: direct 600, proxy 605)" in text
    assert "Every run sent the same" not in text


def test_one_arm_alone_has_no_ratios() -> None:
    text = render_markdown(MACHINE, figures([arm(0, "direct", 400, 10.0)]))
    assert "Proxy / direct" not in text and "The proxy" not in text
    assert "| 0 | direct | 8192 | 4 | 600 | 400 | 1.000 |" in text
