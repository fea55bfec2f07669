"""Slot-file material for tests: KV states shaped like llama.cpp's, random prompts, a JSON post."""

from __future__ import annotations

import json
import random
import struct
import urllib.request
from typing import Any

import numpy as np

from cacheproxy.disk.kv_frame import KvFrame


def kv_state(n_stream: int, stream: int, cells: int, data_bytes: int = 64) -> bytes:
    """A sequence state shaped like llama_kv_cache::state_write for one slot's stream.

    Streams before `stream` are empty; `stream` holds `cells` cells (metadata, then stand-in
    tensor data); the streams after it come last, empty.
    """
    state = struct.pack("<I", n_stream) + struct.pack("<I", 0) * stream
    state += struct.pack("<I", cells)
    if cells:
        for position in range(cells):
            state += struct.pack("<iIi", position, 1, stream)
        state += bytes(random.Random(cells).randbytes(data_bytes))
    return state + struct.pack("<I", 0) * (n_stream - stream - 1)


def random_tokens(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 32000) for _ in range(count)]


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def kv_frame(
    *,
    v_trans: bool = False,
    n_stream: int = 1,
    stream: int = 0,
    layers: int = 3,
    v_layers: int | None = None,
    row: int = 24,
) -> KvFrame:
    """The frame of a small attention KV cache: `layers` layers of K rows of `row` bytes (one
    of another size), V plain or transposed (2-byte elements, `row // 2` wide), on `v_layers`
    of them (default all)."""
    k = tuple((1, row + 8 * (index == 1)) for index in range(layers))
    v_count = layers if v_layers is None else v_layers
    if v_trans:
        v = tuple((1, 2, row // 2) for _ in range(v_count))
    else:
        v = tuple((8, row + 10 * (index == 0), 0) for index in range(v_count))
    return KvFrame(n_stream, stream, stream, v_trans, 0, 0, k, v)


def framed_state(frame: KvFrame, cells: int, seed: int = 0) -> bytes:
    """A state of `frame` holding `cells` cells at positions 0..n-1, random K and V data."""
    state = np.frombuffer(frame.state_skeleton(cells), dtype=np.uint8).copy()
    placement = frame.placement(0, cells)
    rng = np.random.default_rng(seed)
    for (_, row), offset in zip(frame.k, placement.k_offsets, strict=True):
        state[offset : offset + row * cells] = rng.integers(0, 256, row * cells, dtype=np.uint8)
    for (_, size, width), offset in zip(frame.v, placement.v_offsets, strict=True):
        length = size * (width if frame.v_trans else 1) * cells
        state[offset : offset + length] = rng.integers(0, 256, length, dtype=np.uint8)
    return state.tobytes()


def prefix_state(frame: KvFrame, state: bytes, cells: int, prefix: int) -> bytes:
    """The state of the first `prefix` of `cells` cells, cut field by field from `state`
    (written plainly, apart from the code under test: the tests' oracle)."""
    out = bytearray(struct.pack("<I", frame.n_stream) + struct.pack("<I", 0) * frame.stream)
    out += struct.pack("<I", prefix)
    meta_at = 4 * (frame.stream + 2)
    out += state[meta_at : meta_at + 12 * prefix]
    at = meta_at + 12 * cells
    out += state[at : at + 16]  # v_trans, n_layer, n_rot_k, n_rot_v
    at += 16
    for _, row in frame.k:
        out += state[at : at + 12 + row * prefix]  # type, row size, the first rows
        at += 12 + row * cells
    for _, size, width in frame.v:
        out += state[at : at + 12]
        at += 12
        if frame.v_trans:
            for _ in range(width):  # each V row: the first elements
                out += state[at : at + size * prefix]
                at += size * cells
        else:
            out += state[at : at + size * prefix]
            at += size * cells
    out += struct.pack("<I", 0) * (frame.n_stream - frame.stream - 1)
    return bytes(out)


def conversation_state(frame: KvFrame, tokens: list[int]) -> bytes:
    """A state of `frame` for `tokens` whose cells' data depend only on their token and
    position, as a model's would on the text before them: archives sharing a prefix hold the
    same data for it, byte for byte."""
    cells = len(tokens)
    state = np.frombuffer(frame.state_skeleton(cells), dtype=np.uint8).copy()
    placement = frame.placement(0, cells)
    data = (
        np.stack(
            [
                np.random.default_rng([position, token % 2**31]).integers(
                    0, 256, frame.cell_bytes, dtype=np.uint8
                )
                for position, token in enumerate(tokens)
            ]
        )
        if cells
        else np.zeros((0, frame.cell_bytes), dtype=np.uint8)
    )
    at = 0
    for (_, row), offset in zip(frame.k, placement.k_offsets, strict=True):
        state[offset : offset + row * cells] = data[:, at : at + row].reshape(-1)
        at += row
    for (_, size, width), offset in zip(frame.v, placement.v_offsets, strict=True):
        if frame.v_trans:
            region = state[offset : offset + width * size * cells].reshape(width, cells * size)
            for position in range(cells):
                cell = data[position, at : at + width * size].reshape(width, size)
                region[:, position * size : (position + 1) * size] = cell
            at += width * size
        else:
            state[offset : offset + size * cells] = data[:, at : at + size].reshape(-1)
            at += size
    return state.tobytes()
