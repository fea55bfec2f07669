"""The sliding window a GGUF file declares, read from its metadata alone, and the managed
llama-server's `--swa-full` that follows from it (tested on the test bed's generated models)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from cacheproxy.provision.make_model import SIZES, ensure_model
from cacheproxy.settings import ManagedServerSettings
from cacheproxy.upstreams.managed import SWA_FULL, with_full_window
from cacheproxy.upstreams.model_file import NotGguf, sliding_window


@pytest.fixture(scope="module")
def swa_model() -> Path:
    return ensure_model("swa")


@pytest.fixture(scope="module")
def llama_model() -> Path:
    return ensure_model("small")


def test_the_window_is_the_architectures_own_key(swa_model: Path, llama_model: Path) -> None:
    assert sliding_window(swa_model) == SIZES["swa"].sliding_window == 64
    assert sliding_window(llama_model) == 0
    # what gguf's own reader finds in the file
    reader = gguf.GGUFReader(swa_model)
    assert reader.fields["gemma2.attention.sliding_window"].contents() == 64


def test_another_architectures_window_is_not_this_ones(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("gemma2.attention.sliding_window", 512)  # a stray key of another arch
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert sliding_window(path) == 0


def test_a_file_that_is_not_a_model_is_refused(swa_model: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(NotGguf):
        sliding_window(text)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(swa_model.read_bytes()[:4096])  # ends inside the vocabulary
    with pytest.raises(NotGguf):
        sliding_window(cut)


def test_the_managed_server_gets_the_full_window_while_the_disk_tier_runs(
    swa_model: Path, llama_model: Path, tmp_path: Path
) -> None:
    settings = ManagedServerSettings()
    assert with_full_window(settings, swa_model, disk_tier=True).extra_args == [SWA_FULL]
    # not without the disk tier (llama-server's RAM cache keeps its checkpoints), not twice,
    # not for a model without a window, not for a file llama-server will refuse itself
    assert with_full_window(settings, swa_model, disk_tier=False).extra_args == []
    given = ManagedServerSettings(extra_args=["--swa-full", "-t", "2"])
    assert with_full_window(given, swa_model, disk_tier=True).extra_args == given.extra_args
    assert with_full_window(settings, llama_model, disk_tier=True).extra_args == []
    missing = tmp_path / "missing.gguf"
    assert with_full_window(settings, missing, disk_tier=True).extra_args == []
    assert with_full_window(settings, None, disk_tier=True).extra_args == []


def test_a_router_gets_the_full_window_when_one_of_its_models_has_one(
    swa_model: Path, llama_model: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "models"
    (folder / "gemma").mkdir(parents=True)
    (folder / "llama.gguf").symlink_to(llama_model)
    router = ManagedServerSettings(models_dir=folder)
    assert with_full_window(router, None, disk_tier=True).extra_args == []
    (folder / "llama").mkdir()
    (folder / "llama" / "model.gguf").symlink_to(llama_model)
    # a model in a sub-folder, its file named as another's
    (folder / "gemma" / "model.gguf").symlink_to(swa_model)
    assert with_full_window(router, None, disk_tier=True).extra_args == [SWA_FULL]
    # a router named by a preset file only: its models are not read
    preset = ManagedServerSettings(models_preset=tmp_path / "models.ini")
    assert with_full_window(preset, None, disk_tier=True).extra_args == []
