"""The tenant registry's records (a tenant, a public prefix, an API key) and what their fields
may hold, checked before a change writes anything.

The bounds are the database's (SQLite's INTEGER range, PostgreSQL's BIGINT) and the proxy's
(a priority class it knows, a token id llama-server accepts); the admin API's body models and
the command line's options use the same constants, so every way in refuses the same values.
A refused value raises `InvalidField` and nothing is written.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Any

from cacheproxy.tenancy.limits import LIMIT_NAMES

API_KEY_PREFIX = "cpk_"
# "cpk_" and the first 8 characters of the random part: enough to tell keys apart in a listing,
# far too little to help guess the other 35.
KEY_DISPLAY_CHARS = len(API_KEY_PREFIX) + 8
# longer than any key we issue; anything longer is rejected before hashing
MAX_API_KEY_CHARS = 256

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_QUOTA = (1 << 63) - 1  # SQLite's INTEGER range, PostgreSQL's BIGINT
MAX_TOKEN_ID = (1 << 31) - 1
MAX_PUBLIC_PREFIX_TOKENS = 1 << 18

MAX_WEIGHT = 1000.0
PRIORITY_CLASSES = ("interactive", "batch")  # the highest first

TENANT_FIELDS = ("disabled", "hide_cache_signals", "may_use_public_prefixes")
QUOTA_FIELDS = ("quota_bytes", "quota_archives")
# fair share: weight, and the bounds that default to the scheduling settings when null
SHARE_FIELDS = ("weight", "max_queued", "max_concurrent", "max_priority")
UPDATABLE_FIELDS = ("name", *TENANT_FIELDS, *QUOTA_FIELDS, *SHARE_FIELDS, "models")
# a tenant's allow list of models: names as the upstreams list them (a router's model names may
# hold "/" and ":", as Hugging Face repositories do)
MAX_MODELS = 256
MAX_MODEL_NAME_CHARS = 256


class RegistryError(Exception):
    """A change the registry refused; nothing was written."""


class InvalidField(RegistryError, ValueError):
    pass


@dataclass(frozen=True)
class Tenant:
    id: str  # opaque ("t_" + 16 hex), never derived from the name: names appear in no file or label
    name: str
    disabled: bool
    hide_cache_signals: bool  # show this tenant every answer as an uncached run would be
    may_use_public_prefixes: bool
    quota_bytes: int | None  # archive bytes on disk; None: no limit
    quota_archives: int | None  # archived states; None: no limit
    weight: float = 1.0  # its share of the slots against other waiting tenants'
    max_queued: int | None = None  # requests it may have waiting; None: the setting's default
    max_concurrent: int | None = None  # requests in the proxy at once; None: the setting's
    max_priority: str = "interactive"  # the highest class its requests may ask for
    # the models it may use, by name as the upstreams list them (ids or aliases); None: any
    models: tuple[str, ...] | None = None


@dataclass(frozen=True)
class PublicPrefix:
    id: str  # opaque ("pp_" + 16 hex)
    name: str
    tokens: list[int]


def tenant_summary(tenant: Tenant, key_prefix: str | None) -> dict[str, Any]:
    """A tenant as the admin API and the CLI print it."""
    return {**asdict(tenant), "key_prefix": key_prefix}


def hash_api_key(api_key: str) -> str:
    # A plain sha256 suffices because every key is 32 random bytes: there is nothing to brute-force
    # that a slow, salted hash would protect (unlike a human-chosen password).
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def shown(value: object, limit: int = 80) -> str:
    """A value for an error message, cut short: messages must not echo arbitrary input whole."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def valid_name(field: str, value: object) -> str:
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise InvalidField(
            f"{field} must be 1-64 characters of A-Z a-z 0-9 _ . - (got {shown(value)})"
        )
    return value


def valid_quota(field: str, value: object) -> int | None:
    return _whole_number_or_none(field, value, lowest=0)


def _whole_number_or_none(field: str, value: object, lowest: int) -> int | None:
    if value is None:
        return None
    # bool is an int in Python; a quota of True is a mistake, not 1
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= MAX_QUOTA:
        raise InvalidField(
            f"{field} must be a whole number from {lowest} to {MAX_QUOTA}, or null"
            f" (got {shown(value)})"
        )
    return value


