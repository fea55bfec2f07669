"""The `cacheproxy` command line is the only one: every benchmark option is reachable from it."""

from __future__ import annotations

import pytest

from cacheproxy.cli.main import build_parser, main


def test_bench_overhead_takes_every_option() -> None:
    options = "--requests 10 --duration 1.5 --json out.json --rounds 4"
    args = build_parser().parse_args(
        ["bench", "overhead", *options.split(), "--server-args=--threads 2 --poll 0"]
    )
    assert (args.requests, args.duration, args.json_path, args.rounds) == (10, 1.5, "out.json", 4)
    assert args.server_args == "--threads 2 --poll 0"
    # as every other benchmark runs llama-server unless told otherwise
    assert build_parser().parse_args(["bench", "overhead"]).server_args == "--threads 1"
    again = ["bench", "overhead", "--also-server-args=", "--also-server-args=--threads 2"]
    assert build_parser().parse_args(again).also_server_args == ["", "--threads 2"]
    assert build_parser().parse_args(["bench", "overhead", "--chat-tokens"]).chat_tokens
    calibrated = ["bench", "overhead", "--calibrate-us", "120"]
    assert build_parser().parse_args(calibrated).calibrate_us == 120.0
    assert build_parser().parse_args(["bench", "overhead"]).calibrate_us == 100.0


def test_bench_agents_takes_every_option() -> None:
    options = (
        "--agents 12 --turns 2 5 --slots 3 --slot-context 4096 --system-words 50 90"
        " --tool-output-lines 4 9 --answer-tokens 16 --api responses --arms proxy --size large"
        " --seed 7 --json w5.json"
    )
    args = build_parser().parse_args(
        ["bench", "agents", *options.split(), "--server-args=--threads 2"]
    )
    assert (args.agents, args.turns, args.slots, args.slot_context) == (12, [2, 5], 3, 4096)
    assert (args.system_words, args.tool_output_lines, args.answer_tokens) == (
        [50, 90],
        [4, 9],
        16,
    )
    assert (args.api, args.arms, args.size, args.seed) == (["responses"], ["proxy"], "large", 7)
    assert (args.server_args, args.json_path) == ("--threads 2", "w5.json")


def test_bench_agents_refuses_a_trace_that_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 before any server starts: W5 is about more agents than slots."""
    assert main(["bench", "agents", "--agents", "4", "--slots", "4"]) == 2
    assert "more agents than slots" in capsys.readouterr().err
    assert main(["bench", "agents", "--turns", "5", "3"]) == 2
