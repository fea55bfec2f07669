"""`cacheproxy bench index`: its options, and the run (the benchmark imported only then)."""

from __future__ import annotations

import argparse


def add_parser(bench_commands: argparse._SubParsersAction) -> None:
    index = bench_commands.add_parser(
        "index", help="a save's and a lookup's time in the archive index as archives grow"
    )
    index.add_argument(
        "--at", type=int, nargs="+", default=[100, 1000, 3000], help="archive counts measured"
    )
    index.add_argument("--system", type=int, default=450, help="tokens of the system prompt")
    index.add_argument("--tail", type=int, default=600, help="most tokens of a conversation")
    index.add_argument("--samples", type=int, default=25, help="saves and lookups per count")
    index.add_argument("--seed", type=int, default=1)
    index.add_argument(
        "--database-url",
        default=None,
        help="a PostgreSQL database (default: a SQLite file); the run's archives are removed",
    )
    index.add_argument("--json", action="store_true", help="the figures as JSON")


def run(args: argparse.Namespace) -> int:
    from cacheproxy.bench.index_bench import IndexBenchConfig, run_index_bench

    config = IndexBenchConfig(
        at=tuple(args.at),
        system=args.system,
        tail=args.tail,
        samples=args.samples,
        seed=args.seed,
        database_url=args.database_url,
    )
    return run_index_bench(config, args.json)