def valid_share(field: str, value: object) -> float | int | str | None:
    """A fair-share field: weight in (0, 1000], a bound >= 1 or None, a priority class."""
    if field == "weight":
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value <= MAX_WEIGHT
        ):
            raise InvalidField(
                f"weight must be a number above 0, at most 1000 (got {shown(value)})"
            )
        return float(value)
    if field == "max_priority":
        if value not in PRIORITY_CLASSES:
            raise InvalidField(
                f"max_priority must be one of {', '.join(PRIORITY_CLASSES)} (got {shown(value)})"
            )
        return value
    return _whole_number_or_none(field, value, lowest=1)


def valid_models(value: object) -> tuple[str, ...] | None:
    """An allow list of models: up to `MAX_MODELS` names, or None (any model)."""
    if value is None:
        return None
    if (
        not isinstance(value, list | tuple)
        or len(value) > MAX_MODELS
        or not all(
            isinstance(name, str)
            and 0 < len(name) <= MAX_MODEL_NAME_CHARS
            and name.isprintable()
            and name == name.strip()
            for name in value
        )
    ):
        raise InvalidField(
            f"models must be a list of up to {MAX_MODELS} model names (1-{MAX_MODEL_NAME_CHARS}"
            f" printable characters, no surrounding spaces), or null for any model"
            f" (got {shown(value)})"
        )
    return tuple(dict.fromkeys(value))  # in order, each once


def models_column(models: tuple[str, ...] | None) -> str | None:
    """How the registry stores an allow list: a JSON array, or NULL (any model)."""
    return None if models is None else json.dumps(list(models))


def valid_flag(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidField(f"{field} must be true or false (got {shown(value)})")
    return value


def valid_tokens(value: object) -> list[int]:
    if (
        not isinstance(value, list)
        or not 1 <= len(value) <= MAX_PUBLIC_PREFIX_TOKENS
        or not all(
            isinstance(token, int) and not isinstance(token, bool) and 0 <= token <= MAX_TOKEN_ID
            for token in value
        )
    ):
        raise InvalidField(
            f"tokens must be a list of 1 to {MAX_PUBLIC_PREFIX_TOKENS} token ids "
            f"(whole numbers from 0 to {MAX_TOKEN_ID})"
        )
    return list(value)


def valid_new_tenant(
    name: object,
    quota_bytes: object,
    quota_archives: object,
    hide_cache_signals: object,
    may_use_public_prefixes: object,
    share: dict[str, object],
) -> dict[str, object]:
    """A new tenant's row (without id, `disabled` and creation time), every field checked.
    `share`: any of `SHARE_FIELDS`, and `models`, its allow list (None: any model)."""
    share = dict(share)
    models = share.pop("models", None)
    unknown = sorted(set(share) - set(SHARE_FIELDS))
    if unknown:
        raise InvalidField(f"unknown field(s) {', '.join(map(shown, unknown))}")
    return {
        **{field: valid_share(field, value) for field, value in share.items()},
        "name": valid_name("name", name),
        "quota_bytes": valid_quota("quota_bytes", quota_bytes),
        "quota_archives": valid_quota("quota_archives", quota_archives),
        "hide_cache_signals": int(valid_flag("hide_cache_signals", hide_cache_signals)),
        "may_use_public_prefixes": int(
            valid_flag("may_use_public_prefixes", may_use_public_prefixes)
        ),
        "models": models_column(valid_models(models)),
    }


def valid_changes(fields: dict[str, object]) -> dict[str, object]:
    """The columns an update of `UPDATABLE_FIELDS` sets; quotas and share bounds may be None."""
    unknown = sorted(set(fields) - set(UPDATABLE_FIELDS))
    if unknown:
        raise InvalidField(
            f"cannot update {', '.join(map(shown, unknown))}; "
            f"updatable: {', '.join(UPDATABLE_FIELDS)}"
        )
    changes: dict[str, object] = {}
    for field, value in fields.items():
        if field == "name":
            changes[field] = valid_name(field, value)
        elif field in QUOTA_FIELDS:
            changes[field] = valid_quota(field, value)
        elif field in SHARE_FIELDS:
            changes[field] = valid_share(field, value)
        elif field == "models":
            changes[field] = models_column(valid_models(value))
        else:
            changes[field] = int(valid_flag(field, value))  # 0/1 columns on both backends
    return changes


def valid_limits(limits: dict[str, object]) -> dict[str, int | None]:
    """Changes of a tenant's own limits (`LIMIT_NAMES`); None: the default applies."""
    unknown = sorted(set(limits) - set(LIMIT_NAMES))
    if unknown:
        raise InvalidField(
            f"cannot set {', '.join(map(shown, unknown))}; limits: {', '.join(LIMIT_NAMES)}"
        )
    return {name: valid_quota(name, value) for name, value in limits.items()}
