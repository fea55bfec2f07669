"""A slot file of a prefix of the cells put together from blocks (`kv_blocks`), and the blocks'
checksums checked apart from it.

The blocks a prefix uses are opened first and their sizes and headers checked
(`RestoreBlocks.open`): a block evicted meanwhile stays readable through its descriptor. The file is
then written layer by layer (`write`): each block's rows of a layer written from its mapped pages
(`os.pwritev` of many pieces at once: the kernel copies them, Python never reads them), a transposed
V layer gathered through a bounded buffer. The payloads' checksums are checked by `check`, which
reads every byte of every block used once (but for blocks whose files have not changed since they
last matched: `checked_blocks`): the disk tier runs it on another thread while the file is written
and the server reads it, and the slot is emptied before any request uses it when a checksum does
not match (`RestoreChecks`). Putting a prefix together then costs about a copy of the prefix, not
a copy and a checksum of it on the way to the server; `assemble` does both in order, for a file
given back only once checked.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from cacheproxy.disk.checked_blocks import CheckedBlocks, FileStatus
from cacheproxy.disk.kv_blocks import (
    BLOCK_HEADER,
    BLOCK_MAGIC,
    BLOCK_VERSION,
    BlockDamaged,
    StoredBlock,
    block_file_bytes,
    opened_to_write,
)
from cacheproxy.disk.kv_frame import KvFrame, header_bytes

# a transposed V layer is gathered through a buffer of at most this size (one layer's rows of
# as many blocks as fit), written with at most this many pieces per call (IOV_MAX: 1024)
ASSEMBLE_BUFFER_BYTES = 16 << 20
WRITE_PIECES = 512
# a block's payload is checked in reads of this size: one buffer, small enough to stay cached
CHECK_READ_BYTES = 1 << 20


@dataclass
class _OpenBlock:
    """A block file open for reading (its size and header checked) and the cells of it the
    file takes."""

    stored: StoredBlock
    descriptor: int
    taken: int
    status: FileStatus  # read when opened: a check reads the payload after it


class RestoreBlocks:
    """The blocks a slot file of a prefix is put together from, open for reading: write the
    file (`write`), check their payloads (`check`, from another thread if need be: both only
    read at offsets), then `close`. With `checked`, blocks unchanged since they last matched
    are not read again, and those that match are remembered."""

    def __init__(
        self, frame: KvFrame, used: list[_OpenBlock], checked: CheckedBlocks | None = None
    ) -> None:
        self.frame = frame
        self.used = used
        self.checked = checked
        # the blocks `check` reads: all, but for those unchanged since they last matched (their
        # statuses were read when they were opened)
        unchanged = checked.unchanged if checked is not None else None
        self.unchecked = [
            block
            for block in used
            if unchanged is None or not unchanged(block.stored.file_name, block.status)
        ]

    @classmethod
    def open(
        cls,
        directory: Path,
        frame: KvFrame,
        blocks: Sequence[StoredBlock],
        n_cells: int,
        checked: CheckedBlocks | None = None,
    ) -> RestoreBlocks:
        """The blocks (in order, from cell 0) that the first `n_cells` cells take. Raises
        BlockDamaged: a block missing, or of another size or header than its row says, or
        too few blocks."""
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
        except BaseException:
            for opened in used:
                os.close(opened.descriptor)
            raise
        return cls(frame, used, checked)

    def close(self) -> None:
        for block in self.used:
            os.close(block.descriptor)
        self.used = self.unchecked = []

    def __enter__(self) -> RestoreBlocks:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def write(self, tokens: Sequence[int], target: Path, create: bool = True) -> int:
        """Write to `target` (a new file, or with `create` False one made for it) the slot
        file of `tokens`, unchecked: bytes written. Raises BlockDamaged when a block ends early
        (nothing is left at a `target` it made then). Not synced: the server reads it once,
        from the page cache, and it is deleted after."""
        with opened_to_write(target, create=create) as descriptor:
            return _write_layers(self.frame, tokens, self.used, descriptor)

    def check(self) -> int:
        """Read each unchecked block's payload whole (its checksum covers all its cells,
        whatever the file takes) and check it: bytes read. Raises BlockDamaged at the first
        that does not match."""
        buffer = memoryview(bytearray(CHECK_READ_BYTES))
        read = 0
        for block in self.unchecked:
            crc, at, end = 0, BLOCK_HEADER.size, block.stored.bytes
            while at < end:
                got = os.preadv(block.descriptor, [buffer[: min(len(buffer), end - at)]], at)
                if got <= 0:
                    raise BlockDamaged(block.stored.file_name, "ends early")
                crc = zlib.crc32(buffer[:got], crc)
                at += got
            read += end - BLOCK_HEADER.size
            if crc != block.stored.crc:
                raise BlockDamaged(block.stored.file_name, "checksum mismatch")
            if self.checked is not None:
                self.checked.checked(block.stored.file_name, block.status)
        return read


def assemble(
    directory: Path,
    frame: KvFrame,
    tokens: Sequence[int],
    blocks: Sequence[StoredBlock],
    target: Path,
) -> int:
    """Write to `target` a slot file of the first `len(tokens)` cells from `blocks`, and check
    every block used before giving it back: bytes written. Raises BlockDamaged (nothing is left
    at `target` then)."""
    with RestoreBlocks.open(directory, frame, blocks, len(tokens)) as used:
        written = used.write(tokens, target)
        try:
            used.check()
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            raise
        return written


def _open_block(directory: Path, block: StoredBlock, frame: KvFrame, taken: int) -> _OpenBlock:
    expected = block_file_bytes(frame, block.n_cells)
    try:
        descriptor = os.open(directory / block.file_name, os.O_RDONLY)
    except FileNotFoundError:
        raise BlockDamaged(block.file_name, "missing") from None
    try:
        status = FileStatus.of(descriptor)
        size = status.size
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
    return _OpenBlock(block, descriptor, taken, status)


def _write_layers(
    frame: KvFrame, tokens: Sequence[int], used: Sequence[_OpenBlock], descriptor: int
) -> int:
    """Write the slot file of `tokens` to `descriptor` from the blocks `used`: bytes written."""
    n_cells = len(tokens)
    layers = [(frame.k_header(layer), row, 0) for layer, (_, row) in enumerate(frame.k)]
    layers += [
        (frame.v_header(layer), frame.v_cell_bytes(layer), width if frame.v_trans else 0)
        for layer, (_, _, width) in enumerate(frame.v)
    ]
    buffer: memoryview | None = None
    at = _pwrite_all(descriptor, [header_bytes(list(tokens)), frame.state_head(n_cells)], 0)
    with _mapped(used) as views:
        layer_start = 0  # where the layer starts in a payload, in bytes per cell of the block
        for header, cell_bytes, width in layers:
            at += _pwrite_all(descriptor, [header], at)
            if not width:
                # the rows straight from the blocks' pages: the kernel's one copy into the file
                for start in range(0, len(used), WRITE_PIECES):
                    run = range(start, min(start + WRITE_PIECES, len(used)))
                    pieces = [views[i][_rows(used[i], layer_start, cell_bytes)] for i in run]
                    at += _write_mapped(descriptor, pieces, at, [used[i] for i in run])
                    del pieces  # views of the mappings: they close once none is left
            else:
                buffer = buffer or _gather_buffer(used, cell_bytes)
                region = np.empty((width, cell_bytes // width * n_cells), np.uint8)
                cell = 0
                for group in _groups(used, cell_bytes, len(buffer)):
                    pieces = _read_group(group, cell_bytes, layer_start, buffer)
                    cell = _gather(region, group, pieces, cell)
                at += _pwrite_all(descriptor, [memoryview(region.reshape(-1))], at)
            layer_start += cell_bytes
    at += _pwrite_all(descriptor, [frame.state_tail()], at)
    return at


def _rows(block: _OpenBlock, layer_start: int, cell_bytes: int) -> slice:
    """Where the rows of a layer the file takes lie in a block file."""
    start = BLOCK_HEADER.size + layer_start * block.stored.n_cells
    return slice(start, start + cell_bytes * block.taken)


@contextlib.contextmanager
def _mapped(used: Sequence[_OpenBlock]) -> Iterator[list[memoryview]]:
    """The block files mapped read-only. Only the kernel reads the mappings (`os.pwritev`): a
    file cut short meanwhile fails that write (EFAULT) where a read here would kill the process
    (SIGBUS)."""
    maps: list[mmap.mmap] = []
    views: list[memoryview] = []
    try:
        for block in used:
            maps.append(mmap.mmap(block.descriptor, 0, prot=mmap.PROT_READ))
            views.append(memoryview(maps[-1]))
        yield views
    finally:
        for view in views:
            view.release()
        for mapping in maps:
            # a view still held (a write that failed) unmaps it when it goes instead
            with contextlib.suppress(BufferError):
                mapping.close()


def _write_mapped(
    descriptor: int, pieces: list[memoryview], at: int, blocks: Sequence[_OpenBlock]
) -> int:
    """Write mapped pieces of `blocks` one after the other at `at`: bytes written. Raises
    BlockDamaged when a block's pages cannot be read (its file was cut short)."""
    wanted = sum(len(piece) for piece in pieces)
    done, first = 0, 0
    while first < len(pieces):
        try:
            got = os.pwritev(descriptor, pieces[first:], at + done)
        except OSError as exc:
            if exc.errno != errno.EFAULT:
                raise
            got = 0
        if got <= 0:
            raise BlockDamaged(blocks[first].stored.file_name, "ends early")
        done += got
        while first < len(pieces) and got >= len(pieces[first]):
            got -= len(pieces[first])
            first += 1
        if got:
            pieces[first] = pieces[first][got:]
    return wanted


