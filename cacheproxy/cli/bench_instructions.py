"""`cacheproxy bench instructions`: its options, and the run (the benchmark imported only then)."""

from __future__ import annotations

import argparse

ROUTE_NAMES = ("/completion", "/v1/chat/completions", "/v1/messages")
FRONT_NAMES = ("bare", "proxy", "no-limits", "no-disk", "no-tenants", "core")


def add_parser(bench_commands: argparse._SubParsersAction) -> None:
    instructions = bench_commands.add_parser(
        "instructions",
        help="instructions a front process executes per request, by route (callgrind)",
    )
    instructions.add_argument(
        "--requests", type=int, default=100, help="requests counted a route and front"
    )
    instructions.add_argument(
        "--warmup", type=int, default=20, help="requests sent first, not counted"
    )
    instructions.add_argument(
        "--arms", nargs="+", choices=FRONT_NAMES, default=list(FRONT_NAMES), help="fronts measured"
    )
    instructions.add_argument("--routes", nargs="+", choices=ROUTE_NAMES, default=list(ROUTE_NAMES))
    instructions.add_argument(
        "--bytecodes",
        type=int,
        default=15,
        help="the proxy's Python bytecodes by file and function: this many of each (0: none)",
    )
    instructions.add_argument("--json", default=None, help="also write the figures here")


def run(args: argparse.Namespace) -> int:
    from cacheproxy.bench.instructions import run_instructions_benchmark

    return run_instructions_benchmark(
        args.requests, args.warmup, args.arms, args.routes, args.json, args.bytecodes
    )
