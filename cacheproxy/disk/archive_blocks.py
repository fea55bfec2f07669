"""Archives as blocks of KV cells: a saved slot file cut into blocks that the tenant's archives
share (`convert`); the slot files llama-server restores from them are made in
`archive_restore_files`.

A conversion writes the blocks no archive of the tenant has yet, syncs them and their folder,
and only then, in one transaction, names them in the index and records the archive's frame
and its blocks in order; the whole file then goes, or stays as the archive's whole copy while
the global budget has room for it (`_room_for_copy`). (The blocks kept already that it will
use were named as its own when it was saved: `ArchiveQuotas.commit`.)
A crash at any point leaves either the whole-file archive with block files no row names
(`recover` removes them), or the block archive with a whole file no row needs (removed too).
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cacheproxy.disk.archive_repair import ArchiveRepair
from cacheproxy.disk.archive_schema import make_private_directory
from cacheproxy.disk.archive_types import unlink_files
from cacheproxy.disk.blocks import pack
from cacheproxy.disk.kv_blocks import (
    BlockCut,
    StoredBlock,
    block_cuts,
    block_file_bytes,
    cut_payload,
    framed_data,
    new_block_file,
    sync_directory,
    sync_files,
    write_block,
)
from cacheproxy.disk.kv_frame import KvFrame, StatePlacement, Unframed, read_framed
from cacheproxy.disk.slot_file import SlotFileError


@dataclass(frozen=True)
class Conversion:
    """What cutting an archive into blocks did."""

    archive_id: str
    blocks: int  # the archive's blocks
    written_bytes: int  # of the blocks written now
    reused_bytes: int  # of the blocks the tenant's archives had already
    kept_whole: str | None = None  # why it stays a whole file (its layout is not cut)
    whole_copy: bool = False  # its whole file stays beside the blocks (`restore_file`)


class ArchiveBlocks(ArchiveRepair):
    """Cutting archives into blocks, and slot files for restores from them."""

    def unconverted(self) -> list[str]:
        """Archives whose whole file has not been looked at yet, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM archives WHERE frame IS NULL ORDER BY created, id"
            ).fetchall()
        return [archive_id for (archive_id,) in rows]

    def convert(self, archive_id: str) -> Conversion | None:
        """Cut the whole-file archive `archive_id` into blocks, writing only those the
        tenant's archives lack; None if there is nothing to do (gone, converted, or its file is
        missing or damaged: restores and `recover` deal with that)."""
        for _ in range(2):  # a block it meant to share may leave meanwhile: look again once
            try:
                return self._convert(archive_id)
            except _BlockLeft:
                continue
        return None

    def _convert(self, archive_id: str) -> Conversion | None:
        with self._lock:
            row = self._db.execute(
                "SELECT tenant_id, fingerprint, file_name, bytes, tokens, frame FROM archives"
                " WHERE id = ?",
                [archive_id],
            ).fetchone()
        if row is None or row[5] is not None:
            return None
        tenant_id, fingerprint, file_name, size, stored, _ = row
        with self._lock:
            self._cut_sources.add(file_name)
        try:  # the file is mapped in `_cut`, and unmapped as it returns (its only reference)
            return self._cut(archive_id, tenant_id, fingerprint, file_name, size, stored)
        finally:
            with self._lock:
                self._cut_sources.discard(file_name)

    def _cut(
        self,
        archive_id: str,
        tenant_id: str,
        fingerprint: str,
        file_name: str,
        size: int,
        stored: bytes,
    ) -> Conversion | None:
        path = self.path_for(file_name)
        try:
            framed = read_framed(path)
            # mapped before anything is written: an eviction of the archive meanwhile takes
            # its name, not the data this cut reads (and `_record` then finds it gone)
            data = framed_data(path)
        except Unframed as exc:
            return self._keep_whole(archive_id, str(exc))
        except (OSError, SlotFileError, ValueError):
            return None  # gone already (evicted, replaced), or not a file a server wrote
        if (
            framed.header.file_size != size
            or len(data) != size
            or pack(framed.header.tokens) != bytes(stored)
        ):
            return None
        cuts = block_cuts(framed.header.tokens)
        with self._lock:
            existing = self._blocks_with_keys(tenant_id, fingerprint, [cut.key for cut in cuts])
        missing = [cut for cut in cuts if (cut.key, cut.n_cells) not in existing]
        written = self._write_blocks(data, framed.frame, framed.placement, missing)
        if written is None:
            return None  # no room for its blocks now: it stays a whole file, cut at the next start
        try:
            return self._record(archive_id, fingerprint, framed.frame, cuts, written)
        finally:
            with self._lock:
                self._in_flight.difference_update(block.file_name for block in written.values())

    def _keep_whole(self, archive_id: str, reason: str) -> Conversion | None:
        """Keep the archive as its whole file (its layout is not cut): the blocks saved for
        its cut go, unless other archives use them."""
        with self._lock, self._db.write():
            blocks = [
                block_id
                for (block_id,) in self._db.execute(
                    "DELETE FROM archive_kv_blocks WHERE archive_id = ? RETURNING block_id",
                    [archive_id],
                ).fetchall()
            ]
            cursor = self._db.execute(
                "UPDATE archives SET frame = '' WHERE id = ? AND frame IS NULL", [archive_id]
            )
            freed = self._free_unused_blocks(blocks)
        unlink_files(freed)
        if cursor.rowcount == 0:
            return None
        return Conversion(archive_id, 0, 0, 0, kept_whole=reason)

    def _write_blocks(
        self,
        data: np.ndarray,
        frame: KvFrame,
        placement: StatePlacement,
        cuts: Sequence[BlockCut],
    ) -> dict[tuple[bytes, int], StoredBlock] | None:
        """Write the blocks of `cuts` from the whole file `data` (`framed_data`), then sync
        them and their folder. None: the file system has no room for them beside the whole file
        now."""
        if not cuts:
            return {}
        make_private_directory(self.blocks_directory)
        file_names = self._room_for_blocks([block_file_bytes(frame, cut.n_cells) for cut in cuts])
        if file_names is None:
            return None
        written: dict[tuple[bytes, int], StoredBlock] = {}
        try:
            for cut, file_name in zip(cuts, file_names, strict=True):
                payload = cut_payload(frame, placement, data, cut.start, cut.end)
                block = write_block(
                    self.blocks_directory, cut.key, cut.n_cells, payload, False, file_name
                )
                written[(cut.key, cut.n_cells)] = block
            sync_files(self.blocks_directory, file_names)
            sync_directory(self.blocks_directory)
        except BaseException:
            self._drop_new_blocks(file_names)
            raise
        return written

    def _room_for_blocks(self, sizes: Sequence[int]) -> list[str] | None:
        """New block files with room for `sizes` allocated, counted and made under the index's
        write lock: a save reserving room meanwhile sees them in the file system's free space.
        Whole copies are dropped for that room (least recently used first), as a save drops
        them. None (and no file) when the free space, less the saves reserved and the spare
        room the folder keeps, cannot hold them all even so: the cut waits rather than evicting
        archives for a need that lasts only until the whole file goes."""
        total = sum(sizes)
        for attempt in range(2):
            with self._lock, self._db.write():
                shortfall = self._disk_shortfall(total)
                if shortfall <= 0:
                    return self._new_block_files(sizes)
                # the copies go only if they free enough, and once (a copy lent to a restore
                # frees its bytes when the server gives it back, not now)
                if attempt or self._copy_bytes([]) < shortfall:
                    return None
                copies, _ = self._drop_copies(shortfall, [])
                unlinked = self._unlent_paths(copies)
            unlink_files(unlinked)
        return None

    def _new_block_files(self, sizes: Sequence[int]) -> list[str] | None:
        """Block files of `sizes` allocated (None, and none left, on a full file system)."""
        file_names: list[str] = []
        try:
            for size in sizes:
                file_names.append(self._lend(new_block_file(self.blocks_directory, size)))
        except OSError as exc:
            self._drop_new_blocks(file_names)
            if exc.errno == errno.ENOSPC:
                return None
            raise
        return file_names

    def _drop_new_blocks(self, file_names: Sequence[str]) -> None:
        with self._lock:
            self._in_flight.difference_update(file_names)
        unlink_files(self.blocks_directory / file_name for file_name in file_names)

    def _record(
        self,
        archive_id: str,
        fingerprint: str,
        frame: KvFrame,
        cuts: Sequence[BlockCut],
        written: dict[tuple[bytes, int], StoredBlock],
    ) -> Conversion | None:
        """One transaction: the new blocks' rows, the archive's blocks and frame, the archives
        it contains replaced. Unused files are removed after it."""
        garbage = [self.blocks_directory / block.file_name for block in written.values()]
        now = self._clock()
        try:
            with self._lock, self._db.write():
                row = self._db.execute(
                    "SELECT tenant_id, fingerprint, frame, file_name FROM archives WHERE id = ?",
                    [archive_id],
                ).fetchone()
                if row is None or row[1] != fingerprint or row[2] is not None:
                    return None  # gone, relabelled or converted meanwhile: the files go
                tenant_id, _, _, whole_file = row
                # one statement for all its blocks: a cut has one every 64 tokens
                kept = self._blocks_with_keys(tenant_id, fingerprint, [cut.key for cut in cuts])
                block_ids, new_rows, written_bytes, reused_bytes = [], [], 0, 0
                for cut in cuts:
                    key = (cut.key, cut.n_cells)
                    if key in kept:  # shared (if another cut wrote it meanwhile, ours goes)
                        block_id, size = kept[key]
                        reused_bytes += size
                    elif key in written:
                        block = written[key]
                        block_id = block.file_name
                        new_rows.append(_block_row(block, tenant_id, fingerprint, now))
                        garbage.remove(self.blocks_directory / block_id)
                        written_bytes += block.bytes
                    else:
                        raise _BlockLeft
                    block_ids.append(block_id)
                self._db.executemany(
                    "INSERT INTO kv_blocks (id, tenant_id, fingerprint, hash, n_cells, bytes, crc,"
                    " created) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    new_rows,
                )
                # the blocks saved for it at commit are among these, in the same places
                self._db.execute("DELETE FROM archive_kv_blocks WHERE archive_id = ?", [archive_id])
                self._db.executemany(
                    "INSERT INTO archive_kv_blocks (archive_id, ordinal, block_id)"
                    " VALUES (?, ?, ?)",
                    [(archive_id, ordinal, block_id) for ordinal, block_id in enumerate(block_ids)],
                )
                copy, dropped_copies = self._room_for_copy(archive_id)
                self._db.execute(
                    "UPDATE archives SET frame = ?, in_blocks = 1, whole_copy = ? WHERE id = ?",
                    [frame.to_json(), int(copy), archive_id],
                )
                # a restore reads it: `release` removes it (looked at under the lock a restore
                # lends it under, so neither misses the other)
                unlinked = self._unlent_paths([*([] if copy else [whole_file]), *dropped_copies])
        finally:
            unlink_files(garbage)
        unlink_files(unlinked)
        return Conversion(archive_id, len(cuts), written_bytes, reused_bytes, whole_copy=copy)

    def _room_for_copy(self, archive_id: str) -> tuple[bool, list[str]]:
        """Whether the archive, cut into blocks now, keeps its whole file as a copy: when the
        budget holds it beside the archives and reservations, once copies of archives used
        less recently than it are dropped if need be (their file names, to unlink after the
        transaction). Inside the caller's write transaction, its blocks recorded."""
        if not self.whole_copies:
            return False, []
        size, last_used = self._db.execute(
            "SELECT bytes, last_used FROM archives WHERE id = ?", [archive_id]
        ).fetchone()
        # the archive itself is counted as its blocks from here on
        held = self._used(None, [], None)[0] - size
        need = held + self._copy_bytes([archive_id]) + size - self.budget_bytes
        if need <= 0:
            return True, []
        # copies of archives used more recently than it stay
        if self._copy_bytes([archive_id], used_by=last_used) < need:
            return False, []
        copies, _ = self._drop_copies(need, [archive_id], used_by=last_used)
        return True, copies

    def _lend(self, file_name: str) -> str:
        """Note a file made for the server: recovery leaves it alone until it is given back."""
        with self._lock:
            self._in_flight.add(file_name)
        return file_name


def _block_row(
    block: StoredBlock, tenant_id: str, fingerprint: str, now: float
) -> tuple[str, str, str, bytes, int, int, int, float]:
    """The kv_blocks row naming a block just written."""
    return (
        block.file_name,
        tenant_id,
        fingerprint,
        block.key,
        block.n_cells,
        block.bytes,
        block.crc,
        now,
    )


class _BlockLeft(Exception):
    """A block a conversion meant to share was freed before it was recorded."""
