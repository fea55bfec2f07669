"""`cacheproxy bench cluster`: its options, and the run (the benchmark imported only then)."""

from __future__ import annotations

import argparse
import sys

from cacheproxy.cli.common import MODEL_SIZES


def add_parser(bench_commands: argparse._SubParsersAction) -> None:
    cluster = bench_commands.add_parser(
        "cluster", help="W2 over two proxies and two llama-servers, one proxy killed mid-run"
    )
    cluster.add_argument(
        "--arms", nargs="+", choices=("steady", "kill"), default=["steady", "kill"]
    )
    cluster.add_argument(
        "--kill-after", type=float, default=0.5, help="share of the requests answered first"
    )
    cluster.add_argument(
        "--kill-at-turn",
        type=int,
        help="kill between turns instead, after this many; the next wait for the takeover",
    )
    cluster.add_argument(
        "--no-wait",
        action="store_true",
        help="with --kill-at-turn: the next turns go on at once, not after the takeover",
    )
    cluster.add_argument("--parallel", type=int, default=4, help="slots per llama-server (-np)")
    cluster.add_argument("--tenants", type=int, default=3, help="W2's tenants")
    cluster.add_argument("--users-per-tenant", type=int, default=4, help="W2's users per tenant")
    cluster.add_argument("--turns", type=int, default=6, help="W2's turns per user")
    cluster.add_argument(
        "--with-tenants", action="store_true", help="register the tenants (else one open user)"
    )
    cluster.add_argument("--lease-ttl", type=float, default=6.0, help="s; renewed every ttl/3")
    cluster.add_argument("--size", choices=MODEL_SIZES, default="small", help="test model")
    cluster.add_argument(
        "--hosts", action="store_true", help="llama-servers on two test-bed hosts (root)"
    )
    cluster.add_argument("--seed", type=int, default=1)
    cluster.add_argument("--json", dest="json_path", help="also write the figures to this file")


def run(args: argparse.Namespace) -> int:
    from cacheproxy.bench.cluster_bench import ClusterBenchConfig, run_cluster_benchmark
    from cacheproxy.bench.workloads import MultiTurnSpec

    try:
        config = ClusterBenchConfig(
            arms=tuple(dict.fromkeys(args.arms)),
            model_size=args.size,
            seed=args.seed,
            lease_ttl_s=args.lease_ttl,
            renew_interval_s=args.lease_ttl / 3,
            kill_after=args.kill_after,
            kill_at_turn=args.kill_at_turn,
            wait_for_takeover=not args.no_wait,
            tenants_exist=args.with_tenants,
            parallel=args.parallel,
            ctx_size=max(args.parallel, 2) * 4096,
            hosts=args.hosts,
            multi_turn=MultiTurnSpec(
                tenants=args.tenants, users_per_tenant=args.users_per_tenant, turns=args.turns
            ),
        )
    except ValueError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    return run_cluster_benchmark(config, args.json_path)
