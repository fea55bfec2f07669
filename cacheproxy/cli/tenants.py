"""`cacheproxy tenants ...`: manage the tenant registry file directly, as the admin API does.

The CLI opens the same SQLite file as a running proxy (from the same settings); the proxy sees
each change within a quarter second, since it re-reads when the registry's change counter moves.
Output is JSON on stdout; a refused change prints a JSON error on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cacheproxy.cli.common import EXIT_BAD_SETTINGS, EXIT_REFUSED, settings_for_command, with_config
from cacheproxy.tenancy.limits import LIMIT_NAMES
from cacheproxy.tenancy.registry import DuplicateName, TenantRegistry, UnknownTenant
from cacheproxy.tenancy.registry_records import (
    MAX_WEIGHT,
    PRIORITY_CLASSES,
    SHARE_FIELDS,
    InvalidField,
    RegistryError,
    tenant_summary,
)

ERROR_KINDS: dict[type[RegistryError], str] = {
    UnknownTenant: "unknown_tenant",
    DuplicateName: "duplicate_name",
    InvalidField: "invalid_field",
}


def add_tenant_commands(commands: Any) -> None:
    """Add `tenants` and its subcommands to the `cacheproxy` parser's subparsers."""
    tenants = commands.add_parser("tenants", help="manage tenants, their keys and quotas")
    actions = tenants.add_subparsers(dest="tenants_command", required=True)

    create = with_config(actions.add_parser("create", help="add a tenant; prints its API key"))
    create.add_argument("name", help="1-64 characters of A-Z a-z 0-9 _ . -")
    create.add_argument("--quota-bytes", type=_quota, help="archive bytes on disk (none: no limit)")
    create.add_argument("--quota-archives", type=_quota, help="archived states (none: no limit)")
    create.add_argument(
        "--hide-cache-signals",
        action="store_true",
        help="strip timings.cache_n / cached_tokens from this tenant's answers",
    )
    create.add_argument(
        "--no-public-prefixes",
        dest="may_use_public_prefixes",
        action="store_false",
        help="never reuse prefixes an admin marked public",
    )
    _share_options(create, keep_unset=False)
    create.add_argument(
        "--models",
        type=_models,
        default=None,
        help="the models it may use, comma-separated (default: any model)",
    )

    with_config(actions.add_parser("list", help="all tenants"))
    for action, help_text in (
        ("disable", "refuse the tenant's key until enabled again"),
        ("enable", "accept the tenant's key again"),
        ("rotate-key", "issue a new key; the old one stops working at once"),
    ):
        with_config(actions.add_parser(action, help=help_text)).add_argument("tenant_id")

    set_quota = with_config(actions.add_parser("set-quota", help="change a tenant's quotas"))
    set_quota.add_argument("tenant_id")
    # SUPPRESS: an option not given leaves that quota as it is; "none" removes the limit
    set_quota.add_argument("--bytes", dest="quota_bytes", type=_quota, default=argparse.SUPPRESS)
    set_quota.add_argument(
        "--archives", dest="quota_archives", type=_quota, default=argparse.SUPPRESS
    )

    set_share = with_config(
        actions.add_parser("set-share", help="change a tenant's fair share and request limits")
    )
    set_share.add_argument("tenant_id")
    _share_options(set_share, keep_unset=True)

    set_models = with_config(
        actions.add_parser("set-models", help="change the models a tenant may use")
    )
    set_models.add_argument("tenant_id")
    allow = set_models.add_mutually_exclusive_group(required=True)
    allow.add_argument("--models", type=_models, help="model names, comma-separated")
    allow.add_argument(
        "--any", dest="any_model", action="store_true", help="any model (no allow list)"
    )

    with_config(
        actions.add_parser("limits", help="a tenant's rate limits and budgets")
    ).add_argument("tenant_id")
    set_limits = with_config(
        actions.add_parser("set-limits", help="change a tenant's rate limits and budgets")
    )
    set_limits.add_argument("tenant_id")
    for name in LIMIT_NAMES:
        # "none": the default (settings' [limits]) applies again
        set_limits.add_argument(
            "--" + name.replace("_", "-"), dest=name, type=_quota, default=argparse.SUPPRESS
        )


