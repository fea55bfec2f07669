"""Who is asking: the API key a request presents, and the tenant it belongs to, resolved once
per request as its `Caller`.

Keys are read as llama-server reads them (`Authorization`, with or without `Bearer `, else
`X-Api-Key`), and failures answer as llama-server does: 401 "Invalid API Key".
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import SecretStr

from cacheproxy.errors import ApiError
from cacheproxy.tenancy.registry import DEFAULT_TENANT, TenantRegistry
from cacheproxy.tenancy.registry_records import Tenant

INVALID_API_KEY = "Invalid API Key"  # llama-server's own message, so clients see one wording


def presented_api_key(headers: Mapping[str, str]) -> str | None:
    """The key in `Authorization` (an optional `Bearer ` stripped) or else in `X-Api-Key`."""
    key = headers.get("Authorization", "").strip() or headers.get("X-Api-Key", "").strip()
    scheme, _, rest = key.partition(" ")
    if scheme.lower() == "bearer":
        key = rest.strip()
    return key or None


def invalid_api_key() -> ApiError:
    return ApiError(401, INVALID_API_KEY, "authentication_error")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request acts for, resolved once as its route starts (`Callers`) and carried along
    the request path, which reads it instead of asking the registry again."""

    tenant: Tenant | None  # None: nobody's (a route open without a key, the admin's metrics)
    tenants_exist: bool  # once they do, slots and slot actions close and metrics need the admin
    forward_client_key: bool  # the client's key goes upstream: only while no tenants exist
    hide_cache_signals: bool  # the tenant's answers shown as an uncached run's would be
    may_use_public_prefixes: bool
    # the models the tenant may use, by name (None: any)
    allowed_models: frozenset[str] | None = None

    @classmethod
    def acting_for(cls, tenant: Tenant, tenants_exist: bool) -> Caller:
        return cls(
            tenant,
            tenants_exist,
            forward_client_key=not tenants_exist,
            hide_cache_signals=tenant.hide_cache_signals,
            may_use_public_prefixes=tenant.may_use_public_prefixes,
            allowed_models=None if tenant.models is None else frozenset(tenant.models),
        )


# everyone, while the registry holds no tenants
SINGLE_USER = Caller.acting_for(DEFAULT_TENANT, tenants_exist=False)
# a request that acts for no tenant once tenants exist: an open route, or the admin
NOBODY = Caller(
    None, True, forward_client_key=False, hide_cache_signals=False, may_use_public_prefixes=False
)


class Callers:
    """Resolves who each request acts for, once per request, each route by its own rule:

    - `resolve`: a tenant's key once tenants exist (401 otherwise); before, one of the single
      user's keys when there are any (as llama-server checks its --api-key), else none;
    - `resolve_open`: no key (`/health`, a CORS preflight), as llama-server answers them;
    - `resolve_operator`: the admin key once tenants exist (metrics show every tenant's
      figures); before, as `resolve`.

    Each asks the registry whether tenants exist exactly once. A tenant's `Caller` is kept
    with the registry's tenant object it was made from, so a request allocates none."""

    MAX_KEPT = 1024  # tenants' callers kept; a new snapshot's objects replace the old ones'

    def __init__(
        self,
        registry: TenantRegistry,
        single_user_keys: Callable[[], Sequence[str]] = tuple,
        admin_key: SecretStr | None = None,
    ) -> None:
        self.registry = registry
        self.single_user_keys = single_user_keys  # asked for only while there are no tenants
        self.admin_key = admin_key
        self._kept: dict[int, tuple[Tenant, Caller]] = {}

    def resolve(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a route that needs a key; raises a 401 `ApiError` for a missing or
        bad one. Its `tenant` is always set."""
        registry = self.registry
        if not registry.has_tenants():
            self._check_single_user_key(headers)
            return SINGLE_USER
        key = presented_api_key(headers)
        tenant = registry.authenticate(key) if key is not None else None
        if tenant is None:
            raise invalid_api_key()
        kept = self._kept.get(id(tenant))
        if kept is None or kept[0] is not tenant:
            if len(self._kept) >= self.MAX_KEPT:
                self._kept.clear()
            kept = self._kept[id(tenant)] = (tenant, Caller.acting_for(tenant, True))
        return kept[1]

    def resolve_open(self) -> Caller:
        """The caller of a route open without a key."""
        return NOBODY if self.registry.has_tenants() else SINGLE_USER

    def resolve_operator(self, headers: Mapping[str, str]) -> Caller:
        """The caller of a route that shows every tenant's figures (metrics)."""
        if self.registry.has_tenants():
            check_admin_key(headers, self.admin_key)
            return NOBODY
        self._check_single_user_key(headers)
        return SINGLE_USER

    def _check_single_user_key(self, headers: Mapping[str, str]) -> None:
        keys = self.single_user_keys()
        if keys and not _one_of(presented_api_key(headers), keys):
            raise invalid_api_key()


def check_admin_key(headers: Mapping[str, str], admin_key: SecretStr | None) -> None:
    """Raise unless the request presents the admin key (403 when no admin key is set)."""
    if admin_key is None:
        # as llama-server answers for a feature it was started without
        raise ApiError(
            403, "the admin API is disabled: set tenants.admin_api_key", "permission_error"
        )
    presented = presented_api_key(headers)
    # compare digests, so neither the key's length nor its content shows in the timing
    expected = _digest(admin_key.get_secret_value())
    if presented is None or not hmac.compare_digest(_digest(presented), expected):
        raise invalid_api_key()


def _one_of(presented: str | None, keys: Sequence[str]) -> bool:
    """Whether `presented` is one of `keys`, compared by digest (no timing shows which, or how
    much of one, matched)."""
    if presented is None:
        return False
    digest = _digest(presented)
    return any(hmac.compare_digest(digest, _digest(key)) for key in keys)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
