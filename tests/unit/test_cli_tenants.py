"""`cacheproxy tenants ...` as a person runs it: subprocesses on a temporary database file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cacheproxy.tenancy.registry import TenantRegistry


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "cacheproxy.toml"
    path.write_text(f'[tenants]\ndatabase = "{tmp_path / "tenants.db"}"\n')
    return path


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cacheproxy", "tenants", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def ok(*args: str) -> Any:
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def refused(*args: str) -> dict[str, str]:
    result = cli(*args)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == ""
    return json.loads(result.stderr)["error"]


def test_create_list_and_authenticate(config: Path, tmp_path: Path) -> None:
    created = ok(
        "create", "acme", "--quota-bytes", "1000", "--quota-archives", "7", "--config", str(config)
    )
    tenant = created["tenant"]
    assert (tenant["name"], tenant["quota_bytes"], tenant["quota_archives"]) == ("acme", 1000, 7)
    assert tenant["may_use_public_prefixes"] and not tenant["hide_cache_signals"]
    hidden = ok(
        "create", "globex", "--hide-cache-signals", "--no-public-prefixes", "--config", str(config)
    )["tenant"]
    assert hidden["hide_cache_signals"] and not hidden["may_use_public_prefixes"]

    assert ok("list", "--config", str(config)) == {"tenants": [tenant, hidden]}
    with TenantRegistry(tmp_path / "tenants.db") as registry:
        assert registry.authenticate(created["api_key"]).id == tenant["id"]


def test_disable_enable_rotate_and_set_quota(config: Path, tmp_path: Path) -> None:
    created = ok("create", "acme", "--config", str(config))
    tenant_id = created["tenant"]["id"]
    with TenantRegistry(tmp_path / "tenants.db") as registry:  # as a running proxy would
        assert ok("disable", tenant_id, "--config", str(config))["tenant"]["disabled"]
        assert registry.authenticate(created["api_key"]) is None
        assert not ok("enable", tenant_id, "--config", str(config))["tenant"]["disabled"]
        assert registry.authenticate(created["api_key"]) is not None

        rotated = ok("rotate-key", tenant_id, "--config", str(config))
        assert rotated["api_key"] != created["api_key"]
        assert registry.authenticate(created["api_key"]) is None
        assert registry.authenticate(rotated["api_key"]).id == tenant_id

    quotas = ok(
        "set-quota", tenant_id, "--bytes", "500", "--archives", "3", "--config", str(config)
    )
    assert (quotas["tenant"]["quota_bytes"], quotas["tenant"]["quota_archives"]) == (500, 3)
    quotas = ok("set-quota", tenant_id, "--bytes", "none", "--config", str(config))
    assert (quotas["tenant"]["quota_bytes"], quotas["tenant"]["quota_archives"]) == (None, 3)


def test_refusals(config: Path) -> None:
    tenant_id = ok("create", "acme", "--config", str(config))["tenant"]["id"]
    assert refused("create", "ACME", "--config", str(config))["type"] == "duplicate_name"
    assert refused("create", "two words", "--config", str(config))["type"] == "invalid_field"
    for command in ("disable", "enable", "rotate-key"):
        assert refused(command, "t_0000000000000000", "--config", str(config))["type"] == (
            "unknown_tenant"
        )
    assert refused("set-quota", tenant_id, "--config", str(config))["type"] == "invalid_field"

    for bad in ("-1", "lots", "1.5"):
        result = cli("set-quota", tenant_id, "--bytes", bad, "--config", str(config))
        assert result.returncode == 2 and "--bytes" in result.stderr, bad
    assert len(ok("list", "--config", str(config))["tenants"]) == 1


def test_bad_or_missing_config(tmp_path: Path) -> None:
    result = cli("list", "--config", str(tmp_path / "missing.toml"))
    assert result.returncode == 2 and "not found" in result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants]\nadmin_api_key = 'short'\n")
    result = cli("list", "--config", str(bad))
    assert result.returncode == 2 and "tenants.admin_api_key" in result.stderr


def test_default_database_is_in_the_state_dir(tmp_path: Path) -> None:
    env = {**os.environ, "CACHEPROXY_STATE_DIR": str(tmp_path / "state")}
    env.pop("CACHEPROXY_TENANTS__DATABASE", None)
    result = cli("create", "acme", env=env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "state" / "cacheproxy.db").exists()


def test_create_and_set_share(config: Path) -> None:
    created = ok(
        "create", "acme", "--weight", "2", "--max-concurrent", "4", "--config", str(config)
    )
    tenant = created["tenant"]
    assert (tenant["weight"], tenant["max_concurrent"], tenant["max_queued"]) == (2.0, 4, None)
    assert tenant["max_priority"] == "interactive"
    tenant_id = tenant["id"]
    changed = ok(
        "set-share", tenant_id, "--max-queued", "10", "--max-priority", "batch",
        "--config", str(config),
    )["tenant"]  # fmt: skip
    # what was not given is left as it was
    assert (changed["weight"], changed["max_concurrent"], changed["max_queued"]) == (2.0, 4, 10)
    assert changed["max_priority"] == "batch"
    cleared = ok("set-share", tenant_id, "--max-concurrent", "none", "--config", str(config))
    assert cleared["tenant"]["max_concurrent"] is None
    assert refused("set-share", tenant_id, "--config", str(config))["type"] == "invalid_field"
    for option, bad in (("--weight", "0"), ("--weight", "x"), ("--max-queued", "0")):
        result = cli("set-share", tenant_id, option, bad, "--config", str(config))
        assert result.returncode == 2 and option in result.stderr, (option, bad)


def test_set_and_show_limits(config: Path, tmp_path: Path) -> None:
    tenant_id = ok("create", "acme", "--config", str(config))["tenant"]["id"]
    empty = dict.fromkeys(
        (
            "requests_per_minute",
            "prompt_tokens_per_minute",
            "generated_tokens_per_minute",
            "tokens_per_day",
            "tokens_per_month",
        )
    )
    assert ok("limits", tenant_id, "--config", str(config))["limits"] == empty
    changed = ok(
        "set-limits",
        tenant_id,
        "--requests-per-minute",
        "60",
        "--tokens-per-day",
        "1000",
        "--config",
        str(config),
    )
    assert changed["limits"] == {**empty, "requests_per_minute": 60, "tokens_per_day": 1000}
    cleared = ok("set-limits", tenant_id, "--tokens-per-day", "none", "--config", str(config))
    assert cleared["limits"] == {**empty, "requests_per_minute": 60}
    with TenantRegistry(tmp_path / "tenants.db") as registry:  # as a running proxy reads them
        assert registry.limits(tenant_id).requests_per_minute == 60
    assert refused("set-limits", tenant_id, "--config", str(config))["type"] == "invalid_field"
    assert refused("limits", "t_0000000000000000", "--config", str(config))["type"] == (
        "unknown_tenant"
    )
    result = cli("set-limits", tenant_id, "--requests-per-minute", "-1", "--config", str(config))
    assert result.returncode == 2 and "--requests-per-minute" in result.stderr


def test_create_with_models_and_set_models(config: Path) -> None:
    created = ok("create", "acme", "--models", "alpha, beta", "--config", str(config))
    tenant_id = created["tenant"]["id"]
    assert created["tenant"]["models"] == ["alpha", "beta"]
    changed = ok("set-models", tenant_id, "--models", "gamma", "--config", str(config))
    assert changed["tenant"]["models"] == ["gamma"]
    assert ok("set-models", tenant_id, "--any", "--config", str(config))["tenant"]["models"] is None
    result = cli("set-models", tenant_id, "--config", str(config))
    assert result.returncode == 2 and "--models" in result.stderr
    result = cli("set-models", tenant_id, "--models", " , ", "--config", str(config))
    assert result.returncode == 2 and "at least one model" in result.stderr
