"""`cacheproxy archives ...`: list and delete archived slot states, from the same files as a
running proxy (removing an archive takes its row and then its file), and put quarantined files
back into the index. No event loop runs here: the commands use the store's blocking face,
`ArchiveIndex`.

Files that start-up recovery found without a row (a lost or emptied index) are moved to the
archive folder's `quarantine/`, never deleted. A slot file does not say whose prompt it holds,
so only an operator can attribute one: `adopt FILE --tenant ID` indexes it as that tenant's
archive, under the tenant's quotas of today.
"""

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
from cacheproxy.disk.archive_reads import archive_listing, archive_summary
from cacheproxy.disk.archive_types import ArchiveError
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.plugins import PluginError, load_plugin
from cacheproxy.settings import Settings
from cacheproxy.tenancy.registry import DEFAULT_TENANT, RegistryError, TenantRegistry


def add_archive_commands(commands: Any) -> None:
    archives = commands.add_parser("archives", help="list, delete or adopt archived slot states")
    actions = archives.add_subparsers(dest="archives_command", required=True)
    listing = with_config(actions.add_parser("list", help="archives, oldest first"))
    listing.add_argument("--tenant", dest="tenant_id", help="only this tenant's")
    delete = with_config(actions.add_parser("delete", help="remove an archive and its file"))
    delete.add_argument("archive_id")
    quarantine = actions.add_parser("quarantine", help="files found without a row in the index")
    quarantine_actions = quarantine.add_subparsers(dest="quarantine_command", required=True)
    with_config(quarantine_actions.add_parser("list", help="quarantined files, oldest first"))
    adopt = with_config(
        actions.add_parser("adopt", help="index a quarantined file as a tenant's archive")
    )
    adopt.add_argument("file_name", help="as `archives quarantine list` shows it")
    adopt.add_argument(
        "--tenant",
        dest="tenant_id",
        required=True,
        help=f"whose prompt it holds ({DEFAULT_TENANT.id!r} while there are no tenants)",
    )
    adopt.add_argument(
        "--fingerprint",
        help="the server it was saved on (default: the one that attached last, as logged)",
    )


def run_archive_command(args: argparse.Namespace) -> int:
    settings = settings_for_command(args.config)
    if settings is None:
        return EXIT_BAD_SETTINGS
    try:
        eviction = load_plugin("eviction", settings.disk.eviction, settings.disk.eviction_options)
    except PluginError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_SETTINGS
    try:
        store = ArchiveIndex.from_settings(settings, eviction)
    except ArchiveError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_REFUSED
    with store:
        if args.archives_command == "list":
            print(json.dumps(archive_listing(store, args.tenant_id), indent=2))
            return 0
        if args.archives_command == "quarantine":
            files = [
                {
                    "file_name": item.file_name,
                    "bytes": item.bytes,
                    "modified": item.modified,
                    "n_tokens": item.n_tokens,
                    "problem": item.problem,
                }
                for item in store.quarantined()
            ]
            print(
                json.dumps({"directory": str(store.quarantine_directory), "files": files}, indent=2)
            )
            return 0
        if args.archives_command == "adopt":
            return _adopt(store, settings, args)
        if not store.remove(args.archive_id):
            return _refused("unknown_archive", f"no archive with id {args.archive_id!r}")
        print(json.dumps({"deleted": args.archive_id}))
        return 0


def _adopt(store: ArchiveIndex, settings: Settings, args: argparse.Namespace) -> int:
    fingerprint = args.fingerprint or store.latest_fingerprint()
    if fingerprint is None:
        return _refused(
            "unknown_fingerprint",
            "no server has attached to this index yet: start the proxy once, or pass"
            " --fingerprint (logged as `disk tier on for URL (fp_...)`)",
        )
    try:
        with TenantRegistry(settings.tenant_database()) as registry:
            if args.tenant_id == DEFAULT_TENANT.id and not registry.has_tenants():
                quotas: tuple[int | None, int | None] = (None, None)
            else:
                tenant = registry.get(args.tenant_id)
                quotas = (tenant.quota_bytes, tenant.quota_archives)
    except RegistryError as exc:
        return _refused("unknown_tenant", str(exc))
    try:
        committed = store.adopt(args.file_name, args.tenant_id, fingerprint, *quotas)
    except (ArchiveError, OSError) as exc:
        return _refused("refused", str(exc))
    print(json.dumps({"adopted": archive_summary(committed.archive)}, indent=2))
    return 0


def _refused(kind: str, message: str) -> int:
    print(json.dumps({"error": {"type": kind, "message": message}}), file=sys.stderr)
    return EXIT_REFUSED
