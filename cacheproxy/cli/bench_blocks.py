"""`cacheproxy bench blocks`: its options, and the run (the benchmark imported only then)."""

from __future__ import annotations

import argparse

from cacheproxy.cli.common import MODEL_SIZES


def add_parser(bench_commands: argparse._SubParsersAction) -> None:
    blocks = bench_commands.add_parser(
        "blocks", help="archives as whole files against blocks: disk bytes, restores"
    )
    blocks.add_argument("--size", choices=MODEL_SIZES, default="kv-heavy", help="model")
    blocks.add_argument("--head", type=int, default=1024, help="tokens of the shared head")
    blocks.add_argument("--tail", type=int, default=192, help="tokens of each conversation's own")
    blocks.add_argument("--conversations", type=int, default=6)
    blocks.add_argument("--turns", type=int, default=6, help="turns of the growing conversation")
    blocks.add_argument("--restores", type=int, default=5, help="restores per arm and part")
    blocks.add_argument("--seed", type=int, default=1)
    blocks.add_argument("--json", action="store_true", help="the figures as JSON")


def run(args: argparse.Namespace) -> int:
    from cacheproxy.bench.blocks_bench import BlocksBenchConfig, run_blocks_bench

    config = BlocksBenchConfig(
        size=args.size,
        head=args.head,
        tail=args.tail,
        conversations=args.conversations,
        turns=args.turns,
        restores=args.restores,
        seed=args.seed,
    )
    return run_blocks_bench(config, args.json)
