"""`cacheproxy bench overhead`: its options, and the run (the benchmark imported only then)."""

from __future__ import annotations

import argparse


def add_parser(bench_commands: argparse._SubParsersAction) -> None:
    overhead = bench_commands.add_parser("overhead", help="latency and throughput the proxy adds")
    overhead.add_argument("--requests", type=int, default=400, help="requests per latency series")
    overhead.add_argument("--duration", type=float, default=5.0, help="seconds per throughput run")
    overhead.add_argument(
        "--rounds", type=int, default=3, help="throughput runs per arm and level, arms alternated"
    )
    overhead.add_argument("--server-args", default="--threads 1", help="extra llama-server flags")
    overhead.add_argument(
        "--also-server-args",
        action="append",
        default=[],
        help="run the whole benchmark again with these llama-server flags (repeatable), e.g."
        " --also-server-args '' for the server at its own thread default",
    )
    overhead.add_argument(
        "--route-requests",
        type=int,
        default=150,
        help="requests per arm, route and concurrency in the added-latency-by-route runs",
    )
    overhead.add_argument(
        "--chat-tokens",
        action="store_true",
        help="serve the test model whose vocabulary holds the chat template's markers as"
        " control tokens, as real chat models do",
    )
    overhead.add_argument(
        "--calibrate-us", type=float, default=100.0, help="what N us more CPU costs (0: off)"
    )
    overhead.add_argument(
        "--upstream-tls",
        action="store_true",
        help="llama-server over https (a certificate from a CA made for the run): every arm"
        " reaches it there",
    )
    overhead.add_argument("--json", dest="json_path", help="also write the figures to this file")


def run(args: argparse.Namespace) -> int:
    from cacheproxy.bench.overhead import run_overhead_benchmark

    return run_overhead_benchmark(
        requests=args.requests,
        duration=args.duration,
        json_path=args.json_path,
        rounds=args.rounds,
        server_args=[args.server_args, *args.also_server_args],
        route_requests=args.route_requests,
        chat_tokens=args.chat_tokens,
        calibrate_us=args.calibrate_us,
        upstream_tls=args.upstream_tls,
    )
