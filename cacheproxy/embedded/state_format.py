"""Sequence states of llama-cpp-python's llama.cpp, converted to and from the pinned
llama-server's layout, so slot files cross between the embedded engine and a llama-server.

The two llama.cpp versions lay a sequence state out alike (n_stream, then per stream a cell
count, the cells' positions and sequence ids, and the K/V rows), except for two fields:

- llama-cpp-python's begins with 8 bytes: a magic and the u32 id of the saved sequence;
- llama-server's writes `n_rot_k` and `n_rot_v` (u32 each) after each stream's `n_layer`: the
  rotation of a rotated (quantized) KV cache, 0 for a plain f16 cache.

Both add 8 bytes to a one-stream state, so a state's size is the same in both.
"""

from __future__ import annotations

import struct

ENGINE_STATE_MAGIC = bytes.fromhex("d83c14af")
ENGINE_HEADER_BYTES = 8
NO_ROTATION = struct.pack("<II", 0, 0)


class StateFormatError(ValueError):
    """A state this conversion cannot follow (or a rotated KV cache the engine lacks)."""


def engine_to_server(state: bytes) -> bytes:
    """An engine state (from `llama_state_seq_get_data`) as llama-server would have saved it."""
    if not state.startswith(ENGINE_STATE_MAGIC):
        raise StateFormatError("not a llama-cpp-python sequence state (no magic)")
    body = state[ENGINE_HEADER_BYTES:]
    return _rewrite_streams(body, insert_rotation=True)


def server_to_engine(state: bytes, seq_id: int) -> bytes:
    """A llama-server state (from a slot file) in the engine's layout, for sequence `seq_id`."""
    header = ENGINE_STATE_MAGIC + struct.pack("<I", seq_id)
    return header + _rewrite_streams(state, insert_rotation=False)


def _rewrite_streams(state: bytes, insert_rotation: bool) -> bytes:
    reader = _Reader(state)
    out = bytearray()
    (n_stream,) = reader.unpack("<I")
    out += struct.pack("<I", n_stream)
    for _ in range(n_stream):
        (cell_count,) = reader.unpack("<I")
        out += struct.pack("<I", cell_count)
        if cell_count == 0:
            continue
        start = reader.offset
        for _ in range(cell_count):  # pos, n_seq_id, then the sequence ids
            _, n_seq_id = reader.unpack("<iI")
            reader.skip(4 * n_seq_id)
        v_trans, n_layer = reader.unpack("<II")
        out += state[start : reader.offset]
        if insert_rotation:
            out += NO_ROTATION
        elif reader.take(8) != NO_ROTATION:
            raise StateFormatError("the state comes from a rotated KV cache")
        start = reader.offset
        for _ in range(n_layer):  # K rows: type, row size, data
            _, row_bytes = reader.unpack("<iQ")
            reader.skip(row_bytes * cell_count)
        for _ in range(n_layer):  # V rows, or V transposed: type, element size, width, data
            if v_trans:
                _, element_bytes, width = reader.unpack("<iII")
                reader.skip(element_bytes * width * cell_count)
            else:
                _, row_bytes = reader.unpack("<iQ")
                reader.skip(row_bytes * cell_count)
        out += state[start : reader.offset]
    out += state[reader.offset :]  # anything after the KV cache (none for attention models)
    return bytes(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def unpack(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise StateFormatError("the state ends early")
        values = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return values

    def skip(self, size: int) -> None:
        if self.offset + size > len(self.data):
            raise StateFormatError("the state ends early")
        self.offset += size

    def take(self, size: int) -> bytes:
        start = self.offset
        self.skip(size)
        return self.data[start : self.offset]
