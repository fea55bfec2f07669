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
from collections.abc import Iterable, Mapping, Sequence

from cacheproxy.disk.archive_reads import ArchiveReads
from cacheproxy.disk.archive_schema import ARCHIVE_COLUMNS
from cacheproxy.disk.archive_types import (
    Archive,
    ArchiveError,
    ArchiveFileMismatch,
    ArchiveRefused,
    Committed,
    DiskFull,
    QuotaExceeded,
    Reservation,
    ReservationLost,
    new_file_name,
    unlink_files,
)
from cacheproxy.disk.blocks import MIN_ARCHIVE_TOKENS, block_hashes, pack, token_array
from cacheproxy.disk.eviction import EvictionCandidate
from cacheproxy.disk.slot_file import SlotFileError, SlotFileHeader, read_slot_file
from cacheproxy.ops.processes import process_alive, process_start_ticks


class ArchiveQuotas(ArchiveReads):
    """Saving (reserve, let llama-server write the file, commit or abort) and upkeep (touch,
    remove), each one write transaction."""

    def reserve(
        self,
        tenant_id: str,
        expected_bytes: int,
        quota_bytes: int | None,
        quota_archives: int | None,
    ) -> Reservation:
        """Take room for a save of about `expected_bytes`, evicting archives as the quotas need.

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
        file_name = new_file_name()
        pid = os.getpid()
        with self._lock, self._db.write():
            stale = self._drop_stale_reservations()
            victims = self._make_room(
                tenant_id, expected_bytes, quota_bytes, quota_archives, leaving={}
            )
            victims |= self._room_on_disk(expected_bytes, victims, stale)
            self._delete_archives(victims)
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
            paths_to_unlink=tuple(
                self.path_for(name) for name in [*stale.values(), *victims.values()]
            ),
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
        archives of the tenant that the new one contains are replaced. A file larger than
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
                victims = self._make_room(
                    reservation.tenant_id,
                    actual_bytes,
                    reservation.quota_bytes,
                    reservation.quota_archives,
                    leaving=replaced,
                    ignored_reservation=reservation.id,
                )
                self._insert_archive(
                    archive_id, reservation, fingerprint, len(stored), actual_bytes, packed, now
                )
                self._insert_blocks(archive_id, reservation.tenant_id, fingerprint, hashes)
                self._delete_archives({**replaced, **victims})
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
            paths_to_unlink=tuple(
                self.path_for(name) for name in [*replaced.values(), *victims.values()]
            ),
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
        """Drop an archive and its file (e.g. after llama-server failed to restore it)."""
        with self._lock, self._db.write():
            row = self._db.execute(
                "DELETE FROM archives WHERE id = ? RETURNING file_name", [archive_id]
            ).fetchone()
        if row is None:
            return False
        unlink_files([self.path_for(row[0])])
        return True

    # -- internals -----------------------------------------------------------------------------

    def _make_room(
        self,
        tenant_id: str,
        new_bytes: int,
        quota_bytes: int | None,
        quota_archives: int | None,
        *,
        leaving: Mapping[str, str],
        ignored_reservation: str | None = None,
    ) -> dict[str, str]:
        """Victims (id -> file name) whose removal lets one more state of `new_bytes` fit.

        Counts committed archives, minus those already `leaving`, plus every reservation but
        `ignored_reservation` (the one being committed). Raises QuotaExceeded when the policy's
        choice cannot make it fit; the caller's transaction then rolls back whole.
        """
        victims: dict[str, str] = {}
        leaving_ids = list(leaving)
        tenant_bytes, tenant_count = self._used(tenant_id, leaving_ids, ignored_reservation)
        need_bytes = 0 if quota_bytes is None else tenant_bytes + new_bytes - quota_bytes
        need_count = 0 if quota_archives is None else tenant_count + 1 - quota_archives
        if need_bytes > 0 or need_count > 0:
            candidates = self._candidates(tenant_id, excluded=leaving_ids)
            victims |= self._victims(candidates, need_bytes, need_count, "the tenant quota")
        total_bytes, _ = self._used(None, leaving_ids + list(victims), ignored_reservation)
        need_bytes = total_bytes + new_bytes - self.budget_bytes
        if need_bytes > 0:
            candidates = self._candidates(None, excluded=leaving_ids + list(victims))
            victims |= self._victims(candidates, need_bytes, 0, "the global budget")
        return victims

    def _room_on_disk(
        self, new_bytes: int, leaving: Mapping[str, str], stale: Mapping[str, str]
    ) -> dict[str, str]:
        """More victims, if the file system has less free space than the new state, the other
        saves in progress and `min_free_bytes` need (quotas and budget say nothing of a disk
        that other things fill). Raises DiskFull when evicting cannot make enough room."""
        stats = os.statvfs(self.directory)
        free = stats.f_bavail * stats.f_frsize
        freed = self._file_bytes([*leaving.values(), *stale.values()])
        reserved, _ = self._db.execute(
            "SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT), count(*) FROM reservations"
        ).fetchone()
        need = new_bytes + reserved + self.min_free_bytes - free - freed
        if need <= 0:
            return {}
        candidates = self._candidates(None, excluded=list(leaving))
        try:
            return self._victims(candidates, need, 0, "the free disk space")
        except QuotaExceeded as exc:
            raise DiskFull(
                f"{self.directory} has {free} bytes free; {new_bytes} more and"
                f" {self.min_free_bytes} spare do not fit ({exc})"
            ) from None

    def _file_bytes(self, file_names: Iterable[str]) -> int:
        total = 0
        for name in file_names:
            with contextlib.suppress(OSError):
                total += self.path_for(name).stat().st_size
        return total

    def _used(
        self, tenant_id: str | None, excluded: Sequence[str], ignored_reservation: str | None
    ) -> tuple[int, int]:
        """Committed plus reserved (bytes, count), without `excluded` archives."""
        tenant_filter = "" if tenant_id is None else "AND tenant_id = ?"
        tenant_params = [] if tenant_id is None else [tenant_id]
        excluded_filter, excluded_params = _not_in("id", excluded)
        archives = self._db.execute(
            f"SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT), count(*) FROM archives "
            f"WHERE 1 = 1 {tenant_filter} {excluded_filter}",
            [*tenant_params, *excluded_params],
        ).fetchone()
        ignored_filter = "" if ignored_reservation is None else "AND id <> ?"
        ignored_params = [] if ignored_reservation is None else [ignored_reservation]
        reserved = self._db.execute(
            f"SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT), count(*) FROM reservations "
            f"WHERE 1 = 1 {ignored_filter} {tenant_filter}",
            [*ignored_params, *tenant_params],
        ).fetchone()
        return archives[0] + reserved[0], archives[1] + reserved[1]

    def _candidates(
        self, tenant_id: str | None, excluded: Sequence[str]
    ) -> dict[str, tuple[EvictionCandidate, str]]:
        tenant_filter = "" if tenant_id is None else "AND tenant_id = ?"
        excluded_filter, excluded_params = _not_in("id", excluded)
        rows = self._db.execute(
            "SELECT id, bytes, last_used, hits, created, file_name FROM archives "
            f"WHERE 1 = 1 {tenant_filter} {excluded_filter}",
            [*([] if tenant_id is None else [tenant_id]), *excluded_params],
        ).fetchall()
        return {
            row[0]: (EvictionCandidate(row[0], row[1], row[2], row[3], row[4]), row[5])
            for row in rows
        }

    def _victims(
        self,
        candidates: Mapping[str, tuple[EvictionCandidate, str]],
        need_bytes: int,
        need_count: int,
        what: str,
    ) -> dict[str, str]:
        need_bytes, need_count = max(need_bytes, 0), max(need_count, 0)
        chosen = self.eviction.choose_victims(
            [candidate for candidate, _ in candidates.values()], need_bytes, need_count
        )
        # the policy is a plugin: its answer is checked, not trusted
        if len(set(chosen)) != len(chosen) or not set(chosen) <= set(candidates):
            raise ArchiveError(f"eviction policy chose unknown or repeated archives: {chosen}")
        victims = {archive_id: candidates[archive_id][1] for archive_id in chosen}
        freed = sum(candidates[archive_id][0].bytes for archive_id in victims)
        if freed < need_bytes or len(victims) < need_count:
            raise QuotaExceeded(
                f"{what} leaves no room: {need_bytes} bytes and {need_count} archives must go, "
                f"the eviction policy's choice frees {freed} bytes and {len(victims)} archives"
            )
        return victims

    def _delete_archives(self, archives: Iterable[str]) -> None:
        # the block rows go with them (ON DELETE CASCADE)
        self._db.executemany(
            "DELETE FROM archives WHERE id = ?", [(archive_id,) for archive_id in archives]
        )

    def _insert_archive(
        self,
        archive_id: str,
        reservation: Reservation,
        fingerprint: str,
        n_tokens: int,
        size: int,
        packed: bytes,
        now: float,
    ) -> None:
        self._db.execute(
            f"INSERT INTO archives ({ARCHIVE_COLUMNS}, tokens) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
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
            ],
        )

    def _insert_blocks(
        self, archive_id: str, tenant_id: str, fingerprint: str, hashes: Sequence[bytes]
    ) -> None:
        self._db.executemany(
            "INSERT INTO archive_blocks (archive_id, depth, tenant_id, fingerprint, hash) "
            "VALUES (?, ?, ?, ?, ?)",
            [
                (archive_id, depth, tenant_id, fingerprint, block_hash)
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


def _not_in(column: str, values: Sequence[str]) -> tuple[str, list[str]]:
    if not values:
        return "", []
    return f"AND {column} NOT IN ({', '.join('?' * len(values))})", list(values)


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive whole number (got {value!r})")


def _require_quota(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a whole number >= 0, or None (got {value!r})")
