"""The KV frame of a llama-server slot file: where each layer's K and V data of its cells lie, so
a state can be cut into blocks of cells (`kv_blocks`) and put together again for any prefix.

A one-sequence state of the pinned llama.cpp (`llama_kv_cache::state_write`), little-endian:

    u32 n_stream | per stream u32 cell_count; the stream holding the cells goes on with
      cell_count x (i32 pos, u32 n_seq_id = 1, i32 seq_id)
      u32 v_trans | u32 n_layer | u32 n_rot_k | u32 n_rot_v
      per layer: i32 k_type | u64 k_row_bytes | cell_count rows
      per layer with V, plain:      i32 v_type | u64 v_row_bytes | cell_count rows
                        transposed: i32 v_type | u32 element_bytes | u32 n_embd_v
                                    | n_embd_v x (cell_count elements)

A file is framed only when it is that and nothing else: a packed text-only token header, one
stream of cells at positions 0..n-1 in order, as many cells as tokens, every layer's K and V
header agreeing with the others, and the file ending right after the KV data and the empty
streams. Anything else (an unknown version or layout, a unified cache whose cells lie out of
order, a sliding-window or recurrent state, media) raises `Unframed`: it stays a whole file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cacheproxy.disk.slot_file import (
    HEADER_BYTES,
    MAX_LAYERS,
    STATE_PREFIX_BYTES,
    WORD_BYTES,
    FieldReader,
    SlotFileError,
    SlotFileHeader,
    SlotKvLayout,
    encode_slot_file,
    parse_slot_file_start,
)

FRAME_VERSION = 1  # of the frame as the index keeps it (`KvFrame.to_json`)
CELL_META = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4"), ("seq_id", "<i4")])
LAYER_HEADER_BYTES = 12  # i32 type + u64 row size, or i32 type + u32 element size + u32 width
FRAME_HEADER_BYTES = 16  # v_trans, n_layer, n_rot_k, n_rot_v


class Unframed(SlotFileError):
    """A slot file this code does not cut into blocks (it stays a whole-file archive)."""


@dataclass(frozen=True)
class KvFrame:
    """What every block of one archive's state shares: the streams, the sequence id the cells
    carry, and per layer the K and V tensor types and sizes. One cell's data is `cell_bytes`."""

    n_stream: int
    stream: int  # the stream holding the cells (the slot's, or 0 for a unified cache)
    seq_id: int
    v_trans: bool
    n_rot_k: int
    n_rot_v: int
    k: tuple[tuple[int, int], ...]  # per layer: ggml type, row bytes
    # per layer with V: ggml type, row bytes (plain) or element bytes (transposed), and the
    # width n_embd_v of a transposed V (0 for plain)
    v: tuple[tuple[int, int, int], ...]

    @property
    def n_layer(self) -> int:
        return len(self.k)

    @property
    def cell_bytes(self) -> int:
        return sum(row for _, row in self.k) + sum(
            size * width if self.v_trans else size for _, size, width in self.v
        )

    @property
    def layout(self) -> SlotKvLayout:
        return SlotKvLayout(self.v_trans, self.n_layer, self.k, tuple((t, s) for t, s, _ in self.v))

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": FRAME_VERSION,
                "n_stream": self.n_stream,
                "stream": self.stream,
                "seq_id": self.seq_id,
                "v_trans": self.v_trans,
                "n_rot": [self.n_rot_k, self.n_rot_v],
                "k": [list(layer) for layer in self.k],
                "v": [list(layer) for layer in self.v],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> KvFrame:
        data = json.loads(text)
        if data.get("version") != FRAME_VERSION:
            raise Unframed(f"frame version {data.get('version')} is not {FRAME_VERSION}")
        return cls(
            n_stream=data["n_stream"],
            stream=data["stream"],
            seq_id=data["seq_id"],
            v_trans=data["v_trans"],
            n_rot_k=data["n_rot"][0],
            n_rot_v=data["n_rot"][1],
            k=tuple((kind, row) for kind, row in data["k"]),
            v=tuple((kind, size, width) for kind, size, width in data["v"]),
        )

    def placement(self, state_offset: int, n_cells: int) -> StatePlacement:
        """Where the K and V data of `n_cells` cells lie in a state of this frame that starts at
        `state_offset` (the same arithmetic cuts a file and assembles one)."""
        offset = state_offset + 4 * (1 + self.stream + 1) + CELL_META.itemsize * n_cells
        offset += FRAME_HEADER_BYTES
        k_offsets = []
        for _, row in self.k:
            offset += LAYER_HEADER_BYTES
            k_offsets.append(offset)
            offset += row * n_cells
        v_offsets = []
        for _, size, width in self.v:
            offset += LAYER_HEADER_BYTES
            v_offsets.append(offset)
            offset += size * (width if self.v_trans else 1) * n_cells
        end = offset + 4 * (self.n_stream - self.stream - 1)
        return StatePlacement(n_cells, tuple(k_offsets), tuple(v_offsets), end)

    def state_head(self, n_cells: int) -> bytes:
        """A state's fields before its first K layer, for `n_cells` cells at positions 0..n-1:
        the stream counts (the streams before the cells' one empty), the cells' metadata and
        the KV header."""
        meta = np.zeros(n_cells, dtype=CELL_META)
        meta["pos"] = np.arange(n_cells, dtype=np.int32)
        meta["n_seq_id"] = 1
        meta["seq_id"] = self.seq_id
        counts = struct.pack(f"<{self.stream + 2}I", self.n_stream, *[0] * self.stream, n_cells)
        header = struct.pack("<IIII", int(self.v_trans), self.n_layer, self.n_rot_k, self.n_rot_v)
        return counts + meta.tobytes() + header

    def k_header(self, layer: int) -> bytes:
        return struct.pack("<iQ", *self.k[layer])

    def v_header(self, layer: int) -> bytes:
        kind, size, width = self.v[layer]
        if self.v_trans:
            return struct.pack("<iII", kind, size, width)
        return struct.pack("<iQ", kind, size)

    def v_cell_bytes(self, layer: int) -> int:
        """One cell's V data in `layer`: its row, or its element of every transposed row."""
        _, size, width = self.v[layer]
        return size * width if self.v_trans else size

    def state_tail(self) -> bytes:
        """The empty streams after the cells' one."""
        return bytes(4 * (self.n_stream - self.stream - 1))

    def state_skeleton(self, n_cells: int) -> bytes:
        """A state of `n_cells` cells at positions 0..n-1 with every field but the K and V data
        (zeros there)."""
        parts = [self.state_head(n_cells)]
        for layer, (_, row) in enumerate(self.k):
            parts += [self.k_header(layer), bytes(row * n_cells)]
        for layer in range(len(self.v)):
            parts += [self.v_header(layer), bytes(self.v_cell_bytes(layer) * n_cells)]
        parts.append(self.state_tail())
        return b"".join(parts)


