"""`cacheproxy usage export`: the usage ledger as CSV or JSON on stdout.

It reads the ledger file (the proxy's settings name it) directly: what a running proxy has
written, which is everything but its last `usage.flush_interval_s` (GET /admin/usage shows that
too). Rows are per tenant and UTC hour unless `--group-by` says otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Any

from cacheproxy.cli.common import EXIT_BAD_SETTINGS, EXIT_REFUSED, settings_for_command, with_config
from cacheproxy.tenancy.ledger import LedgerStore, LedgerUnusable
from cacheproxy.tenancy.usage import FIGURES, GROUPINGS, aggregate, parse_time


def add_usage_commands(commands: Any) -> None:
    usage = commands.add_parser("usage", help="the usage ledger")
    actions = usage.add_subparsers(dest="usage_command", required=True)
    export = with_config(actions.add_parser("export", help="print the ledger as CSV or JSON"))
    export.add_argument("--format", choices=("csv", "json"), default="csv")
    export.add_argument("--tenant", help="one tenant's usage (its id)")
    export.add_argument("--from", dest="start", help="ISO 8601 date or time (UTC), or Unix s")
    export.add_argument("--to", dest="end", help="the same, exclusive")
    export.add_argument("--group-by", choices=GROUPINGS, default="hour")
    export.add_argument("--by-model", action="store_true", help="per model as well")


def run_usage_command(args: argparse.Namespace) -> int:
    settings = settings_for_command(args.config)
    if settings is None:
        return EXIT_BAD_SETTINGS
    try:
        start = parse_time(args.start) if args.start else None
        end = parse_time(args.end) if args.end else None
    except ValueError as exc:
        print(json.dumps({"error": {"type": "invalid_time", "message": str(exc)}}), file=sys.stderr)
        return EXIT_REFUSED
    try:
        with LedgerStore(settings.usage_database()) as store:
            rows = store.rows(args.tenant, start, end, args.by_model)
            rows = aggregate(rows, args.group_by, args.by_model)
    except LedgerUnusable as exc:
        print(
            json.dumps({"error": {"type": "ledger_unusable", "message": str(exc)}}), file=sys.stderr
        )
        return EXIT_REFUSED
    if args.format == "json":
        document = {"group_by": args.group_by, "from": start, "to": end, "rows": rows}
        print(json.dumps(document, indent=2))
        return 0
    key = [] if args.group_by == "tenant" else [args.group_by]
    model = ["model"] if args.by_model else []
    columns = ["tenant_id", *model, *key, *FIGURES, "reused_tokens"]
    writer = csv.DictWriter(sys.stdout, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return 0
