"""The fingerprint's facts: the model's content and the KV layout, nothing local to a host."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from cacheproxy.disk.fingerprint import compatibility_fingerprint, fingerprint_facts
from cacheproxy.disk.slot_file import SlotFileError, encode_slot_file, read_kv_layout

F16, Q8_0 = 1, 8


def props(model_path: str) -> dict:
    return {
        "model_path": model_path,
        "model_alias": model_path,
        "build_info": "b1-abc",
        "total_slots": 2,
        "default_generation_settings": {"n_ctx": 4096},
    }


def models(model_path: str) -> dict:
    meta = {"n_vocab": 32000, "n_embd": 128, "n_params": 1000, "size": 5000, "n_ctx_train": 512}
    return {"data": [{"id": model_path, "aliases": [model_path], "meta": meta}]}


def facts(model_path: str, kv_layout: str = "k=1:256") -> dict:
    slots = [{"id": 0, "n_ctx": 4096}, {"id": 1, "n_ctx": 4096}]
    return fingerprint_facts(
        props(model_path), models(model_path), slots, 2, "behaviour", kv_layout
    )


def test_the_model_files_path_changes_nothing() -> None:
    here, there = facts("/srv/models/m.gguf"), facts("/mnt/other/copy-of-m.gguf")
    assert compatibility_fingerprint(here) == compatibility_fingerprint(there)


def test_the_kv_layout_changes_the_fingerprint() -> None:
    f16, q8 = facts("/m.gguf", "k=1:256"), facts("/m.gguf", "k=8:136")
    assert compatibility_fingerprint(f16) != compatibility_fingerprint(q8)


def kv_state(cells: int, k_type: int, k_row: int, v_type: int, v_row: int, layers: int) -> bytes:
    """One non-empty stream of a sequence save, laid out as `llama_kv_cache::state_write`."""
    state = struct.pack("<II", 2, 0) + struct.pack("<I", cells)  # 2 streams, the first empty
    state += b"".join(struct.pack("<iIi", pos, 1, 1) for pos in range(cells))
    state += struct.pack("<IIII", 0, layers, 0, 0)  # v not transposed, layers, n_rot_k/v
    for _ in range(layers):
        state += struct.pack("<iQ", k_type, k_row) + bytes(cells * k_row)
    for _ in range(layers):
        state += struct.pack("<iQ", v_type, v_row) + bytes(cells * v_row)
    return state


def test_kv_layout_read_from_a_slot_file(tmp_path: Path) -> None:
    path = tmp_path / "a.slot"
    path.write_bytes(encode_slot_file([5, 6, 7], kv_state(3, Q8_0, 136, F16, 256, 4)))
    layout = read_kv_layout(path)
    assert (layout.v_trans, layout.n_layer) == (False, 4)
    assert layout.k_types == ((Q8_0, 136),) * 4
    assert layout.v_types == ((F16, 256),) * 4


def test_kv_layout_of_a_truncated_or_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.slot"
    data = encode_slot_file([5, 6, 7], kv_state(3, F16, 256, F16, 256, 4))
    path.write_bytes(data[: len(data) - 300])
    with pytest.raises(SlotFileError):
        read_kv_layout(path)
    path.write_bytes(encode_slot_file([], struct.pack("<II", 1, 0)))
    with pytest.raises(SlotFileError, match="no KV cells"):
        read_kv_layout(path)
