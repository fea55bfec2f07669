"""`cacheproxy bench conversations`: its options, and the run (the benchmark imported only
then)."""

from __future__ import annotations

import argparse

from cacheproxy.cli.common import MODEL_SIZES, add_disk_blocks_option, add_proxy_cache_ram_option

# conversations_trace.DEFAULT_LANGUAGES (not imported here: the corpus needs PyYAML)
DEFAULT_LANGUAGES = ["english", "spanish", "italian"]


def add_parser(bench_commands: argparse._SubParsersAction) -> None:
    conversations = bench_commands.add_parser(
        "conversations",
        help="recorded multi-turn chats over /v1/chat/completions, llama-server alone and proxied",
    )
    conversations.add_argument(
        "--conversations", type=int, default=24, help="picked from the corpus (more than --slots)"
    )
    conversations.add_argument(
        "--languages",
        nargs="+",
        default=DEFAULT_LANGUAGES,
        help="the corpus's data folders to pick from",
    )
    conversations.add_argument(
        "--system-words", type=int, default=300, help="the shared system prompt (0: none)"
    )
    conversations.add_argument(
        "--answer-tokens", type=int, default=16, help="max_tokens of every request"
    )
    conversations.add_argument("--clients", type=int, default=4, help="requests in flight")
    conversations.add_argument("--slots", type=int, default=4, help="llama-server --parallel")
    conversations.add_argument("--slot-context", type=int, default=4096, help="tokens per slot")
    conversations.add_argument(
        "--rounds", type=int, default=1, help="the trace this many times per arm, arms alternated"
    )
    conversations.add_argument(
        "--arms", nargs="+", choices=("direct", "proxy"), default=["direct", "proxy"]
    )
    add_proxy_cache_ram_option(conversations)
    add_disk_blocks_option(conversations)
    conversations.add_argument("--size", choices=MODEL_SIZES, default="small", help="test model")
    conversations.add_argument("--seed", type=int, default=1)
    conversations.add_argument(
        "--server-args", default="--threads 1", help="extra llama-server flags"
    )
    conversations.add_argument(
        "--json", dest="json_path", help="also write the figures to this file"
    )


def run(args: argparse.Namespace) -> int:
    from cacheproxy.bench.conversations_bench import run_from_options

    return run_from_options(
        conversations=args.conversations,
        languages=args.languages,
        system_words=args.system_words,
        answer_tokens=args.answer_tokens,
        clients=args.clients,
        slots=args.slots,
        slot_context=args.slot_context,
        rounds=args.rounds,
        arms=args.arms,
        proxy_cache_ram_mib=args.proxy_cache_ram,
        disk_blocks=args.disk_blocks,
        size=args.size,
        seed=args.seed,
        server_args=args.server_args,
        json_path=args.json_path,
    )