def _gather_buffer(used: Sequence[_OpenBlock], cell_bytes: int) -> memoryview:
    largest = max(block.stored.n_cells for block in used) * cell_bytes
    every_block = sum(block.stored.n_cells for block in used) * cell_bytes
    return memoryview(bytearray(max(min(ASSEMBLE_BUFFER_BYTES, every_block), largest)))


def _groups(
    used: Sequence[_OpenBlock], cell_bytes: int, room: int
) -> Iterator[Sequence[_OpenBlock]]:
    """The blocks in runs whose rows of one layer fit `room` bytes."""
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
    """Read each block's rows of one transposed layer, all its cells (its rows are strided by
    them), one after the other into `buffer`: a view of each."""
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


class BlockCheck:
    """`RestoreBlocks.check` on a thread of its own, started at once: it runs while the file is
    written and while the server reads it. `finish` (once the file is written) waits for it,
    closes the blocks, and raises what the check raised."""

    def __init__(self, blocks: RestoreBlocks) -> None:
        self._blocks = blocks
        self._done = threading.Event()
        self._error: BaseException | None = None
        if blocks.unchecked:
            threading.Thread(target=self._run, name="archive-block-check", daemon=True).start()
        else:
            self._done.set()  # every block unchanged since it matched: nothing to read

    def _run(self) -> None:
        try:
            self._blocks.check()
        except BaseException as exc:  # handed to whoever finishes the check
            self._error = exc
        finally:
            self._done.set()

    def finish(self) -> None:
        self._done.wait()
        self._blocks.close()
        if self._error is not None:
            raise self._error
