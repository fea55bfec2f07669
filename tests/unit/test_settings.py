"""Settings precedence (defaults < TOML < env < flags) and errors that name the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cacheproxy.settings import ConfigFileError, load_settings


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "cacheproxy.toml"
    path.write_text(
        'port = 7001\nhost = "127.0.0.2"\nupstreams = ["http://127.0.0.1:9001"]\n'
        "[managed]\nparallel = 3\nctx_size = 8192\n"
    )
    return path


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CACHEPROXY_PORT", "CACHEPROXY_UPSTREAMS", "CACHEPROXY_MANAGED__PARALLEL"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings()
    assert (settings.host, settings.port, settings.upstreams) == ("127.0.0.1", 8080, [])
    assert settings.managed.parallel == 4


def test_precedence(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_file = load_settings(config_file)
    assert (from_file.port, from_file.host, from_file.managed.parallel) == (7001, "127.0.0.2", 3)

    monkeypatch.setenv("CACHEPROXY_PORT", "7002")
    monkeypatch.setenv("CACHEPROXY_MANAGED__PARALLEL", "5")
    from_env = load_settings(config_file)
    assert (from_env.port, from_env.managed.parallel) == (7002, 5)
    assert from_env.managed.ctx_size == 8192  # untouched keys still come from the file

    from_flags = load_settings(config_file, port=7003, managed={"parallel": 6})
    assert (from_flags.port, from_flags.managed.parallel) == (7003, 6)
    assert from_flags.managed.ctx_size == 8192
    assert from_flags.host == "127.0.0.2"


def test_upstreams_from_env_as_list_or_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEPROXY_UPSTREAMS", "http://a:1, http://b:2/")
    assert load_settings().upstream_urls() == ["http://a:1", "http://b:2"]
    monkeypatch.setenv("CACHEPROXY_UPSTREAMS", '["http://c:3"]')
    assert load_settings().upstream_urls() == ["http://c:3"]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("port = 70000\n", "port"),
        ('port = "eighty"\n', "port"),
        ("portt = 1\n", "portt"),
        ('upstreams = ["not a url"]\n', "upstreams.0"),
        ("[managed]\nparallel = 0\n", "managed.parallel"),
        ("[managed]\nwhatever = 1\n", "managed.whatever"),
    ],
)
def test_bad_setting_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValidationError) as caught:
        load_settings(path)
    assert field in [".".join(map(str, error["loc"])) for error in caught.value.errors()]


def test_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="not found"):
        load_settings(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("port = [\n")
    with pytest.raises(ConfigFileError, match="not valid TOML"):
        load_settings(broken)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cacheproxy", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_check_config_prints_effective_settings(config_file: Path) -> None:
    result = run_cli("check-config", "--config", str(config_file), "--port", "7010", "-np", "2")
    assert result.returncode == 0, result.stderr
    effective = json.loads(result.stdout)
    assert effective["port"] == 7010
    assert effective["managed"]["parallel"] == 2
    assert effective["managed"]["ctx_size"] == 8192
    assert effective["upstreams"] == ["http://127.0.0.1:9001/"]


def test_check_config_rejects_a_bad_file_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[managed]\nparallel = -1\n")
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    assert "managed.parallel" in result.stderr


def test_serve_fails_at_start_up_on_a_bad_flag() -> None:
    result = run_cli("serve", "--port", "99999", "--upstream", "http://127.0.0.1:1")
    assert result.returncode == 2
    assert "port" in result.stderr


def test_example_config_documents_every_setting_at_its_default() -> None:
    import tomllib

    from pydantic import BaseModel

    from cacheproxy.settings import Settings

    example = Path(__file__).parents[2] / "config" / "cacheproxy.toml"
    text = example.read_text()
    values = tomllib.loads(text)
    defaults = Settings.model_construct().model_dump()
    for name, field in Settings.model_fields.items():
        section = field.annotation if isinstance(field.annotation, type) else None
        if section is not None and issubclass(section, BaseModel):
            assert f"[{name}]" in text, name
            for sub_name in section.model_fields:
                assert f"{sub_name} =" in text, f"{name}.{sub_name}"
                if sub_name in values[name]:
                    assert values[name][sub_name] == defaults[name][sub_name], f"{name}.{sub_name}"
            continue
        assert f"{name} =" in text, name
        if name in values:
            assert values[name] == defaults[name], name


def test_tenancy_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHEPROXY_TENANTS__DATABASE", raising=False)
    settings = load_settings(state_dir=tmp_path)
    assert settings.tenant_database() == tmp_path / "cacheproxy.db"
    assert settings.tenants.admin_api_key is None

    monkeypatch.setenv("CACHEPROXY_TENANTS__ADMIN_API_KEY", "k" * 16)
    monkeypatch.setenv("CACHEPROXY_TENANTS__DATABASE", str(tmp_path / "elsewhere.db"))
    settings = load_settings(state_dir=tmp_path)
    assert settings.tenant_database() == tmp_path / "elsewhere.db"
    assert settings.tenants.admin_api_key.get_secret_value() == "k" * 16

    monkeypatch.setenv("CACHEPROXY_TENANTS__ADMIN_API_KEY", "short")
    with pytest.raises(ValidationError) as caught:
        load_settings()
    assert caught.value.errors()[0]["loc"] == ("tenants", "admin_api_key")


def test_a_too_short_admin_key_is_named_with_its_rule_never_shown() -> None:
    secret = "Qh7-short-key"
    env = {**os.environ, "CACHEPROXY_TENANTS__ADMIN_API_KEY": secret}
    result = run_cli("serve", "--upstream", "http://127.0.0.1:1", env=env)
    assert result.returncode == 2
    assert "tenants.admin_api_key: must be at least 16 characters long" in result.stderr
    assert secret not in result.stderr + result.stdout


def test_validation_errors_mask_keys_in_other_values() -> None:
    # a bad port in an upstream URL that carries a password and a key in its query
    url = "http://user:Pw-Zr81x@127.0.0.1:99999/?api_key=Kq-77zXw"
    result = run_cli("check-config", "--upstream", url)
    assert result.returncode == 2
    assert "upstreams.0" in result.stderr
    assert "Pw-Zr81x" not in result.stderr and "Kq-77zXw" not in result.stderr


def test_str_of_a_validation_error_shows_no_secret() -> None:
    with pytest.raises(ValidationError) as caught:
        load_settings(tenants={"admin_api_key": "Qh7-short-key"}, upstream_api_key=["a list"])
    assert "Qh7-short-key" not in str(caught.value)


def test_upstream_save_paths_map_configured_upstreams(tmp_path: Path) -> None:
    path = tmp_path / "hosts.toml"
    path.write_text(
        'upstreams = ["http://10.0.0.2:8081/", "http://10.0.0.3:8081"]\n'
        '[disk]\ndirectory = "/srv/archive"\n'
        'upstream_save_paths = { "http://10.0.0.2:8081" = "/mnt/archive" }\n'
    )
    disk = load_settings(path).disk
    assert disk.save_path_of("http://10.0.0.2:8081", Path("/srv/archive")) == Path("/mnt/archive")
    # unmapped: the same path as the proxy's
    assert disk.save_path_of("http://10.0.0.3:8081", Path("/srv/archive")) == Path("/srv/archive")

    path.write_text(
        'upstreams = ["http://10.0.0.2:8081"]\n'
        '[disk]\nupstream_save_paths = { "http://10.0.0.9:8081" = "/mnt/archive" }\n'
    )
    with pytest.raises(ValidationError, match=r"10\.0\.0\.9:8081, not among `upstreams`"):
        load_settings(path)


def test_the_managed_servers_ram_cache_is_off_while_the_disk_tier_runs(tmp_path: Path) -> None:
    """Unset, the managed llama-server's `--cache-ram` is 0 beside the disk tier (which does its
    work, and tenants need it off) and llama-server's own default without it; given, as given."""
    state = {"state_dir": tmp_path}
    assert load_settings(**state).managed_settings().cache_ram_mib == 0
    without_disk = load_settings(**state, disk={"enabled": False})
    assert without_disk.managed_settings().cache_ram_mib is None  # no flag: the server's default
    given = load_settings(**state, managed={"cache_ram_mib": 8192})
    assert given.managed_settings().cache_ram_mib == 8192
    assert load_settings(**state).managed.cache_ram_mib is None  # the setting itself unchanged
