"""Slot files for llama-server to restore from the archive index: an archive kept as blocks put
together for exactly the prefix a request reuses (its blocks' checksums checked while the server
reads it), or its whole copy lent when the restore takes most of it; an archive kept whole lends
its own file. Each file is given back with `release`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from collections.abc import Sequence

from cacheproxy.disk.archive_blocks import ArchiveBlocks
from cacheproxy.disk.archive_reads import file_holds
from cacheproxy.disk.archive_types import Archive, RestoreFile, unlink_files
from cacheproxy.disk.blocks import pack, token_array, unpack
from cacheproxy.disk.kv_assembly import BlockCheck, RestoreBlocks
from cacheproxy.disk.kv_blocks import BlockDamaged, StoredBlock, allocate_file
from cacheproxy.disk.kv_frame import KvFrame, StatePlacement, header_bytes


class ArchiveRestoreFiles(ArchiveBlocks):
    """Files made or lent for restores, and given back."""

    def restore_file(
        self,
        archive: Archive,
        archive_tokens: Sequence[int],
        n_tokens: int,
        from_copy: bool = False,
    ) -> RestoreFile | None:
        """A file in the folder for llama-server to restore: for an archive kept as blocks,
        one put together of exactly its first `n_tokens` tokens, or with `from_copy` its whole
        copy, if it still keeps one (`policy.restore_read` says which costs less); for one kept
        whole, its own file, all of `archive_tokens` (lent: a cut meanwhile leaves it until
        `release`).
        `archive_tokens` are the archive's, as the lookup found them. None when
        the archive is gone, or turned out damaged or replaced on disk: then it is dropped, and
        with a damaged block every archive using it; or when the file system has no room to
        put it together (it stays). The checksums of the blocks a file is put together from
        are checked while the server reads it: what it restored may be used only once
        `checked` says so. Give the file back with `release`."""
        packed = pack(token_array(archive_tokens))
        if not 0 < n_tokens <= len(packed) // 4:
            raise ValueError(f"{n_tokens} tokens of an archive of {len(packed) // 4}")
        for _ in range(2):  # a whole file may be cut into blocks while this looks
            with self._lock:
                row = self._db.execute(
                    "SELECT frame, tokens, whole_copy FROM archives WHERE id = ?", [archive.id]
                ).fetchone()
            if row is None or bytes(row[1]) != packed:
                return None  # gone (another restore found it damaged, or it was evicted)
            if row[0]:
                if from_copy and row[2]:
                    lent = self._lent_copy(archive, packed)
                    if lent is not None:
                        return lent
                return self._assembled(archive.id, KvFrame.from_json(row[0]), packed, n_tokens)
            made = self._lent_whole(archive, archive_tokens)
            if made is not None or not self._converted(archive.id):
                return made
        return None

    def _assembled(
        self, archive_id: str, frame: KvFrame, packed: bytes, n_tokens: int
    ) -> RestoreFile | None:
        with self._lock:
            blocks = [
                StoredBlock(block_id, bytes(key), n_cells, crc, size)
                for block_id, key, n_cells, crc, size in self._db.execute(
                    "SELECT b.id, b.hash, b.n_cells, b.crc, b.bytes FROM archive_kv_blocks r"
                    " JOIN kv_blocks b ON b.id = r.block_id WHERE r.archive_id = ?"
                    " ORDER BY r.ordinal",
                    [archive_id],
                ).fetchall()
            ]
            # counted as held from the moment they are found: an eviction meanwhile frees
            # their names, their room only once they are closed (`_close_blocks`)
            held = tuple(block.file_name for block in blocks)
            self._open_blocks.update(held)
        started = time.perf_counter()
        file_name = self._lend(_restore_name())
        check: BlockCheck | None = None
        tokens = unpack(packed[: 4 * n_tokens])
        try:
            self._room_for_restore(file_name, frame.placement(len(header_bytes(tokens)), n_tokens))
            used = RestoreBlocks.open(
                self.blocks_directory, frame, blocks, n_tokens, self._checked_blocks
            )
            # the checksums are checked meanwhile, not on the way to the server: `checked`
            check = BlockCheck(used)
            written = used.write(tokens, self.path_for(file_name), create=False)
        except BaseException as exc:
            self._forget(file_name)
            with contextlib.suppress(BlockDamaged, OSError):
                self._close_blocks(check, held)
            if isinstance(exc, BlockDamaged):
                self._drop_block(exc.file_name, archive_id)
                return None
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                return None  # a full file system: prefilled this time, the archive stays
            raise
        with self._lock:
            self._checks[file_name] = (archive_id, check, held)
        made_ms = (time.perf_counter() - started) * 1000
        return RestoreFile(file_name, n_tokens, written, temporary=True, made_ms=made_ms)

    def _room_for_restore(self, file_name: str, placement: StatePlacement) -> None:
        """Make the file a restore is put together in, its room allocated under the index's
        write lock: beside the saves reserved (not in the room promised to one the server may
        be writing), and seen in the free space by any save reserving after it. Raises OSError
        (ENOSPC) without that room (it may use the spare room saves leave, `min_free_bytes`:
        the file lives only until the server has read it)."""
        with self._lock, self._db.write():
            if self._disk_shortfall(placement.end) - self.min_free_bytes > 0:
                raise OSError(errno.ENOSPC, "no room for a restore beside the saves reserved")
            allocate_file(self.path_for(file_name), placement.end)

    def checked(self, restore: RestoreFile) -> bool:
        """Whether the blocks `restore` was put together from match their checksums (a whole
        file's were checked before it was lent: `intact`). Waits for their check, started
        when it was put together; False when a block is damaged: the archives using it are
        dropped, and whatever the server restored from the file must not be used. Raises
        OSError when the blocks cannot be read."""
        with self._lock:
            pending = self._checks.pop(restore.file_name, None)
        if pending is None:
            return True
        archive_id, check, held = pending
        try:
            self._close_blocks(check, held)
        except BlockDamaged as exc:
            self._drop_block(exc.file_name, archive_id)
            return False
        return True

    def _lent_whole(self, archive: Archive, archive_tokens: Sequence[int]) -> RestoreFile | None:
        """A whole-file archive's own file, lent to the server: a cut of the archive meanwhile
        leaves the file until it is given back. None (and the archive dropped, unless it was
        cut into blocks meanwhile) when the file is not the one saved."""
        if not self.intact(archive, archive_tokens):
            if not self._converted(archive.id):
                self.remove(archive.id)
            return None
        with self._lock:
            # lent only while still a whole file: a cut committed later leaves the file for
            # `release`, one committed before is seen here (the same lock orders them)
            row = self._db.execute(
                "SELECT coalesce(frame, '') <> '' FROM archives WHERE id = ?", [archive.id]
            ).fetchone()
            if row is None or row[0]:
                return None
            self._in_flight.add(archive.file_name)
        return RestoreFile(
            archive.file_name, archive.n_tokens, archive.bytes, temporary=False, made_ms=0.0
        )

    def _lent_copy(self, archive: Archive, packed: bytes) -> RestoreFile | None:
        """A block archive's whole copy, lent to the server as a whole archive's file is.
        None when it was dropped meanwhile, or is not the file saved (then it is dropped: the
        archive stays, as its blocks)."""
        path = self.path_for(archive.file_name)
        try:
            whole = path.stat().st_size == archive.bytes and file_holds(path, packed)
        except OSError:
            whole = False
        if not whole:
            self.drop_copy(archive.id)
            return None
        with self._lock:
            # lent only while still kept: a drop committed later leaves it for `release`
            row = self._db.execute(
                "SELECT whole_copy FROM archives WHERE id = ? AND file_name = ?",
                [archive.id, archive.file_name],
            ).fetchone()
            if row is None or not row[0]:
                return None
            self._in_flight.add(archive.file_name)
        return RestoreFile(
            archive.file_name, archive.n_tokens, archive.bytes, temporary=False, made_ms=0.0
        )

    def drop_copy(self, archive_id: str) -> bool:
        """Drop the archive's whole copy (not the file it is, or the server could not restore
        it): the archive stays, as its blocks. False when it kept none."""
        with self._lock, self._db.write():
            row = self._db.execute(
                "UPDATE archives SET whole_copy = 0 WHERE id = ? AND whole_copy <> 0"
                " AND coalesce(frame, '') <> '' RETURNING file_name",
                [archive_id],
            ).fetchone()
            dropped = [] if row is None else self._unlent_paths([row[0]])
        unlink_files(dropped)
        return row is not None

    def _converted(self, archive_id: str) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT coalesce(frame, '') <> '' FROM archives WHERE id = ?", [archive_id]
            ).fetchone()
        return row is not None and bool(row[0])

    def release(self, restore: RestoreFile) -> None:
        """The server has read `restore` (or failed to): remove it if it was made for it, or
        if its archive was cut into blocks meanwhile (keeping no copy) or its copy dropped."""
        if restore.temporary:
            with self._lock:
                pending = self._checks.pop(restore.file_name, None)
            if pending is not None:  # nobody asked how it went: the blocks are closed all the same
                with contextlib.suppress(BlockDamaged, OSError):
                    self._close_blocks(pending[1], pending[2])
            self._forget(restore.file_name)
            return
        with self._lock:
            self._in_flight.discard(restore.file_name)
            (whole,) = self._db.execute(
                "SELECT count(*) FROM archives WHERE file_name = ?"
                " AND (coalesce(frame, '') = '' OR whole_copy <> 0)",
                [restore.file_name],
            ).fetchone()
        if not whole:
            unlink_files([self.path_for(restore.file_name)])

    def _close_blocks(self, check: BlockCheck | None, held: Sequence[str]) -> None:
        """Wait for the blocks' check (raising what it raised) and close them: their room,
        if they left meanwhile, is free from now on."""
        try:
            if check is not None:
                check.finish()
        finally:
            with self._lock:
                self._open_blocks.subtract(held)
                for name in held:
                    if self._open_blocks[name] <= 0:
                        del self._open_blocks[name]

    def _forget(self, file_name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_for(file_name))
        with self._lock:
            self._in_flight.discard(file_name)

    def _drop_block(self, block_id: str, archive_id: str) -> None:
        """A damaged block: every archive using it goes (and `archive_id`, whatever it uses)."""
        with self._lock, self._db.write():
            users = [
                user
                for (user,) in self._db.execute(
                    "SELECT DISTINCT archive_id FROM archive_kv_blocks WHERE block_id = ?",
                    [block_id],
                ).fetchall()
            ]
            freed = self._delete_archives({*users, archive_id})
        unlink_files(freed)


def _restore_name() -> str:
    """A file llama-server can restore (see `archive_types.FILE_NAME_PATTERN`), named apart
    from the archives: `recover` removes those left behind."""
    return f"r_{secrets.token_hex(16)}.slot"
