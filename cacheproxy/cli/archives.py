"""`cacheproxy archives ...`: list and delete archived slot states, from the same files as a
running proxy (the index is SQLite; removing an archive takes its row and then its file)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cacheproxy.cli.common import (
    EXIT_BAD_SETTINGS,
    EXIT_REFUSED,
    settings_for_command,
    with_config,
)
from cacheproxy.disk.store import ArchiveStore, archive_listing
from cacheproxy.plugins import PluginError, load_plugin


def add_archive_commands(commands: Any) -> None:
    archives = commands.add_parser("archives", help="list or delete archived slot states")
    actions = archives.add_subparsers(dest="archives_command", required=True)
    listing = with_config(actions.add_parser("list", help="archives, oldest first"))
    listing.add_argument("--tenant", dest="tenant_id", help="only this tenant's")
    delete = with_config(actions.add_parser("delete", help="remove an archive and its file"))
    delete.add_argument("archive_id")


def run_archive_command(args: argparse.Namespace) -> int:
    settings = settings_for_command(args.config)
    if settings is None:
        return EXIT_BAD_SETTINGS
    try:
        eviction = load_plugin("eviction", settings.disk.eviction, settings.disk.eviction_options)
    except PluginError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_SETTINGS
    budget = settings.disk.budget_mib * 1024 * 1024
    with ArchiveStore(
        settings.archive_directory(), settings.archive_database(), eviction, budget
    ) as store:
        if args.archives_command == "list":
            print(json.dumps(archive_listing(store, args.tenant_id), indent=2))
            return 0
        if not store.remove(args.archive_id):
            message = f"no archive with id {args.archive_id!r}"
            print(
                json.dumps({"error": {"type": "unknown_archive", "message": message}}),
                file=sys.stderr,
            )
            return EXIT_REFUSED
        print(json.dumps({"deleted": args.archive_id}))
        return 0
