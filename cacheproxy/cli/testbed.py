"""`cacheproxy testbed ...`: build llama-server and the engine, write test models, set up the
hosts and database test beds, run llama.cpp's server tests through the proxy."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cacheproxy.cli.common import MODEL_SIZES


def add_testbed_commands(commands: Any) -> None:
    testbed = commands.add_parser("testbed", help="build llama-server or write a test model")
    testbed_commands = testbed.add_subparsers(dest="testbed_command", required=True)
    testbed_commands.add_parser("build-server", help="build the pinned llama-server (cached)")
    testbed_commands.add_parser(
        "build-engine", help="install the pinned llama-cpp-python from a cached wheel (built once)"
    )
    testbed_commands.add_parser(
        "chromium", help="find a headless Chromium for the dashboard test, or apt-get it as root"
    )
    testbed_commands.add_parser(
        "valgrind", help="find valgrind for `bench instructions`, or apt-get it as root"
    )
    hosts = testbed_commands.add_parser(
        "hosts", help="network namespaces as hosts sharing a GlusterFS archive volume (root)"
    )
    hosts.add_argument(
        "action", choices=("up", "down", "install"), help="install: GlusterFS and glusterd only"
    )
    hosts.add_argument("--count", type=int, default=2, help="how many hosts")
    hosts.add_argument("--root", type=Path, help="brick and mounts (default: <cache>/hosts)")
    hosts.add_argument("--tag", default="cph", help="prefix of the namespaces and interfaces")
    hosts.add_argument("--subnet", type=int, default=77, help="N of 10.77.N.0/24")
    postgres = testbed_commands.add_parser(
        "postgres", help="Debian's PostgreSQL for the database tests (apt-get as root)"
    )
    postgres.add_argument(
        "action", choices=("install", "check"), help="check: also start and stop a server"
    )
    make_model = testbed_commands.add_parser("make-model", help="write a random-weight test model")
    make_model.add_argument("--size", choices=MODEL_SIZES, default="small")
    server_tests = testbed_commands.add_parser(
        "server-tests",
        help="llama.cpp's llama-server test suite, direct and through the proxy, compared",
    )
    server_tests.add_argument(
        "files", nargs="*", help="test files of the suite, e.g. unit/test_basic.py (default: all)"
    )
    server_tests.add_argument("-k", dest="keyword", help="pytest -k expression")
    server_tests.add_argument("--slow", action="store_true", help="also the tests marked slow")
    server_tests.add_argument("--workdir", type=Path, help="folder for both arms' trees and logs")
    server_tests.add_argument("--json", dest="json_path", type=Path, help="write the results here")
    server_tests.add_argument(
        "--parallel-arms", action="store_true", help="run both arms at once (half the wall time)"
    )


def run_testbed_command(args: argparse.Namespace) -> int:
    from cacheproxy.provision.build_server import ensure_llama_server
    from cacheproxy.provision.make_model import ensure_model

    if args.testbed_command == "build-server":
        print(ensure_llama_server())
    elif args.testbed_command == "server-tests":
        from cacheproxy.provision.server_tests import main as run_server_tests

        return run_server_tests(
            args.files, args.keyword, args.slow, args.workdir, args.json_path, args.parallel_arms
        )
    elif args.testbed_command == "build-engine":
        from cacheproxy.provision.build_engine import main as build_engine

        build_engine()
    elif args.testbed_command == "hosts":
        from cacheproxy.provision.hosts import main as hosts_main

        return hosts_main(args.action, args.root, args.count, args.tag, args.subnet)
    elif args.testbed_command == "postgres":
        from cacheproxy.provision.postgres import main as postgres_main

        return postgres_main(args.action)
    elif args.testbed_command == "chromium":
        from cacheproxy.provision.chromium import ChromiumUnavailable, ensure_chromium

        return _print_found("chromium", ensure_chromium, ChromiumUnavailable)
    elif args.testbed_command == "valgrind":
        from cacheproxy.provision.valgrind import ValgrindUnavailable, ensure_valgrind

        return _print_found("valgrind", ensure_valgrind, ValgrindUnavailable)
    else:
        print(ensure_model(args.size))
    return 0


def _print_found(command: str, ensure: Callable[[], Path], unavailable: type[Exception]) -> int:
    """Print what `ensure` found or installed; say why not (exit code 1)."""
    try:
        print(ensure())
    except unavailable as exc:
        print(f"cacheproxy testbed {command}: {exc}", file=sys.stderr)
        return 1
    return 0
