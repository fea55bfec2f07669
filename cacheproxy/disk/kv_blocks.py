"""Blocks of KV cells on disk: cut from a framed slot file (`kv_frame`), each written once and
synced, and read back checked (a slot file of any prefix of the cells is put together from
them by `kv_assembly`).

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
from cacheproxy.disk.kv_frame import KvFrame, StatePlacement

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
def opened_to_write(path: Path, create: bool = True) -> Iterator[int]:
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
    allocate_file(directory / file_name, size)
    return file_name


def allocate_file(path: Path, size: int) -> None:
    """Create the file `path` (never over another) with `size` bytes allocated on disk: the
    file system's free space counts them from now on, before they are written."""
    with opened_to_write(path) as descriptor:
        os.posix_fallocate(descriptor, 0, size)


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
    with opened_to_write(path, create=made) as descriptor:
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


def framed_data(path: Path) -> np.ndarray:
    """A whole file as bytes for `cut_payload`, mapped rather than read: a state of gigabytes
    is cut block by block from the page cache (the file was just written), never held whole."""
    return np.memmap(path, dtype=np.uint8, mode="r")
