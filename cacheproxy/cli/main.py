"""`cacheproxy`: serve, check a config, build the test bed, run benchmarks.

Flag names follow llama-server's (`--host`, `--port`, `-m/--model`, `-np/--parallel`,
`-c/--ctx-size`, `--cache-ram`), so putting the proxy in front of a server is a port change.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cacheproxy.cli import (
    bench_blocks,
    bench_cluster,
    bench_conversations,
    bench_index,
    bench_instructions,
    bench_overhead,
)
from cacheproxy.cli.archives import add_archive_commands, run_archive_command
from cacheproxy.cli.common import (
    EXIT_BAD_SETTINGS,
    MODEL_SIZES,
    add_disk_blocks_option,
    add_proxy_cache_ram_option,
    describe_settings_errors,
)
from cacheproxy.cli.serve import one_line, serve
from cacheproxy.cli.tenants import add_tenant_commands, run_tenant_command
from cacheproxy.cli.testbed import add_testbed_commands, run_testbed_command
from cacheproxy.cli.usage import add_usage_commands, run_usage_command
from cacheproxy.ops.logs import redact_secrets
from cacheproxy.settings import ConfigFileError, Settings, load_settings

# the test models of cacheproxy.provision.make_model.SIZES (not imported here: it loads numpy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheproxy", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy")
    _add_setting_flags(serve)

    check = commands.add_parser(
        "check-config", help="validate settings and print the effective ones"
    )
    _add_setting_flags(check)

    add_testbed_commands(commands)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    bench_overhead.add_parser(bench_commands)
    bodies = bench_commands.add_parser(
        "bodies", help="/health latency and proxy memory under concurrent ~90 MB bodies"
    )
    bodies.add_argument("--clients", type=int, default=4, help="big bodies sent at once")
    bodies.add_argument("--mb", type=int, default=90, help="size of each body, MB")
    bodies.add_argument("--kinds", nargs="+", choices=("ids", "text"), default=["ids", "text"])
    isolation = bench_commands.add_parser(
        "isolation", help="W4: can a tenant time another tenant's cache? (KS test)"
    )
    isolation.add_argument("--trials", type=int, default=200, help="trials per condition")
    isolation.add_argument("--seed", type=int, default=1)
    fairness = bench_commands.add_parser(
        "fairness", help="a light tenant's TTFT beside a heavy one: fair share against FIFO"
    )
    fairness.add_argument("--duration", type=float, default=30.0, help="seconds of load per arm")
    fairness.add_argument(
        "--overload", type=float, default=1.5, help="the heavy tenant's rate, times capacity"
    )
    fairness.add_argument("--ratio", type=float, default=20.0, help="heavy load / light load")
    fairness.add_argument("--prompt-tokens", type=int, default=256, help="tokens per prompt")
    fairness.add_argument("--n-predict", type=int, default=8, help="tokens generated")
    fairness.add_argument("--seed", type=int, default=14)
    fairness.add_argument("--json", dest="json_path", type=Path, help="also write the figures")
    evictions = bench_commands.add_parser(
        "evictions",
        help="TTFT of evicting requests (W2) and the size channel, archive-ahead off and on",
    )
    evictions.add_argument("--size", choices=MODEL_SIZES, default="kv-heavy", help="test model")
    evictions.add_argument("--slots", type=int, default=2)
    evictions.add_argument("--users", type=int, default=4, help="W2 users (more than slots)")
    evictions.add_argument("--turns", type=int, default=4)
    evictions.add_argument("--history", type=int, default=384, help="W2 opening tokens")
    evictions.add_argument("--think-s", type=float, default=1.0, help="pause between requests")
    evictions.add_argument("--trials", type=int, default=30, help="size channel, per condition")
    evictions.add_argument("--large", type=int, default=1024, help="B's large slot, tokens")
    evictions.add_argument("--small", type=int, default=320, help="B's small slot, tokens")
    evictions.add_argument("--pause-s", type=float, default=2.0, help="B's answer to A's request")
    evictions.add_argument("--no-w2", action="store_true", help="only the size channel")
    evictions.add_argument("--seed", type=int, default=1)
    evictions.add_argument("--json", type=Path, help="write the figures as JSON here")
    cache = bench_commands.add_parser("cache", help="tokens decoded against the oracle, by arm")
    cache.add_argument("--workload", nargs="+", choices=("W1", "W2", "W3"), default=["W1", "W2"])
    cache.add_argument(
        "--cache-ram",
        nargs="+",
        type=int,
        help="MiB; one run per value (default 0 8192; with --server-defaults, 8192: unsaid)",
    )
    cache.add_argument(
        "--arms", nargs="+", choices=("direct", "proxy"), default=["direct", "proxy"]
    )
    cache.add_argument("--size", choices=MODEL_SIZES, default="small", help="test model")
    cache.add_argument("--seed", type=int, default=1)
    cache.add_argument(
        "--server-args",
        help="extra llama-server flags (default --threads 1; with --server-defaults, none)",
    )
    cache.add_argument(
        "--server-defaults",
        action="store_true",
        help="start every llama-server as `llama-server -m MODEL` does (its defaults: 4 slots,"
        " unified KV, 8192 MiB RAM cache; no --slot-save-path, no --metrics)",
    )
    cache.add_argument("--json", dest="json_path", help="also write the figures to this file")
    cache.add_argument(
        "--proxy-cache-ram",
        type=int,
        help="MiB for the proxy arm's llama-server (default: the same as the direct arm's)",
    )
    cache.add_argument(
        "--disk-budget-mib", type=int, default=1024, help="the proxy's disk tier budget"
    )
    add_disk_blocks_option(cache)
    cache.add_argument(
        "--models",
        type=int,
        default=1,
        help="W2/W3 over this many models: each arm's server a router (--models-dir)",
    )
    cache.add_argument("--models-max", type=int, help="the router's --models-max")
    cache.add_argument(
        "--token-scale",
        type=float,
        default=1.0,
        help="W1-W3 token counts times this, same shapes (for a slow model or machine)",
    )
    bench_cluster.add_parser(bench_commands)
    bench_conversations.add_parser(bench_commands)
    agents = bench_commands.add_parser(
        "agents", help="W5: coding agents over /v1/messages and /v1/responses, by arm"
    )
    agents.add_argument("--agents", type=int, default=10, help="agents (more than --slots)")
    agents.add_argument(
        "--turns", nargs=2, type=int, default=[3, 6], metavar=("MIN", "MAX"), help="per agent"
    )
    agents.add_argument("--slots", type=int, default=4, help="llama-server --parallel")
    agents.add_argument("--slot-context", type=int, default=8192, help="tokens per slot")
    agents.add_argument(
        "--system-words", nargs=2, type=int, default=[600, 1200], metavar=("MIN", "MAX")
    )
    agents.add_argument(
        "--tool-output-lines",
        nargs=2,
        type=int,
        default=[6, 16],
        metavar=("MIN", "MAX"),
        help="per turn, 20-40 tokens each",
    )
    agents.add_argument("--answer-tokens", type=int, default=32, help="max tokens per answer")
    agents.add_argument(
        "--api", nargs="+", choices=("messages", "responses"), default=["messages", "responses"]
    )
    agents.add_argument(
        "--arms", nargs="+", choices=("direct", "proxy"), default=["direct", "proxy"]
    )
    agents.add_argument("--size", choices=MODEL_SIZES, default="small", help="test model")
    agents.add_argument("--seed", type=int, default=1)
    agents.add_argument("--server-args", default="--threads 1", help="extra llama-server flags")
    agents.add_argument(
        "--rounds", type=int, default=1, help="each API's arms this many times, alternated"
    )
    agents.add_argument("--json", dest="json_path", help="also write the figures to this file")
    add_proxy_cache_ram_option(agents)
    add_disk_blocks_option(agents)
    embedded = bench_commands.add_parser(
        "embedded", help="W1/W2 on the embedded engine: each prompt-cache policy and budget"
    )
    embedded.add_argument("--workload", nargs="+", choices=("W1", "W2"), default=["W1", "W2"])
    embedded.add_argument(
        "--arms",
        nargs="+",
        choices=("llama-server", "lru-trie", "radix", "shared-prefix", "LlamaRAMCache"),
        default=None,
        help="policies to run (default: all, and llama-cpp-python's LlamaRAMCache)",
    )
    embedded.add_argument(
        "--cache-mib",
        type=int,
        nargs="+",
        default=[16],
        help="RAM budget of every arm; several: the whole table at each",
    )
    embedded.add_argument("--scale", type=float, default=1.0, help="W1/W2 sizes times this")
    embedded.add_argument(
        "--threads", type=int, default=1, help="decode threads (more spin on a busy machine)"
    )
    embedded.add_argument("--size", choices=MODEL_SIZES, default="small", help="model")
    embedded.add_argument("--seed", type=int, default=1)
    bench_blocks.add_parser(bench_commands)
    bench_index.add_parser(bench_commands)
    bench_instructions.add_parser(bench_commands)
    report = bench_commands.add_parser("report", help="W1-W5 as a Markdown report with plots")
    report.add_argument("--out", type=Path, required=True, help="folder for report.md and PNGs")
    workloads = ["W1", "W2", "W3", "W4", "W5"]
    report.add_argument("--workload", nargs="+", choices=workloads, default=workloads)
    report.add_argument("--cache-ram", nargs="+", type=int, default=[0, 8192], help="MiB (W1-W3)")
    report.add_argument("--size", choices=MODEL_SIZES, default="small", help="W1-W3 and W5 model")
    report.add_argument("--trials", type=int, default=200, help="W4 trials per condition")
    report.add_argument("--seed", type=int, default=1)
    report.add_argument("--server-args", default="--threads 1", help="extra flags (W1-W3, W5)")
    # Scales the W1-W3 sizes down for tests and quick looks; documented in bench/report.py.
    report.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)
    report.add_argument(
        "--token-scale",
        type=float,
        default=1.0,
        help="W1-W3 token counts times this, same shapes (for slow models)",
    )
    report.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="W1-W3: run every row N times, arms alternated; wall time as median and range",
    )
    add_disk_blocks_option(report)

    add_tenant_commands(commands)
    add_archive_commands(commands)
    add_usage_commands(commands)
    return parser


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML settings file")
    parser.add_argument("--host", help="addresses to listen on, or PATH.sock (127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8080)")
    parser.add_argument(
        "--upstream",
        action="append",
        dest="upstreams",
        metavar="URL",
        help="a llama-server to front (http(s)://, unix://); without one, one is started",
    )
    parser.add_argument("--upstream-api-key", help="key to send to the upstreams")
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        help="keys clients must present while no tenants exist, comma-separated, as"
        " llama-server's --api-key (default: the upstream key, if any)",
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    parser.add_argument(
        "--backend",
        choices=("auto", "llama-server", "embedded"),
        help="without --upstream: a managed llama-server or the embedded engine (default auto)",
    )
    managed = parser.add_argument_group("managed llama-server (when no --upstream is given)")
    managed.add_argument("--llama-server", dest="binary", type=Path, help="llama-server binary")
    managed.add_argument("-m", "--model", type=Path, help="GGUF model for the managed server")
    managed.add_argument("-np", "--parallel", type=int, help="slots (default 4)")
    managed.add_argument("-c", "--ctx-size", type=int, help="total context (default 16384)")
    managed.add_argument(
        "--cache-ram",
        dest="cache_ram_mib",
        type=int,
        help="RAM cache MiB (default: 0 while the disk tier runs, else llama-server's own)",
    )
    managed.add_argument(
        "--models-dir", type=Path, help="several models: a router-mode server for this folder"
    )
    managed.add_argument(
        "--models-preset", type=Path, help="several models: a router-mode server for this preset"
    )
    managed.add_argument("--models-max", type=int, help="models loaded at once (router mode)")


# the managed server's flags (`_add_setting_flags`), as `[managed]` settings
MANAGED_FLAGS = "binary model parallel ctx_size cache_ram_mib models_dir models_preset models_max"


def settings_from_args(args: argparse.Namespace) -> Settings:
    managed = {
        name: getattr(args, name)
        for name in MANAGED_FLAGS.split()
        if getattr(args, name) is not None
    }
    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "upstreams": args.upstreams,
        "upstream_api_key": args.upstream_api_key,
        "api_keys": args.api_keys,
        "log_level": args.log_level,
        "managed": managed or None,
        # -np and -c size the embedded engine too, whichever backend ends up serving
        "embedded": {
            name: getattr(args, name)
            for name in ("parallel", "ctx_size")
            if getattr(args, name) is not None
        }
        or None,
        "backend": args.backend,
    }
    return load_settings(args.config, **overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "testbed":
        return run_testbed_command(args)
    if args.command == "tenants":
        return run_tenant_command(args)
    if args.command == "usage":
        return run_usage_command(args)
    if args.command == "archives":
        return run_archive_command(args)
    if args.command == "bench":
        return _bench(args)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        described = describe_settings_errors(exc)
        if args.command == "serve":  # a refusal to start is one line
            described = one_line(described)
        print(described, file=sys.stderr)
        return EXIT_BAD_SETTINGS
    except ConfigFileError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_SETTINGS
    if args.command == "check-config":
        from cacheproxy.http.start_checks import check_plugins
        from cacheproxy.plugins import PluginError

        try:
            check_plugins(settings)
        except PluginError as exc:
            print(one_line(str(exc)), file=sys.stderr)
            return EXIT_BAD_SETTINGS
        # secrets print as "**********"; a password or key inside a URL is masked as well
        print(redact_secrets(json.dumps(settings.model_dump(mode="json"), indent=2)))
        return 0
    return serve(settings)


def _bench(args: argparse.Namespace) -> int:
    """Run a benchmark; each module is imported only when asked for (they pull in more)."""
    if args.bench_command == "bodies":
        from cacheproxy.bench.bodies import run_bodies_benchmark

        return run_bodies_benchmark(clients=args.clients, megabytes=args.mb, kinds=args.kinds)
    if args.bench_command == "isolation":
        from cacheproxy.bench.isolation import run_isolation_audit

        return run_isolation_audit(args.trials, args.seed)
    if args.bench_command == "fairness":
        from cacheproxy.bench.fairness import run_fairness_benchmark

        return run_fairness_benchmark(
            duration_s=args.duration,
            overload=args.overload,
            ratio=args.ratio,
            prompt_tokens=args.prompt_tokens,
            n_predict=args.n_predict,
            seed=args.seed,
            json_path=args.json_path,
        )
    if args.bench_command == "evictions":
        from cacheproxy.bench.evictions import EvictionBenchConfig, run_eviction_bench

        config = EvictionBenchConfig(
            size=args.size,
            slots=args.slots,
            users=args.users,
            turns=args.turns,
            history_tokens=args.history,
            think_s=args.think_s,
            trials=args.trials,
            large_tokens=args.large,
            small_tokens=args.small,
            pause_s=args.pause_s,
            seed=args.seed,
            w2=not args.no_w2,
        )
        return run_eviction_bench(config, args.json)
    if args.bench_command == "cache":
        from cacheproxy.bench.cache_bench import run_from_options

        return run_from_options(
            workloads=args.workload,
            cache_ram_mib=args.cache_ram or ([8192] if args.server_defaults else [0, 8192]),
            arms=args.arms,
            size=args.size,
            seed=args.seed,
            server_args=args.server_args
            if args.server_args is not None
            else ("" if args.server_defaults else "--threads 1"),
            json_path=args.json_path,
            proxy_cache_ram_mib=args.proxy_cache_ram,
            disk_budget_mib=args.disk_budget_mib,
            models=args.models,
            models_max=args.models_max,
            server_defaults=args.server_defaults,
            token_scale=args.token_scale,
            disk_blocks=args.disk_blocks,
        )
    if args.bench_command == "cluster":
        return bench_cluster.run(args)
    if args.bench_command == "conversations":
        return bench_conversations.run(args)
    if args.bench_command == "agents":
        from cacheproxy.bench.agents_bench import run_from_options as run_agents

        return run_agents(
            agents=args.agents,
            turns=args.turns,
            slots=args.slots,
            slot_context=args.slot_context,
            system_words=args.system_words,
            tool_output_lines=args.tool_output_lines,
            answer_tokens=args.answer_tokens,
            apis=args.api,
            arms=args.arms,
            size=args.size,
            seed=args.seed,
            server_args=args.server_args,
            json_path=args.json_path,
            disk_blocks=args.disk_blocks,
            rounds=args.rounds,
            proxy_cache_ram_mib=args.proxy_cache_ram,
        )
    if args.bench_command == "embedded":
        from cacheproxy.bench.embedded_bench import run_from_options as run_embedded

        return run_embedded(
            workloads=tuple(args.workload),
            arms=tuple(args.arms) if args.arms else None,
            budget_mib=tuple(args.cache_mib),
            scale=args.scale,
            threads=args.threads,
            size=args.size,
            seed=args.seed,
        )
    if args.bench_command == "blocks":
        return bench_blocks.run(args)
    if args.bench_command == "index":
        return bench_index.run(args)
    if args.bench_command == "instructions":
        return bench_instructions.run(args)
    if args.bench_command == "report":
        from cacheproxy.bench.report import run_from_options as run_report

        return run_report(
            out_dir=args.out,
            workloads=args.workload,
            cache_ram_mib=args.cache_ram,
            size=args.size,
            trials=args.trials,
            seed=args.seed,
            server_args=args.server_args,
            scale=args.scale,
            token_scale=args.token_scale,
            repeat=args.repeat,
            disk_blocks=args.disk_blocks,
        )
    return bench_overhead.run(args)


if __name__ == "__main__":
    sys.exit(main())
