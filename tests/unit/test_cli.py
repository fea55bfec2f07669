"""The `cacheproxy` command line is the only one: every benchmark option is reachable from it."""

from __future__ import annotations

from cacheproxy.cli.main import build_parser


def test_bench_overhead_takes_every_option() -> None:
    args = build_parser().parse_args(
        ["bench", "overhead", "--requests", "10", "--duration", "1.5", "--json", "out.json"]
    )
    assert (args.requests, args.duration, args.json_path) == (10, 1.5, "out.json")
