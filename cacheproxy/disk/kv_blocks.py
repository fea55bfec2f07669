"""Blocks of KV cells on disk: cut from a framed slot file (`kv_frame`), each written once and
synced, read back checked, and put together into a slot file of any prefix of the cells.

A block holds cells [start, end) of a state, keyed by a hash of the tokens up to `end` (the
chained 64-token hash the index keeps when `end` is a multiple of 64; a hash of the tail on top
of it otherwise) and by its cell count: the same key means the same tokens at the same
positions, whichever archive wrote it. Its file:

    4s b"CPKB" | u32 version 1 | u32 n_cells | u32 crc32 of the payload | 16s key hash
    payload: per layer the cells' K rows | per layer with V the cells' V rows, or for a
             transposed V each of its n_embd_v rows' elements of these cells

Files are named by opaque random ids, mode 0600, in the `blocks` folder of the archive folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import struct
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cacheproxy.disk.blocks import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    HASH_BYTES,
    TOKEN_BYTES,
    block_hashes,
    pack,
)
from cacheproxy.disk.kv_frame import KvFrame, StatePlacement, header_bytes

# Cells per block, a multiple of the index's 64-token hash blocks: the index's own block, so
# a save keeps at most 63 cells of an earlier turn's tail again, and a restore reads at most 63
# cells it does not need (`cacheproxy bench blocks` shows both; docs/disk-tier.md#blocks).
KV_BLOCK_TOKENS = 64
BLOCKS_DIR = "blocks"
BLOCK_NAME_PATTERN = re.compile(r"b_[0-9a-f]{32}\.kv")
BLOCK_MAGIC = b"CPKB"
BLOCK_VERSION = 1
BLOCK_HEADER = struct.Struct("<4sIII16s")
TAIL_PERSON = b"kv-tail"
# a restore file is put together through a buffer of at most this size (one layer's rows of
# as many blocks as fit), and written with at most this many pieces per call (IOV_MAX: 1024)
ASSEMBLE_BUFFER_BYTES = 16 << 20
WRITE_PIECES = 512


class BlockDamaged(ValueError):
    """A block file that is missing, or not the block its row names (size, header, checksum)."""

    def __init__(self, file_name: str, problem: str) -> None:
        super().__init__(f"block {file_name}: {problem}")
        self.file_name = file_name


@dataclass(frozen=True)
class BlockCut:
    """Cells [start, end) of a state, and the hash of the tokens up to `end`."""

    start: int
    end: int
    key: bytes

    @property
    def n_cells(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StoredBlock:
    """A block as its row names it."""

    file_name: str
    key: bytes
    n_cells: int
    crc: int
    bytes: int


def block_cuts(tokens: array, block_tokens: int = KV_BLOCK_TOKENS) -> list[BlockCut]:
    """The blocks a state of `tokens` is cut into: whole blocks of `block_tokens`, then the
    rest (the tail), if any."""
    if block_tokens % BLOCK_TOKENS:
        raise ValueError(f"a block holds a multiple of {BLOCK_TOKENS} tokens")
    packed = pack(tokens)
    chain = block_hashes(packed)
    ends = [*range(block_tokens, len(tokens) + 1, block_tokens)]
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))
    cuts, start = [], 0
    for end in ends:
        cuts.append(BlockCut(start, end, prefix_key(packed, chain, end)))
        start = end
    return cuts


def prefix_key(packed: bytes, chain: Sequence[bytes], end: int) -> bytes:
    """The hash of the tokens up to `end`: the chained hash there, or a tail hash on top of
    the last chained one."""
    whole, rest = divmod(end, BLOCK_TOKENS)
    if rest == 0:
        return chain[whole - 1]
    tail = hashlib.blake2b(digest_size=HASH_BYTES, person=TAIL_PERSON)
    tail.update(chain[whole - 1] if whole else b"")
    tail.update(packed[whole * BLOCK_BYTES : end * TOKEN_BYTES])
    return tail.digest()


def block_file_bytes(frame: KvFrame, n_cells: int) -> int:
    return BLOCK_HEADER.size + frame.cell_bytes * n_cells


def cut_payload(
    frame: KvFrame, placement: StatePlacement, data: np.ndarray, start: int, end: int
) -> np.ndarray:
    """The payload of cells [start, end) of the state `placement` lays out in `data` (the whole
    file as bytes)."""
    count, total = end - start, placement.n_cells
    out = np.empty(frame.cell_bytes * count, dtype=np.uint8)
    at = 0
    for (_, row), offset in zip(frame.k, placement.k_offsets, strict=True):
        out[at : at + row * count] = data[offset + row * start : offset + row * end]
        at += row * count
    for (_, size, width), offset in zip(frame.v, placement.v_offsets, strict=True):
        if frame.v_trans:
            region = data[offset : offset + width * size * total].reshape(width, size * total)
            target = out[at : at + width * size * count].reshape(width, size * count)
            target[:] = region[:, size * start : size * end]
            at += width * size * count
        else:
            out[at : at + size * count] = data[offset + size * start : offset + size * end]
            at += size * count
    return out


@contextlib.contextmanager
def _opened_to_write(path: Path, create: bool = True) -> Iterator[int]:
    """`path` open for writing, created (mode 0600, never over another file) when `create`; a
    file it created is removed again when what is written to it fails."""
    descriptor = os.open(path, os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        yield descriptor
    except BaseException:
        if create:
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    finally:
        os.close(descriptor)


def new_block_file(directory: Path, size: int) -> str:
    """Create an empty block file with `size` bytes allocated on disk (the file system's free
    space counts them from now on, before they are written) under a fresh opaque name."""
    file_name = f"b_{secrets.token_hex(16)}.kv"
    with _opened_to_write(directory / file_name) as descriptor:
        os.posix_fallocate(descriptor, 0, size)
    return file_name


def write_block(
    directory: Path,
    key: bytes,
    n_cells: int,
    payload: np.ndarray,
    sync: bool = True,
    file_name: str | None = None,
) -> StoredBlock:
    """Write a block file of `n_cells` cells: into `file_name` (made by `new_block_file`), or a
    new file under a fresh opaque name; synced unless `sync` is False (a cut writes all its
    blocks, then syncs them together: `sync_files`; the caller syncs the folder once its blocks
    are synced, before any row names them)."""
    crc = zlib.crc32(payload)
    made = file_name is None
    file_name = file_name or f"b_{secrets.token_hex(16)}.kv"
    path = directory / file_name
    with _opened_to_write(path, create=made) as descriptor:
        with os.fdopen(descriptor, "wb", closefd=False) as file:
            file.write(BLOCK_HEADER.pack(BLOCK_MAGIC, BLOCK_VERSION, n_cells, crc, key))
            file.write(memoryview(payload))
        if sync:
            os.fsync(descriptor)
    return StoredBlock(file_name, key, n_cells, crc, BLOCK_HEADER.size + payload.nbytes)


def sync_files(directory: Path, file_names: Iterable[str]) -> None:
    """Make the data of files just written in `directory` durable (one after the other once
    all are written: the file system writes them back together rather than block by
    block)."""
    for file_name in file_names:
        descriptor = os.open(directory / file_name, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def block_files(directory: Path) -> dict[str, int]:
    """The block files in `directory`: name -> size (none if there is no such folder)."""
    found: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if BLOCK_NAME_PATTERN.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    found[entry.name] = entry.stat(follow_symlinks=False).st_size
    return found


def block_file_holds(path: Path, key: bytes, n_cells: int, size: int) -> bool:
    """Whether the block file at `path` has the size and header of the block of that key and
    cell count (its data are checked when read: `read_payload`)."""
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size != size:
                return False
            header = file.read(BLOCK_HEADER.size)
    except OSError:
        return False
    if len(header) != BLOCK_HEADER.size:
        return False
    magic, version, cells, _, stored_key = BLOCK_HEADER.unpack(header)
    return (magic, version, cells, stored_key) == (BLOCK_MAGIC, BLOCK_VERSION, n_cells, key)


def sync_directory(directory: Path) -> None:
    """Make the names of the files just written in `directory` durable."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_payload(directory: Path, block: StoredBlock, frame: KvFrame) -> np.ndarray:
    """A block's payload, checked against its row and the frame: raises BlockDamaged."""
    expected = block_file_bytes(frame, block.n_cells)
    try:
        with open(directory / block.file_name, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size != block.bytes or size != expected:
                raise BlockDamaged(block.file_name, f"{size} bytes, not {expected}")
            raw = np.empty(size, dtype=np.uint8)
            if file.readinto(memoryview(raw)) != size:
                raise BlockDamaged(block.file_name, "ends early")
    except FileNotFoundError:
        raise BlockDamaged(block.file_name, "missing") from None
    magic, version, n_cells, crc, key = BLOCK_HEADER.unpack_from(raw)
    if (magic, version, n_cells, key) != (BLOCK_MAGIC, BLOCK_VERSION, block.n_cells, block.key):
        raise BlockDamaged(block.file_name, "another block's header")
    payload = raw[BLOCK_HEADER.size :]
    if crc != block.crc or zlib.crc32(payload) != crc:
        raise BlockDamaged(block.file_name, "checksum mismatch")
    return payload


def assemble(
    directory: Path,
    frame: KvFrame,
    tokens: Sequence[int],
    blocks: Sequence[StoredBlock],
    target: Path,
) -> int:
    """Write to `target` a slot file of the first `len(tokens)` cells, from `blocks` (in order,
    from cell 0, covering at least that many): bytes written. Raises BlockDamaged (nothing is
    left at `target` then).

    Each block used is opened and its size and header checked first. The file is then written
    layer by layer: the blocks' rows of a layer are read into one buffer, each block's checksum
    is carried on over its rows there, and they are written from it in one call. Every byte of
    a block's payload is read once, in order, so its checksum is whole after the last layer:
    the file is given back only if every checksum matched, so a damaged block never reaches
    the server. (One thread: under load, handing buffers between threads cost more than the
    checksums.) Not synced: the server reads it once, from the page cache, and it is deleted
    after."""
    n_cells = len(tokens)
    used: list[_OpenBlock] = []
    try:
        start = 0
        for block in blocks:
            if start >= n_cells:
                break
            count = min(block.n_cells, n_cells - start)
            used.append(_open_block(directory, block, frame, count))
            start += block.n_cells
        if start < n_cells:
            last = blocks[-1].file_name if blocks else "-"
            raise BlockDamaged(last, f"blocks end at cell {start}")
        with _opened_to_write(target) as descriptor:
            return _write_layers(frame, tokens, used, descriptor)
    finally:
        for block in used:
            os.close(block.descriptor)


@dataclass
class _OpenBlock:
    """A block file open for reading (its size and header checked), the cells of it the file
    takes, and the checksum of its payload read so far."""

    stored: StoredBlock
    descriptor: int
    taken: int
    crc: int = 0


def _open_block(directory: Path, block: StoredBlock, frame: KvFrame, taken: int) -> _OpenBlock:
    expected = block_file_bytes(frame, block.n_cells)
    try:
        descriptor = os.open(directory / block.file_name, os.O_RDONLY)
    except FileNotFoundError:
        raise BlockDamaged(block.file_name, "missing") from None
    try:
        size = os.fstat(descriptor).st_size
        if size != block.bytes or size != expected:
            raise BlockDamaged(block.file_name, f"{size} bytes, not {expected}")
        magic, version, n_cells, crc, key = BLOCK_HEADER.unpack(
            os.pread(descriptor, BLOCK_HEADER.size, 0)
        )
        if (magic, version, n_cells, key) != (BLOCK_MAGIC, BLOCK_VERSION, block.n_cells, block.key):
            raise BlockDamaged(block.file_name, "another block's header")
        if crc != block.crc:
            raise BlockDamaged(block.file_name, "checksum mismatch")
    except BaseException:
        os.close(descriptor)
        raise
    return _OpenBlock(block, descriptor, taken)


def _write_layers(
    frame: KvFrame, tokens: Sequence[int], used: Sequence[_OpenBlock], descriptor: int
) -> int:
    """Write the slot file of `tokens` to `descriptor` from the blocks `used`; raises
    BlockDamaged when a block's checksum does not match. Bytes written."""
    n_cells = len(tokens)
    layers = [(frame.k_header(layer), row, 0) for layer, (_, row) in enumerate(frame.k)]
    layers += [
        (frame.v_header(layer), frame.v_cell_bytes(layer), width if frame.v_trans else 0)
        for layer, (_, _, width) in enumerate(frame.v)
    ]
    widest = max(cell_bytes for _, cell_bytes, _ in layers)
    largest = max(block.stored.n_cells for block in used) * widest
    every_block = sum(block.stored.n_cells for block in used) * widest
    buffer = memoryview(bytearray(max(min(ASSEMBLE_BUFFER_BYTES, every_block), largest)))
    at = _pwrite_all(descriptor, [header_bytes(tokens), frame.state_head(n_cells)], 0)
    layer_start = 0  # where the layer starts in a payload, in bytes per cell of the block
    for header, cell_bytes, width in layers:
        at += _pwrite_all(descriptor, [header], at)
        region = np.empty((width, cell_bytes // width * n_cells), np.uint8) if width else None
        cell = 0
        for group in _groups(used, cell_bytes, len(buffer)):
            pieces = _read_group(group, cell_bytes, layer_start, buffer)
            _checksum(group, pieces)
            if region is None:
                chunks = [
                    piece[: cell_bytes * block.taken]
                    for block, piece in zip(group, pieces, strict=True)
                ]
                at += _pwrite_all(descriptor, chunks, at)
            else:
                cell = _gather(region, group, pieces, cell)
        if region is not None:
            at += _pwrite_all(descriptor, [memoryview(region.reshape(-1))], at)
        layer_start += cell_bytes
    at += _pwrite_all(descriptor, [frame.state_tail()], at)
    for block in used:
        if block.crc != block.stored.crc:
            raise BlockDamaged(block.stored.file_name, "checksum mismatch")
    return at


def _groups(
    used: Sequence[_OpenBlock], cell_bytes: int, room: int
) -> Iterator[Sequence[_OpenBlock]]:
    """The blocks in runs whose rows of one layer fit `room` bytes (and one `os.pwritev`)."""
    group: list[_OpenBlock] = []
    filled = 0
    for block in used:
        size = cell_bytes * block.stored.n_cells
        if group and (filled + size > room or len(group) == WRITE_PIECES):
            yield group
            group, filled = [], 0
        group.append(block)
        filled += size
    if group:
        yield group


def _read_group(
    group: Sequence[_OpenBlock], cell_bytes: int, layer_start: int, buffer: memoryview
) -> list[memoryview]:
    """Read each block's rows of one layer, all its cells (its checksum covers them), one after
    the other into `buffer`: a view of each."""
    pieces, filled = [], 0
    for block in group:
        block_cells = block.stored.n_cells
        length = cell_bytes * block_cells
        piece = buffer[filled : filled + length]
        offset = BLOCK_HEADER.size + layer_start * block_cells
        done = 0
        while done < length:
            got = os.preadv(block.descriptor, [piece[done:]], offset + done)
            if got <= 0:
                raise BlockDamaged(block.stored.file_name, "ends early")
            done += got
        pieces.append(piece)
        filled += length
    return pieces


def _checksum(group: Sequence[_OpenBlock], pieces: Sequence[memoryview]) -> None:
    """Carry each block's checksum on over its piece (a block's pieces come in payload order)."""
    for block, piece in zip(group, pieces, strict=True):
        block.crc = zlib.crc32(piece, block.crc)


def _gather(
    region: np.ndarray, group: Sequence[_OpenBlock], pieces: Sequence[memoryview], cell: int
) -> int:
    """Put the group's slices of a transposed V layer's rows into `region` (each of its rows
    holds the cells' elements in order) from cell `cell` on: the cell after them."""
    width = region.shape[0]
    for block, piece in zip(group, pieces, strict=True):
        rows = np.frombuffer(piece, np.uint8).reshape(width, -1)
        size = rows.shape[1] // block.stored.n_cells
        region[:, size * cell : size * (cell + block.taken)] = rows[:, : size * block.taken]
        cell += block.taken
    return cell


def _pwrite_all(descriptor: int, parts: Sequence[bytes | memoryview], at: int) -> int:
    """Write `parts` one after the other at `at` (`os.pwritev` may write less than asked)."""
    wanted = sum(len(part) for part in parts)
    done = os.pwritev(descriptor, parts, at)
    if done < wanted:  # rare: a signal, or a file system filling up meanwhile
        rest = memoryview(b"".join(parts))
        while done < wanted:
            done += os.pwrite(descriptor, rest[done:], at + done)
    return wanted


def framed_data(path: Path) -> np.ndarray:
    """A whole file as bytes for `cut_payload`, mapped rather than read: a state of gigabytes
    is cut block by block from the page cache (the file was just written), never held whole."""
    return np.memmap(path, dtype=np.uint8, mode="r")
