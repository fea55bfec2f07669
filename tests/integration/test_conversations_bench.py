"""`cacheproxy bench conversations` end to end, tiny: recorded chats replayed on real
llama-servers, one alone and one behind a real proxy. Both arms must have sent the same prompts
(request for request, as the servers counted their tokens), every conversation's prompts must
grow turn by turn, and no request after each slot's first may decode the shared system prompt
again (the slot kept it: the server alone by itself, the proxy by what it restores or leaves)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cacheproxy.bench.conversations_bench import build_trace
from cacheproxy.bench.conversations_trace import ConversationsSpec

SLOTS = 2
SYSTEM_WORDS = 200  # at least as many tokens, the opening's words aside
TINY = (
    f"--conversations 5 --slots {SLOTS} --clients 2 --system-words {SYSTEM_WORDS}"
    " --answer-tokens 4 --languages english spanish --seed 5"
).split()
TINY_SPEC = ConversationsSpec(
    conversations=5, languages=("english", "spanish"), system_words=SYSTEM_WORDS, answer_tokens=4
)


def prompts_by_turn(run: dict[str, Any]) -> dict[tuple[str, int], int]:
    return {(d["conversation"], d["turn"]): d["prompt_tokens"] for d in run["requests_detail"]}


def run_tiny(tmp_path: Path, *options: str) -> tuple[str, dict[str, Any]]:
    """The tiny trace with `options`: its report, and its figures."""
    json_path = tmp_path / "conversations.json"
    command = [sys.executable, "-m", "cacheproxy", "bench", "conversations", *TINY, *options]
    done = subprocess.run(
        [*command, "--json", str(json_path)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(json_path.read_text())["conversations"]


@pytest.mark.timeout(300)
def test_bench_conversations_tiny(tmp_path: Path) -> None:
    report, figures = run_tiny(tmp_path)
    runs = {run["arm"]: run for run in figures["runs"]}
    assert set(runs) == {"direct", "proxy"}
    direct, proxy = runs["direct"], runs["proxy"]
    trace = build_trace(TINY_SPEC, 5)
    expected_turns = {(c.name, turn) for c in trace.conversations for turn in range(c.turns)}

    # the same prompts: every (conversation, turn) once, the same token count on both servers
    for run in (direct, proxy):
        assert run["requests"] == len(run["requests_detail"]) == trace.requests
        assert set(prompts_by_turn(run)) == expected_turns
    assert prompts_by_turn(direct) == prompts_by_turn(proxy)
    assert direct["prompt_tokens"] == proxy["prompt_tokens"]
    assert proxy["server_cache_ram_mib"] == 0 and direct["server_cache_ram_mib"] == 8192

    for run in (direct, proxy):
        where = run["arm"]
        by_conversation: dict[str, list[tuple[int, int]]] = {}
        for detail in run["requests_detail"]:
            assert detail["prompt_n"] >= 1, (where, detail)  # the server decodes at least one
            assert detail["prompt_tokens"] == detail["cache_n"] + detail["prompt_n"]
            by_conversation.setdefault(detail["conversation"], []).append(
                (detail["turn"], detail["prompt_tokens"])
            )
        for name, turns in by_conversation.items():
            grown = [tokens for _, tokens in sorted(turns)]
            assert grown == sorted(set(grown)), (where, name, grown)  # history grows each turn
        # each slot's first request decodes the system prompt; none after it does again
        cold = [d for d in run["requests_detail"] if d["cache_n"] < SYSTEM_WORDS]
        assert len(cold) <= SLOTS, (where, cold)
        assert run["tokens_decoded"] <= run["prompt_tokens"] - (run["requests"] - SLOTS) * (
            SYSTEM_WORDS
        )

    # what each server did for the replay, from its own counters: a decode call per answer
    # token at least, over at most every slot
    for run in (direct, proxy):
        work = run["server_work"]
        answer_tokens = sum(detail["output_tokens"] for detail in run["requests_detail"])
        assert answer_tokens / SLOTS <= work["decode_calls"], run["arm"]
        assert 1 <= work["busy_slots_per_decode"] <= SLOTS
        assert work["prompt_s"] > 0 and work["generation_s"] > 0
        assert f"round 0, {run['arm']}: llama-server made {work['decode_calls']:.0f}" in report

    # the proxy checked its predicted reuse of every request against the server's cache_n
    assert sum(proxy["predictions"].values()) == proxy["requests"]
    assert proxy["predictions"].get('result="mismatch"', 0) == 0
    ratios = figures["proxy_over_direct"]["by_round"][0]
    assert ratios["tokens_decoded"] == proxy["tokens_decoded"] / direct["tokens_decoded"]

    assert "| 0 | direct | 8192 |" in report and "| 0 | proxy | 0 |" in report
    assert f"Every run sent the same {trace.requests} requests" in report
    assert "python -m cacheproxy bench conversations --conversations 5" in report


@pytest.mark.timeout(300)
def test_bench_conversations_can_run_the_proxy_with_whole_file_archives(tmp_path: Path) -> None:
    """`--no-disk-blocks` reaches the proxy: it saves, and cuts nothing into blocks."""
    report, figures = run_tiny(tmp_path, "--arms", "proxy", "--no-disk-blocks")
    assert figures["disk_blocks"] is False
    (proxy,) = figures["runs"]
    assert proxy["disk_tier"]["saves"] > 0
    assert proxy["disk_tier"]["block_written_bytes"] == 0
    assert "its disk tier (archives kept as whole files)." in report
