"""The archive index's quota transactions: room reserved before llama-server writes a file,
the file committed as an archive (or the room given back), restores noted, archives removed.

Space is bounded per tenant (bytes and count, given by the caller per call) and in total
(`budget_bytes`), through reserve-then-commit transactions: room is taken before a file is
written, so no moment exists at which committed plus reserved bytes exceed a quota, however many
threads and processes save at once. Every transaction that counts and then writes holds the
index's write lock from its start (`Database.write`: SQLite's `BEGIN IMMEDIATE`, a
transaction-scoped advisory lock on PostgreSQL), so no other process can change what was counted
before it commits; single-row changes are conditional statements (`UPDATE ... WHERE`,
`DELETE ... RETURNING`). Which archives leave to make room is the eviction policy's choice (a
plugin: its answer is checked).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from array import array
from collections.abc import Callable, Sequence

from cacheproxy.disk.archive_room import ArchiveRoom
from cacheproxy.disk.archive_schema import ARCHIVE_COLUMNS
from cacheproxy.disk.archive_types import (
    Archive,
    ArchiveError,
    ArchiveFileMismatch,
    ArchiveRefused,
    Committed,
    FoundRoom,
    Match,
    QuotaExceeded,
    Reservation,
    ReservationLost,
    new_file_name,
    unlink_files,
)
from cacheproxy.disk.blocks import (
    BLOCK_BYTES,
    MIN_ARCHIVE_TOKENS,
    block_hashes,
    pack,
    token_array,
)
from cacheproxy.disk.kv_blocks import block_cuts
from cacheproxy.disk.slot_file import SlotFileError, SlotFileHeader, read_slot_file
from cacheproxy.ops.processes import process_alive, process_start_ticks


class ArchiveQuotas(ArchiveRoom):
    """Saving (reserve, let llama-server write the file, commit or abort) and upkeep (touch,
    remove), each one write transaction."""

    def find_and_reserve(
        self,
        tenant_id: str,
        fingerprint: str,
        tokens: Sequence[int],
        room_for: Callable[[Match | None], int | None],
        quota_bytes: int | None,
        quota_archives: int | None,
        file_name: str | None = None,
    ) -> FoundRoom:
        """The tenant's archive sharing the longest prefix with `tokens` (`find`) and room
        reserved for a save of them (`reserve`) when `room_for(match)` gives the bytes to
        reserve (None: no save). `room_for` is called between the two, in the caller's thread:
        it must be pure. A refusal of room (a quota, the disk) is in the answer, not raised."""
        match = self.find(tenant_id, fingerprint, tokens)
        expected_bytes = room_for(match)
        if expected_bytes is None:
            return FoundRoom(match, None)
        try:
            reservation = self.reserve(
                tenant_id, expected_bytes, quota_bytes, quota_archives, file_name
            )
        except ArchiveError as exc:
            return FoundRoom(match, None, refused=exc)
        return FoundRoom(match, reservation)

    def reserve(
        self,
        tenant_id: str,
        expected_bytes: int,
        quota_bytes: int | None,
        quota_archives: int | None,
        file_name: str | None = None,
    ) -> Reservation:
        """Take room for a save of about `expected_bytes`, evicting archives as the quotas need;
        its file is `file_name` (`new_file_name`; default: a new one), which the server may be
        writing already (`Saves`, a write beside the lookup).

        One IMMEDIATE transaction counts committed and reserved bytes, asks the eviction policy
        for victims (the tenant's own for its quota, anyone's for the global budget), deletes
        their rows and records the reservation. The victims' files are the caller's to unlink
        (`paths_to_unlink`); a crash before that leaves orphans that `recover` removes.
        """
        _require_positive("expected_bytes", expected_bytes)
        _require_quota("quota_bytes", quota_bytes)
        _require_quota("quota_archives", quota_archives)
        limits = [("the global budget", self.budget_bytes), ("the tenant quota", quota_bytes)]
        for what, limit in limits:
            if limit is not None and expected_bytes > limit:
                raise QuotaExceeded(f"{expected_bytes} bytes exceed {what} of {limit} bytes")
        if quota_archives == 0:
            raise QuotaExceeded("the tenant may keep no archives")
        reservation_id = "r_" + secrets.token_hex(8)
        file_name = file_name or new_file_name()
        pid = os.getpid()
        with self._lock, self._db.write():
            stale = self._drop_stale_reservations()
            victims, copies = self._make_room(
                tenant_id, expected_bytes, quota_bytes, quota_archives, leaving={}
            )
            more, more_copies = self._room_on_disk(expected_bytes, victims, stale, copies)
            victims |= more
            freed_blocks = self._delete_archives(victims)
            dropped_files = self._unlent_paths(
                [*stale.values(), *victims.values(), *copies, *more_copies]
            )
            self._db.execute(
                "INSERT INTO reservations (id, tenant_id, file_name, bytes, pid, pid_started, "
                "created, host) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    reservation_id,
                    tenant_id,
                    file_name,
                    expected_bytes,
                    pid,
                    process_start_ticks(pid),
                    self._clock(),
                    self.host,
                ],
            )
        return Reservation(
            id=reservation_id,
            tenant_id=tenant_id,
            file_name=file_name,
            path=self.path_for(file_name),
            expected_bytes=expected_bytes,
            quota_bytes=quota_bytes,
            quota_archives=quota_archives,
            evicted_ids=tuple(victims),
            paths_to_unlink=(*dropped_files, *freed_blocks),
        )

    def commit(
        self,
        reservation: Reservation,
        tokens: Sequence[int] | None,
        actual_bytes: int,
        fingerprint: str,
    ) -> Committed:
        """Record the file llama-server wrote for `reservation` as an archive.

        The file must exist with `actual_bytes` bytes and hold exactly `tokens` (None: take the
        tokens from the file, e.g. when the slot's generated ids were not all seen). Older
        archives of the tenant that the new one contains are replaced (when this store cuts
        archives into blocks, the blocks the new one will use stay for it). A file larger than
        reserved is re-checked against the quotas, evicting more if need be. On any failure the
        reservation is released and the file removed before the error is raised.
        """
        try:
            header = self._saved_file(reservation, actual_bytes)
            stored = archivable_tokens(header, tokens)
        except (ArchiveError, ValueError):
            self.abort(reservation)
            raise
        packed = pack(stored)
        hashes = block_hashes(packed)
        # llama-server creates the file with its own umask; it holds a tenant's prompt. When
        # another user owns it (a separate llama-server account) only the folder protects it.
        with contextlib.suppress(PermissionError):
            reservation.path.chmod(0o600)
        archive_id = "ar_" + secrets.token_hex(8)
        now = self._clock()
        try:
            with self._lock, self._db.write():
                if not self._reservation_exists(reservation.id):
                    raise ReservationLost(f"reservation {reservation.id} was dropped as stale")
                replaced = self._contained_archives(
                    reservation.tenant_id, fingerprint, packed, hashes
                )
                # its deepest whole block (it holds one at least: MIN_ARCHIVE_TOKENS)
                self._insert_archive(
                    archive_id,
                    reservation,
                    fingerprint,
                    len(stored),
                    actual_bytes,
                    packed,
                    now,
                    last_hash=hashes[-1],
                )
                self._insert_blocks(archive_id, reservation.tenant_id, fingerprint, packed, hashes)
                if self.blocks:
                    # the blocks it will be cut into that are kept already stay for it, whoever
                    # leaves before it is cut (the archives it replaces, first of all)
                    self._pin_blocks(archive_id, reservation.tenant_id, fingerprint, stored)
                # counted with the new archive in (its file, the blocks it keeps), which is not
                # one of the archives that may leave for it
                victims, copies = self._make_room(
                    reservation.tenant_id,
                    0,
                    reservation.quota_bytes,
                    reservation.quota_archives,
                    leaving=replaced,
                    ignored_reservation=reservation.id,
                    added=archive_id,
                )
                freed_blocks = self._delete_archives({**replaced, **victims})
                dropped_files = self._unlent_paths([*replaced.values(), *victims.values(), *copies])
                self._db.execute("DELETE FROM reservations WHERE id = ?", [reservation.id])
        except (QuotaExceeded, ReservationLost):
            self.abort(reservation)
            raise
        archive = Archive(
            id=archive_id,
            tenant_id=reservation.tenant_id,
            file_name=reservation.file_name,
            path=reservation.path,
            fingerprint=fingerprint,
            n_tokens=len(stored),
            bytes=actual_bytes,
            created=now,
            last_used=now,
            hits=0,
        )
        return Committed(
            archive=archive,
            replaced_ids=tuple(replaced),
            evicted_ids=tuple(victims),
            paths_to_unlink=(*dropped_files, *freed_blocks),
        )

    def abort(self, reservation: Reservation) -> None:
        """Give the room back and remove the file, if any (a failed or unwanted save)."""
        with self._lock, self._db.write():
            self._db.execute("DELETE FROM reservations WHERE id = ?", [reservation.id])
        unlink_files([reservation.path])

    # -- upkeep --------------------------------------------------------------------------------

    def touch(self, archive_id: str) -> bool:
        """Note a restore (last_used, hits); False if the archive is gone."""
        with self._lock, self._db.write():
            cursor = self._db.execute(
                "UPDATE archives SET last_used = ?, hits = hits + 1 WHERE id = ?",
                [self._clock(), archive_id],
            )
        return cursor.rowcount > 0

    def remove(self, archive_id: str) -> bool:
        """Drop an archive and its file, or the blocks no other archive uses (e.g. after
        llama-server failed to restore it)."""
        with self._lock, self._db.write():
            row = self._db.execute(
                "SELECT file_name FROM archives WHERE id = ?", [archive_id]
            ).fetchone()
            if row is None:
                return False
            freed_blocks = self._delete_archives([archive_id])
            dropped_files = self._unlent_paths([row[0]])
        unlink_files([*dropped_files, *freed_blocks])
        return True

    def _pin_blocks(self, archive_id: str, tenant_id: str, fingerprint: str, tokens: array) -> None:
        """Name, as blocks of the (whole-file) archive `archive_id`, the tenant's kept blocks
        it will be cut into: its cut then writes none of them again."""
        cuts = block_cuts(tokens)
        found = self._blocks_with_keys(tenant_id, fingerprint, [cut.key for cut in cuts])
        self._db.executemany(
            "INSERT INTO archive_kv_blocks (archive_id, ordinal, block_id) VALUES (?, ?, ?)",
            [
                (archive_id, ordinal, found[(cut.key, cut.n_cells)][0])
                for ordinal, cut in enumerate(cuts)
                if (cut.key, cut.n_cells) in found
            ],
        )

    # -- internals -----------------------------------------------------------------------------

    def _insert_archive(
        self,
        archive_id: str,
        reservation: Reservation,
        fingerprint: str,
        n_tokens: int,
        size: int,
        packed: bytes,
        now: float,
        *,
        last_hash: bytes,
    ) -> None:
        self._db.execute(
            f"INSERT INTO archives ({ARCHIVE_COLUMNS}, tokens, last_hash) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)",
            [
                archive_id,
                reservation.tenant_id,
                reservation.file_name,
                fingerprint,
                n_tokens,
                size,
                now,
                now,
                packed,
                last_hash,
            ],
        )

    def _insert_blocks(
        self,
        archive_id: str,
        tenant_id: str,
        fingerprint: str,
        packed: bytes,
        hashes: Sequence[bytes],
    ) -> None:
        self._db.executemany(
            "INSERT INTO archive_blocks (archive_id, depth, tenant_id, fingerprint, hash,"
            " next_tokens) VALUES (?, ?, ?, ?, ?, ?)",
            [
                (
                    archive_id,
                    depth,
                    tenant_id,
                    fingerprint,
                    block_hash,
                    packed[depth * BLOCK_BYTES : (depth + 1) * BLOCK_BYTES],
                )
                for depth, block_hash in enumerate(hashes, start=1)
            ],
        )

    def _reservation_exists(self, reservation_id: str) -> bool:
        found = self._db.execute(
            "SELECT 1 FROM reservations WHERE id = ?", [reservation_id]
        ).fetchone()
        return found is not None

    def _drop_stale_reservations(self) -> dict[str, str]:
        """Delete reservations of dead processes of this host, or past the timeout: id -> file
        name. Another host's processes cannot be seen from here: only the timeout ends theirs."""
        now = self._clock()
        stale = {
            reservation_id: file_name
            for reservation_id, file_name, pid, pid_started, created, host in self._db.execute(
                "SELECT id, file_name, pid, pid_started, created, host FROM reservations"
            ).fetchall()
            if now - created > self.reservation_timeout_s
            or (
                (host == self.host or (host is None and not self.shared))
                and not process_alive(pid, pid_started)
            )
        }
        self._db.executemany(
            "DELETE FROM reservations WHERE id = ?", [(reservation_id,) for reservation_id in stale]
        )
        return stale

    def _saved_file(self, reservation: Reservation, actual_bytes: int) -> SlotFileHeader:
        _require_positive("actual_bytes", actual_bytes)
        try:
            size = reservation.path.stat().st_size
        except FileNotFoundError:
            raise ArchiveFileMismatch(f"{reservation.file_name} was not written") from None
        if size != actual_bytes:
            raise ArchiveFileMismatch(
                f"{reservation.file_name} has {size} bytes, not the {actual_bytes} reported"
            )
        try:
            return read_slot_file(reservation.path)
        except SlotFileError as exc:
            raise ArchiveFileMismatch(f"{reservation.file_name} is not a slot file: {exc}") from exc


def archivable_tokens(header: SlotFileHeader, claimed: Sequence[int] | None) -> array:
    if header.media_positions:
        raise ArchiveRefused("the state holds media chunks, which token ids cannot match")
    if claimed is not None and pack(token_array(claimed)) != pack(header.tokens):
        raise ArchiveFileMismatch("the file holds other tokens than the slot was thought to hold")
    if len(header.tokens) < MIN_ARCHIVE_TOKENS:
        raise ArchiveRefused(
            f"{len(header.tokens)} tokens are fewer than the {MIN_ARCHIVE_TOKENS} worth archiving"
        )
    return header.tokens


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive whole number (got {value!r})")


def _require_quota(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a whole number >= 0, or None (got {value!r})")
