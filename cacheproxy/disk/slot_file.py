"""The header of a llama-server slot save file: the token ids it holds, and where its state begins.

Layout (llama.cpp `llama_context::state_seq_save_file`, little-endian throughout):

    u32 magic 0x67677371 ('ggsq') | u32 version 4 | u32 n | int32 words[n] | sequence state

llama-server stores a *packed* `server_tokens` blob in the words (`server_tokens::serialize`):

    -1 (marker) | u32 1 (version) | u32 T | int32 tokens[T] | u32 M | u32 media_start[M]
    | M x (u32 byte_len | bytes) | zero padding to a whole word

Words whose first is not -1 (or no words) are a legacy plain token list. The sequence state of an
attention KV cache (`llama_kv_cache::state_write`) starts with u32 n_stream, then per stream u32
cell_count followed, for a non-empty stream, by per-cell metadata and the tensor data. Only the
header is read (never the state's tensors), so checking a multi-gigabyte file stays cheap.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

SLOT_FILE_MAGIC = 0x67677371  # 'ggsq', LLAMA_STATE_SEQ_MAGIC
SLOT_FILE_VERSION = 4  # LLAMA_STATE_SEQ_VERSION
PACKED_MARKER = -1  # LLAMA_TOKEN_NULL as the first word: a packed server_tokens blob follows
PACKED_VERSION = 1  # SERVER_TOKENS_STATE_VERSION
HEADER_BYTES = 12  # magic, version, n
WORD_BYTES = 4
# LLAMA_MAX_SEQ: a KV cache has one stream (unified) or one per sequence, never more than this
MAX_STREAMS = 256
MAX_LAYERS = 4096  # more than any model has: a larger count is a damaged file
# Each cell's metadata holds at least its position (i32) and its count of sequence ids (u32).
MIN_CELL_META_BYTES = 8
# The state bytes we look at: n_stream and every stream's cell count, plus a little slack.
STATE_PREFIX_BYTES = WORD_BYTES * (1 + MAX_STREAMS)


class SlotFileError(ValueError):
    """A file llama-server would refuse to restore, or one that contradicts itself."""


@dataclass(frozen=True)
class SlotFileHeader:
    tokens: array  # array('i') of the slot's token ids; -1 where media chunks sit
    state_offset: int  # where the sequence state begins (12 + 4n)
    file_size: int
    packed: bool  # a server_tokens blob (False: a legacy plain token list)
    media_positions: tuple[int, ...]  # start index of each media chunk, ascending
    n_stream: int  # KV streams in the state: 1 for a unified KV cache, else -np
    cells: int  # KV cells in the first non-empty stream (0: the state holds none)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def read_slot_file(path: Path) -> SlotFileHeader:
    """Parse the slot file at `path`, reading only its header and the start of its state."""
    with open(path, "rb") as file:
        file_size = file.seek(0, 2)
        file.seek(0)
        fixed = file.read(HEADER_BYTES)
        n_words = _fixed_header(fixed, file_size)
        words = file.read(WORD_BYTES * n_words)
        state_prefix = file.read(STATE_PREFIX_BYTES)
    return _parse(fixed + words, state_prefix, n_words, file_size)


def parse_slot_file(data: bytes) -> SlotFileHeader:
    """Parse the header of a slot file held whole in memory."""
    return parse_slot_file_start(data, len(data))


def parse_slot_file_start(start: bytes, file_size: int) -> SlotFileHeader:
    """Parse the header of a slot file of `file_size` bytes from `start`, its first bytes (at
    least its header and the start of its state, or all of it)."""
    n_words = _fixed_header(start[:HEADER_BYTES], file_size)
    state_offset = HEADER_BYTES + WORD_BYTES * n_words
    return _parse(
        start[:state_offset],
        start[state_offset : state_offset + STATE_PREFIX_BYTES],
        n_words,
        file_size,
    )


def encode_slot_file(
    tokens: Sequence[int],
    state: bytes,
    *,
    media_chunks: Sequence[tuple[int, bytes]] = (),
    legacy: bool = False,
) -> bytes:
    """A slot file as llama-server writes it: header, packed tokens (or a legacy list), `state`.

    `media_chunks` are (start index, serialized chunk) pairs; the tokens they cover must be -1.
    Used by tests and tools that need real files without a server.
    """
    if legacy:
        if media_chunks:
            raise ValueError("a legacy token list cannot carry media chunks")
        blob = _words(tokens)
    else:
        blob = bytearray(_words([PACKED_MARKER, PACKED_VERSION, len(tokens)]) + _words(tokens))
        ordered = sorted(media_chunks)
        blob += struct.pack(f"<I{len(ordered)}I", len(ordered), *(start for start, _ in ordered))
        for _, chunk in ordered:
            blob += struct.pack("<I", len(chunk)) + chunk
        blob += bytes(-len(blob) % WORD_BYTES)
    n_words = len(blob) // WORD_BYTES
    return struct.pack("<III", SLOT_FILE_MAGIC, SLOT_FILE_VERSION, n_words) + bytes(blob) + state


def _words(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _fixed_header(fixed: bytes, file_size: int) -> int:
    """Check magic, version and the word count against the file size; return the word count."""
    if len(fixed) < HEADER_BYTES:
        raise SlotFileError(f"file of {file_size} bytes is shorter than the 12-byte header")
    magic, version, n_words = struct.unpack("<III", fixed)
    if magic != SLOT_FILE_MAGIC:
        raise SlotFileError(f"bad magic {magic:#010x} (a slot file starts with 'ggsq')")
    if version != SLOT_FILE_VERSION:
        raise SlotFileError(f"unsupported slot file version {version} (expected 4)")
    if HEADER_BYTES + WORD_BYTES * n_words > file_size:
        raise SlotFileError(
            f"header announces {n_words} token words, past the end of a {file_size}-byte file"
        )
    return n_words


def _parse(header: bytes, state_prefix: bytes, n_words: int, file_size: int) -> SlotFileHeader:
    blob = header[HEADER_BYTES:]
    if n_words and struct.unpack_from("<i", blob)[0] == PACKED_MARKER:
        tokens, media_positions = _unpack_server_tokens(blob)
        packed = True
    else:
        tokens, media_positions, packed = _token_array(blob), (), False
        if min(tokens, default=0) < 0:
            raise SlotFileError("a legacy token list holds a negative token id")
    n_stream, cells = _check_state_start(state_prefix, file_size - len(header))
    return SlotFileHeader(
        tokens=tokens,
        state_offset=len(header),
        file_size=file_size,
        packed=packed,
        media_positions=media_positions,
        n_stream=n_stream,
        cells=cells,
    )


def _unpack_server_tokens(blob: bytes) -> tuple[array, tuple[int, ...]]:
    """Read a packed server_tokens blob as `server_tokens::deserialize` does, and check it."""
    reader = _BlobReader(blob)
    reader.u32()  # the -1 marker, already seen
    version = reader.u32()
    if version != PACKED_VERSION:
        raise SlotFileError(f"unsupported packed token version {version} (expected 1)")
    n_tokens = reader.u32()
    tokens = _token_array(reader.take(WORD_BYTES * n_tokens, f"{n_tokens} tokens"))
    n_media = reader.u32()
    media_positions = struct.unpack(
        f"<{n_media}I", reader.take(WORD_BYTES * n_media, f"{n_media} media positions")
    )
    for start, previous in zip(media_positions, (-1, *media_positions), strict=False):
        if start <= previous or start >= n_tokens or tokens[start] != PACKED_MARKER:
            raise SlotFileError(f"media chunk at token {start} does not match the token list")
    for start in media_positions:
        chunk_bytes = reader.u32()
        if chunk_bytes == 0:
            raise SlotFileError(f"media chunk at token {start} is empty")
        reader.take(chunk_bytes, f"media chunk of {chunk_bytes} bytes")
    # the blob is padded to a whole word; a further word is data the server would refuse
    if reader.remaining >= WORD_BYTES:
        raise SlotFileError(f"{reader.remaining} bytes of trailing data after the packed tokens")
    if not media_positions and min(tokens, default=0) < 0:
        raise SlotFileError("a negative token id outside any media chunk")
    return tokens, tuple(media_positions)


def _token_array(blob: bytes) -> array:
    tokens = array("i", blob)
    if sys.byteorder == "big":  # the file is little-endian whatever the host
        tokens.byteswap()
    return tokens


def _check_state_start(state_prefix: bytes, state_bytes: int) -> tuple[int, int]:
    """Check the state's first fields: n_stream, the empty streams' counts, the first cells' room.

    Only what holds for every attention KV cache is checked; the tensor data that follows
    depends on the model, which the file does not name.
    """
    if state_bytes < WORD_BYTES:
        raise SlotFileError("the sequence state is missing (no n_stream)")
    (n_stream,) = struct.unpack_from("<I", state_prefix, 0)
    if not 1 <= n_stream <= MAX_STREAMS:
        raise SlotFileError(f"the sequence state announces {n_stream} KV streams")
    offset = WORD_BYTES
    for stream in range(n_stream):
        if offset + WORD_BYTES > state_bytes:
            raise SlotFileError(f"the sequence state ends before stream {stream}'s cell count")
        (cells,) = struct.unpack_from("<I", state_prefix, offset)
        offset += WORD_BYTES
        if cells:
            # the streams after this one follow its tensor data, whose size we cannot know
            if offset + cells * MIN_CELL_META_BYTES > state_bytes:
                raise SlotFileError(
                    f"the sequence state is too short for the metadata of {cells} KV cells"
                )
            return n_stream, cells
    return n_stream, 0


@dataclass(frozen=True)
class SlotKvLayout:
    """How a server lays out its KV cache, as its slot files show it: what a restore checks
    (`llama_kv_cache::state_read_data` refuses another V layout, layer count or tensor type)."""

    v_trans: bool
    n_layer: int
    k_types: tuple[tuple[int, int], ...]  # per layer: ggml type id, row size in bytes
    v_types: tuple[tuple[int, int], ...]  # per layer with V: ggml type id, row or element size
    # the state goes on after the KV cache: another memory of the model (the cells of its
    # sliding-window layers, a recurrent state), which a restore brings back whole or not at all
    state_after_kv: bool = False

    def as_fact(self) -> str:
        k = ",".join(f"{kind}:{size}" for kind, size in self.k_types)
        v = ",".join(f"{kind}:{size}" for kind, size in self.v_types)
        return f"v_trans={int(self.v_trans)};n_layer={self.n_layer};k={k};v={v}"


def read_kv_layout(path: Path) -> SlotKvLayout:
    """The KV layout of a slot file holding at least one cell (read with seeks past the tensor
    data). The layout of a text-only attention cache: a cell with extended metadata (M-RoPE)
    does not parse and raises SlotFileError."""
    header = read_slot_file(path)
    if not header.cells:
        raise SlotFileError("the slot file holds no KV cells: its layout is not written")
    with open(path, "rb") as file:
        read = functools.partial(_read_at, file)
        reader = FieldReader(read, header.state_offset, header.file_size)
        n_stream = reader.u32()
        cells = stream = 0
        while stream < n_stream:  # to the stream holding the cells
            cells = reader.u32()
            if cells:
                break
            stream += 1
        for _ in range(cells):
            reader.skip(4)  # pos
            n_seq_id = reader.u32()
            if n_seq_id != 1:
                raise SlotFileError(f"a cell of a sequence save names {n_seq_id} sequences")
            reader.skip(4)
        v_trans, n_layer = reader.u32(), reader.u32()
        reader.skip(8)  # n_rot_k, n_rot_v
        if not 1 <= n_layer <= MAX_LAYERS:
            raise SlotFileError(f"the KV state announces {n_layer} layers")
        k_types = []
        for _ in range(n_layer):
            kind, row = reader.i32(), reader.u64()
            k_types.append((kind, row))
            reader.skip(cells * row)
        v_types = []
        # layers without V write nothing: read as many as there are, up to n_layer
        while len(v_types) < n_layer and reader.remaining > 0:
            kind = reader.i32()
            if v_trans:
                element, n_embd = reader.u32(), reader.u32()
                v_types.append((kind, element))
                reader.skip(n_embd * cells * element)
            else:
                row = reader.u64()
                v_types.append((kind, row))
                reader.skip(cells * row)
        # the empty streams after the cells' one, then whatever state follows the cache
        trailing = min(4 * (n_stream - stream - 1), reader.remaining)
        after = any(reader.take(trailing)) or reader.remaining > 0
    return SlotKvLayout(bool(v_trans), n_layer, tuple(k_types), tuple(v_types), after)


class FieldReader:
    """Little-endian fields of a file or buffer (`read(offset, length)`), checked against its
    end (past it: `error`); what is skipped is never read."""

    def __init__(
        self,
        read: Callable[[int, int], bytes],
        offset: int,
        end: int,
        error: type[SlotFileError] = SlotFileError,
    ) -> None:
        self.read = read
        self.offset = offset
        self.end = end
        self.error = error

    @property
    def remaining(self) -> int:
        return self.end - self.offset

    def skip(self, size: int) -> None:
        if size > self.remaining:
            raise self.error("the KV state ends early")
        self.offset += size

    def take(self, size: int) -> bytes:
        start = self.offset
        self.skip(size)
        return self.read(start, size)

    def unpack(self, form: str) -> tuple[int, ...]:
        return struct.unpack(form, self.take(struct.calcsize(form)))

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def i32(self) -> int:
        return self.unpack("<i")[0]

    def u64(self) -> int:
        return self.unpack("<Q")[0]


class _BlobReader:
    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.offset = 0

    @property
    def remaining(self) -> int:
        return len(self.blob) - self.offset

    def take(self, size: int, what: str) -> bytes:
        if size > self.remaining:
            raise SlotFileError(f"the packed tokens end before {what}")
        chunk = self.blob[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def u32(self) -> int:
        (value,) = struct.unpack("<I", self.take(WORD_BYTES, "a length field"))
        return value


def _read_at(file: BinaryIO, offset: int, size: int) -> bytes:
    file.seek(offset)
    return file.read(size)
