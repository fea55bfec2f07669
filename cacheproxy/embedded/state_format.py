"""Sequence states of llama-cpp-python's llama.cpp, converted to and from the pinned
llama-server's layout, so slot files cross between the embedded engine and a llama-server.

The two llama.cpp versions lay a sequence state out alike (n_stream, then per stream a cell
count, the cells' positions and sequence ids, and the K/V rows), except for two fields:

- llama-cpp-python's begins with 8 bytes: a magic and the u32 id of the saved sequence;
- llama-server's writes `n_rot_k` and `n_rot_v` (u32 each) after each stream's `n_layer`: the
  rotation of a rotated (quantized) KV cache, 0 for a plain f16 cache.

Both add 8 bytes to a one-stream state, so a state's size is the same in both.

An engine with a unified KV cache (one stream) writes its slots as a llama-server with the same
`-np` and per-slot KV does: one stream per slot, the cells in the slot's own stream, the others
empty (`layout=`); reading one back, the streams fold into the engine's one.
"""

from __future__ import annotations

import struct

ENGINE_STATE_MAGIC = bytes.fromhex("d83c14af")
ENGINE_HEADER_BYTES = 8
NO_ROTATION = struct.pack("<II", 0, 0)


class StateFormatError(ValueError):
    """A state this conversion cannot follow (or a rotated KV cache the engine lacks)."""


def engine_to_server(state: bytes, layout: tuple[int, int] | None = None) -> bytes:
    """An engine state (from `llama_state_seq_get_data`) as llama-server would have saved it.
    `layout=(n_stream, stream)`: a one-stream (unified) state spread over `n_stream` streams,
    its cells in `stream`."""
    if not state.startswith(ENGINE_STATE_MAGIC):
        raise StateFormatError("not a llama-cpp-python sequence state (no magic)")
    body = state[ENGINE_HEADER_BYTES:]
    streams, rest = _rewrite_streams(body, insert_rotation=True)
    if layout is not None and len(streams) == 1:
        n_stream, stream = layout
        empty = struct.pack("<I", 0)
        streams = [streams[0] if index == stream else empty for index in range(n_stream)]
    return struct.pack("<I", len(streams)) + b"".join(streams) + rest


def server_to_engine(state: bytes, seq_id: int, unified: bool = False) -> bytes:
    """A llama-server state (from a slot file) in the engine's layout, for sequence `seq_id`;
    `unified`: for an engine with one KV stream, whatever the file's count."""
    header = ENGINE_STATE_MAGIC + struct.pack("<I", seq_id)
    streams, rest = _rewrite_streams(state, insert_rotation=False)
    if unified and len(streams) > 1:
        filled = [stream for stream in streams if stream != struct.pack("<I", 0)]
        if len(filled) > 1:
            raise StateFormatError("the state holds cells in more than one stream")
        streams = filled or streams[:1]
    return header + struct.pack("<I", len(streams)) + b"".join(streams) + rest


def _rewrite_streams(state: bytes, insert_rotation: bool) -> tuple[list[bytes], bytes]:
    """The state's streams, each rewritten (from its cell count on), and what follows them."""
    reader = _Reader(state)
    streams: list[bytes] = []
    (n_stream,) = reader.unpack("<I")
    for _ in range(n_stream):
        out = bytearray()
        streams.append(out)  # type: ignore[arg-type]  # filled below, bytes-like either way
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
    # anything after the KV cache (none for attention models)
    return [bytes(stream) for stream in streams], state[reader.offset :]


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
