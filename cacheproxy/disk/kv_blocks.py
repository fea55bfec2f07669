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
from concurrent.futures import ThreadPoolExecutor
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
# a block's payload is checked through a buffer of this size
CHECK_CHUNK_BYTES = 1 << 20


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


def write_block(
    directory: Path, key: bytes, n_cells: int, payload: np.ndarray, sync: bool = True
) -> StoredBlock:
    """Write a new block file of `n_cells` cells under a fresh opaque name, synced unless
    `sync` is False (a cut writes all its blocks, then syncs them together: `sync_files`; the
    caller syncs the folder once its blocks are synced, before any row names them)."""
    crc = zlib.crc32(payload)
    file_name = f"b_{secrets.token_hex(16)}.kv"
    path = directory / file_name
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb", closefd=False) as file:
            file.write(BLOCK_HEADER.pack(BLOCK_MAGIC, BLOCK_VERSION, n_cells, crc, key))
            file.write(memoryview(payload))
        if sync:
            os.fsync(descriptor)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    finally:
        os.close(descriptor)
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
    while another thread checks those blocks' checksums: the rows go from the block files to
    the file inside the kernel (`os.copy_file_range`, no copy through Python; a transposed V
    layer is gathered into one buffer first). It is given back only once every checksum
    matched, so a damaged block never reaches the server. Not synced: the server reads it
    once, from the page cache, and it is deleted after."""
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
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="block-checksums") as checker:
            checked = checker.submit(_check_payloads, used)
            try:
                written = _write_file(frame, tokens, used, target)
                checked.result()
            except BaseException:
                with contextlib.suppress(OSError):
                    target.unlink()
                raise
        return written
    finally:
        for block in used:
            os.close(block.descriptor)


@dataclass(frozen=True)
class _OpenBlock:
    """A block file open for reading (its size and header checked), and the cells of it the
    file takes."""

    stored: StoredBlock
    descriptor: int
    taken: int


@dataclass(frozen=True)
class _Range:
    """`length` bytes of a block's payload from `offset`."""

    block: _OpenBlock
    offset: int
    length: int


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


def _check_payloads(used: Sequence[_OpenBlock]) -> None:
    """Raise BlockDamaged unless each block's payload has its checksum (read in pieces into one
    buffer; zlib lets go of the GIL over each, so this runs beside the copy)."""
    buffer = memoryview(bytearray(CHECK_CHUNK_BYTES))
    for block in used:
        crc, offset, end = 0, BLOCK_HEADER.size, block.stored.bytes
        while offset < end:
            view = buffer[: min(CHECK_CHUNK_BYTES, end - offset)]
            got = os.preadv(block.descriptor, [view], offset)
            if got <= 0:
                raise BlockDamaged(block.stored.file_name, "ends early")
            crc = zlib.crc32(view[:got], crc)
            offset += got
        if crc != block.stored.crc:
            raise BlockDamaged(block.stored.file_name, "checksum mismatch")


def _write_file(
    frame: KvFrame, tokens: Sequence[int], used: Sequence[_OpenBlock], target: Path
) -> int:
    """Write the slot file (`_file_parts`): its fields from memory, its rows copied from the
    block files by the kernel. Bytes written."""
    descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        at = 0
        fields = bytearray()  # the fields between two ranges of rows, written in one call
        for part in _file_parts(frame, tokens, used):
            if not isinstance(part, _Range):
                fields += part
                continue
            at += _write_all(descriptor, fields, at)
            fields.clear()
            source = part.block.descriptor
            _copy_range(source, BLOCK_HEADER.size + part.offset, descriptor, at, part.length)
            at += part.length
        return at + _write_all(descriptor, fields, at)
    finally:
        os.close(descriptor)


def _write_all(descriptor: int, data: bytes | bytearray | memoryview, at: int) -> int:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(descriptor, view[done:], at + done)
    return done


def _copy_range(source: int, source_at: int, target: int, target_at: int, length: int) -> None:
    """Copy `length` bytes between two files inside the kernel; through a buffer where the
    file system cannot."""
    done = 0
    with contextlib.suppress(OSError):  # e.g. EXDEV, EOPNOTSUPP: the buffer below does it
        while done < length:
            copied = os.copy_file_range(
                source, target, length - done, source_at + done, target_at + done
            )
            if copied <= 0:
                break
            done += copied
    while done < length:
        data = os.pread(source, min(length - done, CHECK_CHUNK_BYTES), source_at + done)
        if not data:
            raise OSError(f"a block file ends {length - done} bytes early")
        done += _write_all(target, data, target_at + done)


def _file_parts(
    frame: KvFrame, tokens: Sequence[int], used: Sequence[_OpenBlock]
) -> Iterator[bytes | memoryview | _Range]:
    """The slot file of `tokens` in pieces, in order: each layer's rows are the blocks' ranges
    of it, one after the other (a block's payload holds its cells layer by layer)."""
    n_cells = len(tokens)
    yield header_bytes(tokens)
    yield frame.state_head(n_cells)
    at = 0  # where the layer starts in a payload, in bytes per cell of the block
    for layer, (_, row) in enumerate(frame.k):
        yield frame.k_header(layer)
        for block in used:
            yield _Range(block, at * block.stored.n_cells, row * block.taken)
        at += row
    for layer, (_, size, width) in enumerate(frame.v):
        yield frame.v_header(layer)
        if frame.v_trans:
            # each of the `width` rows holds the cells' elements in order: gathered from every
            # block's slice of that row
            region = np.empty((width, size * n_cells), dtype=np.uint8)
            cell = 0
            for block in used:
                block_cells, count = block.stored.n_cells, block.taken
                source = _read_exactly(
                    block, BLOCK_HEADER.size + at * block_cells, width * size * block_cells
                )
                rows = source.reshape(width, size * block_cells)
                region[:, size * cell : size * (cell + count)] = rows[:, : size * count]
                cell += count
            yield memoryview(region.reshape(-1))
        else:
            for block in used:
                yield _Range(block, at * block.stored.n_cells, size * block.taken)
        at += frame.v_cell_bytes(layer)
    yield frame.state_tail()


def _read_exactly(block: _OpenBlock, offset: int, length: int) -> np.ndarray:
    data = np.empty(length, dtype=np.uint8)
    done = 0
    while done < length:
        got = os.preadv(block.descriptor, [memoryview(data)[done:]], offset + done)
        if got <= 0:
            raise BlockDamaged(block.stored.file_name, "ends early")
        done += got
    return data


def framed_data(path: Path) -> np.ndarray:
    """A whole file as bytes for `cut_payload`, mapped rather than read: a state of gigabytes
    is cut block by block from the page cache (the file was just written), never held whole."""
    return np.memmap(path, dtype=np.uint8, mode="r")
