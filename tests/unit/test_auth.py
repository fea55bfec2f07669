"""Each route's rule for who a request acts for (tenancy/auth.py `Callers`), against a real
registry file."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from cacheproxy.errors import ApiError
from cacheproxy.tenancy.auth import NOBODY, SINGLE_USER, Callers
from cacheproxy.tenancy.registry import TenantRegistry


def status_of(resolve) -> int:  # noqa: ANN001 - a call that raises ApiError
    with pytest.raises(ApiError) as refused:
        resolve()
    return refused.value.status


def test_before_tenants_everyone_is_the_single_user_with_one_of_its_keys(tmp_path: Path) -> None:
    with TenantRegistry(tmp_path / "tenants.db") as registry:
        open_door = Callers(registry)
        assert open_door.resolve({}) is SINGLE_USER
        assert open_door.resolve_operator({}) is SINGLE_USER
        keyed = Callers(registry, lambda: ["the-key"])
        assert keyed.resolve({"X-Api-Key": "the-key"}) is SINGLE_USER
        assert status_of(lambda: keyed.resolve({"Authorization": "Bearer other"})) == 401
        assert status_of(lambda: keyed.resolve_operator({})) == 401
        assert keyed.resolve_open() is SINGLE_USER  # /health, a CORS preflight: no key
        assert SINGLE_USER.forward_client_key and not SINGLE_USER.tenants_exist


def test_once_tenants_exist_a_key_names_one_and_the_admin_reads_the_metrics(
    tmp_path: Path,
) -> None:
    with TenantRegistry(tmp_path / "tenants.db") as registry:
        tenant, key = registry.create("acme")
        callers = Callers(registry, lambda: ["the-key"], SecretStr("admin-key"))
        caller = callers.resolve({"Authorization": f"Bearer {key}"})
        assert (caller.tenant, caller.tenants_exist, caller.forward_client_key) == (
            tenant,
            True,
            False,
        )
        assert status_of(lambda: callers.resolve({"X-Api-Key": "the-key"})) == 401
        assert status_of(lambda: callers.resolve({})) == 401
        assert callers.resolve_open() is NOBODY
        assert callers.resolve_operator({"Authorization": "Bearer admin-key"}) is NOBODY
        assert (
            status_of(lambda: callers.resolve_operator({"Authorization": f"Bearer {key}"})) == 401
        )
        no_admin = Callers(registry)
        assert status_of(lambda: no_admin.resolve_operator({})) == 403  # the admin API is off


def test_a_tenants_caller_is_kept_until_its_registry_entry_changes(tmp_path: Path) -> None:
    """A tenant's requests share one caller (none is made per request); a change to the tenant
    (a new snapshot, a new object) gives a new one with the new flags."""
    with TenantRegistry(tmp_path / "tenants.db") as registry:
        tenant, key = registry.create("acme")
        callers = Callers(registry)
        headers = {"Authorization": f"Bearer {key}"}
        first = callers.resolve(headers)
        assert callers.resolve(headers) is first
        assert not first.hide_cache_signals and first.may_use_public_prefixes
        registry.update(tenant.id, hide_cache_signals=True, may_use_public_prefixes=False)
        changed = callers.resolve(headers)
        assert changed is not first and changed.tenant is not None
        assert changed.tenant.id == tenant.id
        assert changed.hide_cache_signals and not changed.may_use_public_prefixes
