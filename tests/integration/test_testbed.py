"""The test bed: the generated model has the shape asked for, and cached artefacts are reused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from cacheproxy.provision import cache
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import (
    CHAT_TEMPLATE,
    SIZES,
    ModelShape,
    ensure_model,
    server_args,
    write_model,
)


def field(reader: gguf.GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


def test_small_model_has_the_documented_shape(tiny_model: Path) -> None:
    reader = gguf.GGUFReader(tiny_model)
    shape = SIZES["small"]
    assert field(reader, "general.architecture") == "llama"
    assert field(reader, "llama.embedding_length") == shape.n_embd
    assert field(reader, "llama.block_count") == shape.n_layer
    assert field(reader, "llama.attention.head_count_kv") == shape.n_head_kv
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 32000
    assert field(reader, "tokenizer.ggml.add_bos_token") is True
    # 4 layers x (K + V) x 2 heads x 32 dims x 2 bytes: about 1 KiB of KV state per token
    kv_bytes_per_token = shape.n_layer * 2 * shape.n_head_kv * (shape.n_embd // shape.n_head) * 2
    assert kv_bytes_per_token == 1024


def test_kv_heavy_model_carries_64_kib_of_kv_per_token_with_its_cache_type() -> None:
    shape = SIZES["kv-heavy"]
    assert shape.kv_bytes_per_token == 64 * 1024  # 2 x 16 layers x 4 heads x 128 x 4 bytes
    assert server_args("kv-heavy") == ("--cache-type-k", "f32", "--cache-type-v", "f32")
    assert server_args("small") == ()


def test_model_of_any_shape_can_be_written(tmp_path: Path) -> None:
    shape = ModelShape(n_embd=64, n_layer=1, n_head=2, n_head_kv=1, n_ff=128, seed=7)
    path = tmp_path / "m.gguf"
    write_model(shape, path)
    reader = gguf.GGUFReader(path)
    assert field(reader, "llama.embedding_length") == 64
    assert {tensor.name for tensor in reader.tensors} >= {
        "token_embd.weight",
        "blk.0.ffn_down.weight",
    }
    assert not path.with_suffix(".partial").exists()


def test_cached_artefacts_are_reused(tiny_model: Path, llama_server_binary: Path) -> None:
    model_mtime = tiny_model.stat().st_mtime_ns
    binary_mtime = llama_server_binary.stat().st_mtime_ns
    assert ensure_model("small") == tiny_model
    assert ensure_llama_server() == llama_server_binary
    assert tiny_model.stat().st_mtime_ns == model_mtime
    assert llama_server_binary.stat().st_mtime_ns == binary_mtime


def test_cache_folder_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CACHEPROXY_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("CACHEPROXY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "cacheproxy"
