"""Finding a headless Chromium on a PATH made for the test (tiny executable scripts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cacheproxy.provision import chromium
from cacheproxy.provision.chromium import ChromiumUnavailable, find_chromium


def executable(folder: Path, name: str, mode: int = 0o755) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(mode)
    return path


@pytest.fixture(autouse=True)
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(chromium.ENV_OVERRIDE, raising=False)


def test_nothing_on_the_path(tmp_path: Path) -> None:
    executable(tmp_path / "bin", "firefox")
    assert find_chromium(str(tmp_path / "bin")) is None


def test_any_chromium_family_binary_is_found(tmp_path: Path) -> None:
    shell = executable(tmp_path / "bin", "chromium-headless-shell")
    assert find_chromium(str(tmp_path / "bin")) == shell


def test_first_by_preference_then_by_path_order(tmp_path: Path) -> None:
    chrome = executable(tmp_path / "a", "google-chrome")
    debian = executable(tmp_path / "b", "chromium")
    search = os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")])
    assert find_chromium(search) == debian  # Debian's package over Chrome, wherever it is
    other = executable(tmp_path / "c", "chromium")
    search = os.pathsep.join([str(tmp_path / "c"), str(tmp_path / "b")])
    assert find_chromium(search) == other  # the same name: the first folder on PATH wins
    assert chrome.exists()


def test_a_file_that_is_not_executable_does_not_count(tmp_path: Path) -> None:
    executable(tmp_path / "bin", "chromium", mode=0o644)
    assert find_chromium(str(tmp_path / "bin")) is None


def test_the_override_wins_and_must_be_executable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executable(tmp_path / "bin", "chromium")
    mine = executable(tmp_path / "elsewhere", "my-chrome")
    monkeypatch.setenv(chromium.ENV_OVERRIDE, str(mine))
    assert find_chromium(str(tmp_path / "bin")) == mine
    monkeypatch.setenv(chromium.ENV_OVERRIDE, str(tmp_path / "missing"))
    with pytest.raises(ChromiumUnavailable, match="not an executable"):
        find_chromium(str(tmp_path / "bin"))


def test_without_chromium_or_apt_get_the_error_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no Chromium and no apt-get on PATH: nothing can be installed, the error names the fix
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CACHEPROXY_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ChromiumUnavailable, match="apt-get install chromium"):
        chromium.ensure_chromium()