def _share_options(parser: argparse.ArgumentParser, keep_unset: bool) -> None:
    """--weight, --max-queued, --max-concurrent, --max-priority; with `keep_unset`, an option
    not given leaves that field as it is ("none" sets a bound back to the settings' default)."""
    unset = {"default": argparse.SUPPRESS} if keep_unset else {}
    parser.add_argument(
        "--weight",
        type=_weight,
        **(unset or {"default": 1.0}),
        help="share of the slots against other waiting tenants (default 1)",
    )
    parser.add_argument(
        "--max-queued",
        type=_bound,
        **(unset or {"default": None}),
        help="requests it may have waiting (none: scheduling.max_queue_per_tenant)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=_bound,
        **(unset or {"default": None}),
        help="requests in the proxy at once (none: scheduling.max_concurrent_per_tenant)",
    )
    parser.add_argument(
        "--max-priority",
        choices=PRIORITY_CLASSES,
        **(unset or {"default": "interactive"}),
        help="the highest class its requests may ask for (X-Priority)",
    )


def run_tenant_command(args: argparse.Namespace) -> int:
    settings = settings_for_command(args.config)
    if settings is None:
        return EXIT_BAD_SETTINGS
    try:
        with TenantRegistry(settings.tenant_database()) as registry:
            print(json.dumps(_run(registry, args), indent=2))
    except RegistryError as exc:
        kind = ERROR_KINDS.get(type(exc), "refused")
        print(json.dumps({"error": {"type": kind, "message": str(exc)}}), file=sys.stderr)
        return EXIT_REFUSED
    return 0


def _run(registry: TenantRegistry, args: argparse.Namespace) -> Any:
    command = args.tenants_command
    if command == "create":
        tenant, api_key = registry.create(
            args.name,
            quota_bytes=args.quota_bytes,
            quota_archives=args.quota_archives,
            hide_cache_signals=args.hide_cache_signals,
            may_use_public_prefixes=args.may_use_public_prefixes,
            models=args.models,
            **{field: getattr(args, field) for field in SHARE_FIELDS},
        )
        return {
            "tenant": tenant_summary(tenant, registry.key_prefix(tenant.id)),
            "api_key": api_key,
        }
    if command == "list":
        return {"tenants": [tenant_summary(t, registry.key_prefix(t.id)) for t in registry.list()]}
    if command == "rotate-key":
        api_key = registry.rotate_key(args.tenant_id)
        tenant = registry.get(args.tenant_id)
        return {
            "tenant": tenant_summary(tenant, registry.key_prefix(tenant.id)),
            "api_key": api_key,
        }
    if command == "limits":
        registry.get(args.tenant_id)
        return {"tenant_id": args.tenant_id, "limits": registry.limits(args.tenant_id).as_dict()}
    if command == "set-limits":
        limits = {name: getattr(args, name) for name in LIMIT_NAMES if name in args}
        if not limits:
            raise InvalidField(
                "set-limits needs at least one of --"
                + ", --".join(name.replace("_", "-") for name in LIMIT_NAMES)
            )
        changed = registry.set_limits(args.tenant_id, **limits)
        return {"tenant_id": args.tenant_id, "limits": changed.as_dict()}
    if command in ("disable", "enable"):
        tenant = registry.set_disabled(args.tenant_id, command == "disable")
    elif command == "set-models":
        tenant = registry.update(args.tenant_id, models=None if args.any_model else args.models)
    elif command == "set-share":
        share = {field: getattr(args, field) for field in SHARE_FIELDS if field in args}
        if not share:
            raise InvalidField(
                "set-share needs --weight, --max-queued, --max-concurrent or --max-priority"
            )
        tenant = registry.update(args.tenant_id, **share)
    else:  # set-quota
        quotas = {k: getattr(args, k) for k in ("quota_bytes", "quota_archives") if k in args}
        if not quotas:
            raise InvalidField("set-quota needs --bytes and/or --archives")
        tenant = registry.update(args.tenant_id, **quotas)
    return {"tenant": tenant_summary(tenant, registry.key_prefix(tenant.id))}


def _quota(text: str) -> int | None:
    """A quota from the command line: a whole number >= 0, or "none" for no limit."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number or 'none': {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a quota cannot be negative: {value}")
    return value


def _models(text: str) -> list[str]:
    """An allow list of models from the command line: names separated by commas."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one model name (or --any)")
    return names


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= MAX_WEIGHT:
        raise argparse.ArgumentTypeError(f"a weight is above 0 and at most 1000: {value}")
    return value


def _bound(text: str) -> int | None:
    """A bound on requests: a whole number >= 1, or "none" for the settings' default."""
    value = _quota(text)
    if value == 0:
        raise argparse.ArgumentTypeError("a bound on requests is at least 1")
    return value