@dataclass(frozen=True)
class StatePlacement:
    n_cells: int
    k_offsets: tuple[int, ...]  # where each layer's K rows start
    v_offsets: tuple[int, ...]  # where each layer's V rows (or transposed rows) start
    end: int  # where the state ends


@dataclass(frozen=True)
class FramedFile:
    """A slot file whose state is framed: its header, its frame, and where its data lie."""

    header: SlotFileHeader
    frame: KvFrame
    placement: StatePlacement

    @property
    def n_cells(self) -> int:
        return self.placement.n_cells


def read_framed(path: Path) -> FramedFile:
    """Frame the slot file at `path`, reading only its headers and the cells' metadata (with
    seeks past the data). Raises Unframed, or SlotFileError for a file no server would take."""
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        file.seek(0)
        fixed = file.read(HEADER_BYTES)
        n_words = struct.unpack_from("<I", fixed, 8)[0] if len(fixed) == HEADER_BYTES else 0
        start = fixed + file.read(WORD_BYTES * n_words + STATE_PREFIX_BYTES)
        header = parse_slot_file_start(start, size)

        def read(offset: int, length: int) -> bytes:
            file.seek(offset)
            return file.read(length)

        return _framed(FieldReader(read, header.state_offset, size, Unframed), header)


def frame_of(data: bytes) -> FramedFile:
    """Frame a slot file held in memory (see `read_framed`)."""
    (n_words,) = struct.unpack_from("<I", data, 8) if len(data) >= HEADER_BYTES else (0,)
    start = data[: HEADER_BYTES + WORD_BYTES * n_words + STATE_PREFIX_BYTES]
    header = parse_slot_file_start(start, len(data))

    def read(offset: int, length: int) -> bytes:
        return data[offset : offset + length]

    return _framed(FieldReader(read, header.state_offset, len(data), Unframed), header)


def _framed(reader: FieldReader, header: SlotFileHeader) -> FramedFile:
    if not header.packed or header.media_positions:
        raise Unframed("only a packed text-only token header is cut into blocks")
    n_stream = reader.u32()
    stream, n_cells = 0, 0
    while stream < n_stream:
        n_cells = reader.u32()
        if n_cells:
            break
        stream += 1
    if n_cells == 0:
        raise Unframed("the state holds no cells")
    if n_cells != header.n_tokens:
        raise Unframed(f"{n_cells} KV cells for {header.n_tokens} tokens")
    meta_bytes = reader.take(CELL_META.itemsize * n_cells)
    meta = np.frombuffer(meta_bytes, dtype=CELL_META)
    seq_id = int(meta["seq_id"][0])
    if not (
        np.array_equal(meta["pos"], np.arange(n_cells, dtype=np.int32))
        and bool((meta["n_seq_id"] == 1).all())
        and bool((meta["seq_id"] == seq_id).all())
    ):
        raise Unframed("the cells are not one sequence at positions 0..n-1 in order")
    v_trans, n_layer, n_rot_k, n_rot_v = (reader.u32() for _ in range(4))
    if v_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
        raise Unframed(f"a KV header of v_trans {v_trans} and {n_layer} layers")
    k = []
    for _ in range(n_layer):
        kind, row = reader.unpack("<iQ")
        k.append((kind, row))
        reader.skip(row * n_cells)
    trailing = 4 * (n_stream - stream - 1)  # the empty streams after the cells' one
    v = []
    while len(v) < n_layer and reader.remaining > trailing:
        if v_trans:
            kind, size, width = reader.unpack("<iII")
            reader.skip(size * width * n_cells)
        else:
            kind, size = reader.unpack("<iQ")
            width = 0
            reader.skip(size * n_cells)
        v.append((kind, size, width))
    tail = reader.take(trailing)
    if reader.remaining or any(tail):
        raise Unframed("the state goes on after its KV data")
    frame = KvFrame(
        n_stream=n_stream,
        stream=stream,
        seq_id=seq_id,
        v_trans=bool(v_trans),
        n_rot_k=n_rot_k,
        n_rot_v=n_rot_v,
        k=tuple(k),
        v=tuple(v),
    )
    placement = frame.placement(header.state_offset, n_cells)
    if placement.end != reader.end:
        raise Unframed("the KV data do not fill the file")  # the arithmetic disagrees: refuse
    return FramedFile(header, frame, placement)


def header_bytes(tokens: list[int] | np.ndarray) -> bytes:
    """The header of a slot file holding `tokens` (text only), as llama-server writes it."""
    return encode_slot_file(list(map(int, tokens)), b"")
