"""Slot-file material for tests: KV states shaped like llama.cpp's, random prompts, a JSON post."""

from __future__ import annotations

import json
import random
import struct
import urllib.request
from typing import Any


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
