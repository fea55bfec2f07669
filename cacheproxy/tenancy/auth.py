"""Who is asking: the API key a request presents, and the tenant it belongs to.

Keys are read as llama-server reads them (`Authorization`, with or without `Bearer `, else
`X-Api-Key`), and failures answer as llama-server does: 401 "Invalid API Key".
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence

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


def resolve_tenant(
    registry: TenantRegistry,
    headers: Mapping[str, str],
    single_user_keys: Callable[[], Sequence[str]] = tuple,
) -> Tenant:
    """The tenant a request acts for; raises a 401 `ApiError` for a missing or bad key.

    While the registry holds no tenants everyone is `DEFAULT_TENANT`: with `single_user_keys`
    (asked only then) a request must present one of them (as llama-server checks its
    --api-key), without any no key is needed, so a single user runs the proxy without setting
    anything up.
    """
    if not registry.has_tenants():
        keys = single_user_keys()
        if keys and not _one_of(presented_api_key(headers), keys):
            raise invalid_api_key()
        return DEFAULT_TENANT
    key = presented_api_key(headers)
    tenant = registry.authenticate(key) if key is not None else None
    if tenant is None:
        raise invalid_api_key()
    return tenant


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
