"""The archive index's recovery and repair: the index and the folder made to agree again after
a crash (`recover`), files found without a row kept in quarantine for an operator to attribute
(`quarantined`, `adopt`), and the fingerprints of the upstreams that attached, under which
archives of an older index are matched again (`relabel`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from cacheproxy.disk.archive_quotas import ArchiveQuotas, archivable_tokens
from cacheproxy.disk.archive_reads import file_holds
from cacheproxy.disk.archive_schema import make_private_directory
from cacheproxy.disk.archive_types import (
    FILE_NAME_PATTERN,
    QUARANTINE_DIR,
    RESTORE_NAME_PATTERN,
    ArchiveError,
    Committed,
    QuarantinedFile,
    RecoveryReport,
    unlink_files,
)
from cacheproxy.disk.kv_blocks import BLOCKS_DIR, block_file_holds, block_files
from cacheproxy.disk.slot_file import SlotFileError, read_slot_file


class ArchiveRepair(ArchiveQuotas):
    """Recovery at start-up (and whenever the disk tier comes back on), quarantine and adoption
    of files without a row, and the fingerprints seen."""

    def recover(self, *, check_headers: bool = True) -> RecoveryReport:
        """Make the index and the folder agree again after a crash; run it at start-up.

        - reservations of dead processes, or older than the timeout: dropped, their files removed;
        - rows whose file is missing: removed;
        - rows whose file has another size (half-written, truncated) or, with `check_headers`,
          another header or tokens: removed with the file;
        - files named like ours without a row: moved to the quarantine folder, never deleted (the
          index may be what was lost). They are not re-indexed here: a slot file does not say
          whose prompt it holds, and the tenant is never guessed; an operator may `adopt` them;
        - blocks: a row whose file is missing (and not in quarantine, where a lost index sent
          it) or has another size or, with `check_headers`, header, is removed with every
          archive using it; block files without a row go to the quarantine folder's `blocks`;
          the whole file of an archive cut into blocks (but a whole copy it keeps, of its size
          and header: one that is not goes, the archive stays as its blocks), and files made
          for restores, go;
        - other files in the folder are not ours and are left alone (listed in the report);
        - a `shared` store (several proxies) judges reservations by age alone and quarantines
          only files older than the reservation timeout: another live proxy's save is younger.

        Runs in one write transaction, so a live process's save in progress is not disturbed
        (nor are the files this process is writing or lends llama-server).
        """
        report = RecoveryReport()
        doomed_files: list[str] = []
        with self._lock, self._db.write():
            stale = self._drop_stale_reservations()
            report.stale_reservations = list(stale)
            doomed_files += stale.values()
            reserved = {name for (name,) in self._db.execute("SELECT file_name FROM reservations")}
            files = self._files_on_disk(report)
            for name in stale.values():
                files.pop(name, None)  # already going, and reported as a stale reservation
            doomed_rows: dict[str, str] = {}
            lost_copies: list[str] = []
            for archive_id, file_name, size, stored, in_blocks, copy in self._db.execute(
                "SELECT id, file_name, bytes, tokens, coalesce(frame, '') <> '', whole_copy"
                " FROM archives"
            ).fetchall():
                holds = self._file_holds(files, file_name, size, stored, check_headers)
                if in_blocks and copy and not holds:
                    lost_copies.append(archive_id)  # the archive stays, as its blocks
                    copy = False
                if in_blocks:
                    # cut into blocks: the whole file goes, unless it is the copy kept (or the
                    # server is reading it)
                    if not copy and file_name in files and file_name not in self._in_flight:
                        report.leftover_files.append(file_name)
                        doomed_files.append(file_name)
                elif file_name not in files:
                    report.missing_files.append(archive_id)
                    doomed_rows[archive_id] = file_name
                elif not holds:
                    report.damaged_files.append(archive_id)
                    doomed_rows[archive_id] = file_name
                    doomed_files.append(file_name)
                files.pop(file_name, None)
            if lost_copies:
                self._db.executemany(
                    "UPDATE archives SET whole_copy = 0 WHERE id = ?",
                    [(archive_id,) for archive_id in lost_copies],
                )
            freed = self._delete_archives(doomed_rows)
            freed += self._recover_blocks(report, check_headers)
            orphans = [name for name in files if name not in reserved]
            if self.shared:
                orphans = [name for name in orphans if self._older_than_a_save(self.path_for(name))]
            report.orphan_files = sorted(orphans)
            self._quarantine(report.orphan_files)
            leftovers = self._leftover_restore_files()
            report.leftover_files += leftovers
        unlink_files([*(self.path_for(name) for name in [*doomed_files, *leftovers]), *freed])
        return report

    def _file_holds(
        self, files: Mapping[str, int], file_name: str, size: int, stored: bytes, headers: bool
    ) -> bool:
        """Whether the file `file_name` (of `files`: name -> size) is the one saved: its size,
        and with `headers`, the tokens its header names."""
        return files.get(file_name) == size and (
            not headers or file_holds(self.path_for(file_name), stored)
        )

    # -- quarantine: files without a row, kept for an operator to attribute --------------------

    def _quarantine(self, file_names: Iterable[str]) -> None:
        names = list(file_names)
        if not names:
            return
        make_private_directory(self.quarantine_directory)
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path_for(name), self.quarantine_directory / name)

    def quarantined(self) -> list[QuarantinedFile]:
        """Files in quarantine, oldest first, with what their headers say."""
        found: list[QuarantinedFile] = []
        if not self.quarantine_directory.is_dir():
            return found
        for path in sorted(self.quarantine_directory.iterdir()):
            if not FILE_NAME_PATTERN.fullmatch(path.name) or not path.is_file():
                continue
            stat = path.stat()
            n_tokens, problem = None, None
            try:
                header = read_slot_file(path)
                n_tokens = len(header.tokens)
                archivable_tokens(header, None)
            except (OSError, SlotFileError, ArchiveError) as exc:
                problem = str(exc)
            found.append(
                QuarantinedFile(path.name, path, stat.st_size, stat.st_mtime, n_tokens, problem)
            )
        found.sort(key=lambda item: (item.modified, item.file_name))
        return found

    def adopt(
        self,
        file_name: str,
        tenant_id: str,
        fingerprint: str,
        quota_bytes: int | None,
        quota_archives: int | None,
    ) -> Committed:
        """Index a quarantined file as an archive of `tenant_id`, under the quotas of today.

        The tokens come from the file's header; room is reserved and committed as for a save
        (evicting as the quotas need). The file moves back into the folder under a new name,
        or stays in quarantine if anything refuses it.
        """
        if not FILE_NAME_PATTERN.fullmatch(file_name):
            raise ArchiveError(f"{file_name!r} is not an archive file name")
        source = self.quarantine_directory / file_name
        try:
            size = source.stat().st_size
        except FileNotFoundError:
            raise ArchiveError(f"no file {file_name} in {self.quarantine_directory}") from None
        try:
            archivable_tokens(read_slot_file(source), None)
        except SlotFileError as exc:
            raise ArchiveError(f"{file_name} is not a slot file: {exc}") from exc
        reservation = self.reserve(tenant_id, size, quota_bytes, quota_archives)
        unlink_files(reservation.paths_to_unlink)
        try:
            os.link(source, reservation.path)  # the quarantined copy goes only once committed
        except OSError:
            self.abort(reservation)
            raise
        committed = self.commit(reservation, None, size, fingerprint)
        unlink_files([source, *committed.paths_to_unlink])
        return committed

    # -- fingerprints of attached upstreams ------------------------------------------------------

    def note_fingerprint(self, fingerprint: str, facts: Mapping[str, Any]) -> None:
        with self._lock, self._db.write():
            self._db.execute(
                "INSERT INTO fingerprints (fingerprint, facts, last_seen) VALUES (?, ?, ?) "
                "ON CONFLICT (fingerprint) DO UPDATE SET last_seen = excluded.last_seen",
                [fingerprint, json.dumps(dict(facts), sort_keys=True, default=str), self._clock()],
            )

    def relabel(self, old: str, new: str, fits: Callable[[Path], bool]) -> int:
        """Index under `new` the archives indexed under `old` whose file `fits` (a fingerprint
        computed from fewer facts, before an upgrade added one: the file shows whether the
        archive has the new fact's value). How many moved; the others keep `old`."""
        if old == new:
            return 0
        # archives cut into blocks were all saved under fingerprints with every fact there is
        # now; their blocks stay with them
        with self._lock:
            rows = self._db.execute(
                "SELECT id, file_name FROM archives WHERE fingerprint = ?"
                " AND coalesce(frame, '') = ''",
                [old],
            ).fetchall()
        moving = [archive_id for archive_id, name in rows if fits(self.path_for(name))]
        if not moving:
            return 0
        with self._lock, self._db.write():
            for archive_id in moving:
                self._db.execute(
                    "UPDATE archives SET fingerprint = ? WHERE id = ? AND fingerprint = ?",
                    [new, archive_id, old],
                )
                self._db.execute(
                    "UPDATE archive_blocks SET fingerprint = ? WHERE archive_id = ?",
                    [new, archive_id],
                )
        return len(moving)

    def latest_fingerprint(self) -> str | None:
        """The fingerprint of the upstream that attached last (None if none ever did)."""
        with self._lock:
            row = self._db.execute(
                "SELECT fingerprint FROM fingerprints ORDER BY last_seen DESC LIMIT 1"
            ).fetchone()
        return None if row is None else row[0]

    # -- internals -----------------------------------------------------------------------------

    def _older_than_a_save(self, path: Path) -> bool:
        try:
            modified = path.stat().st_mtime
        except FileNotFoundError:
            return False
        return self._clock() - modified > self.reservation_timeout_s

    def _files_on_disk(self, report: RecoveryReport) -> dict[str, int]:
        """Our files in the folder (name -> size); other names go to the report."""
        files: dict[str, int] = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if FILE_NAME_PATTERN.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        files[entry.name] = entry.stat(follow_symlinks=False).st_size
                elif entry.name not in (QUARANTINE_DIR, BLOCKS_DIR) and not (
                    RESTORE_NAME_PATTERN.fullmatch(entry.name)
                ):
                    report.foreign_files.append(entry.name)
        report.foreign_files.sort()
        return files

    def _recover_blocks(self, report: RecoveryReport, check_headers: bool) -> list[Path]:
        """Blocks and their rows agree again (in `recover`'s transaction): the files of the
        blocks dropped and of the archives dropped with them, to unlink."""
        on_disk = block_files(self.blocks_directory)
        quarantined = self.quarantine_directory / BLOCKS_DIR
        damaged: list[str] = []
        for block_id, key, n_cells, size in self._db.execute(
            "SELECT id, hash, n_cells, bytes FROM kv_blocks"
        ).fetchall():
            if block_id not in on_disk and (quarantined / block_id).is_file():
                # a lost index sent it to quarantine, and the index came back from a backup
                with contextlib.suppress(OSError):
                    os.replace(quarantined / block_id, self.blocks_directory / block_id)
                    on_disk[block_id] = (self.blocks_directory / block_id).stat().st_size
            path = self.blocks_directory / block_id
            if on_disk.pop(block_id, None) != size or (
                check_headers and not block_file_holds(path, bytes(key), n_cells, size)
            ):
                damaged.append(block_id)
        freed: list[Path] = []
        if damaged:
            report.damaged_blocks = damaged
            users = self._block_users(damaged)
            report.damaged_files += users
            freed += self._delete_archives(users)
            freed += self._free_unused_blocks(damaged)
            # a damaged block no archive used any more is gone now; one still named is not
        unused = [
            block_id
            for (block_id,) in self._db.execute(
                "SELECT id FROM kv_blocks b WHERE NOT EXISTS"
                " (SELECT 1 FROM archive_kv_blocks r WHERE r.block_id = b.id)"
            ).fetchall()
        ]
        freed += self._free_unused_blocks(unused)
        orphans = [
            name
            for name in on_disk
            if name not in self._in_flight
            and (not self.shared or self._older_than_a_save(self.blocks_directory / name))
        ]
        report.orphan_blocks = sorted(orphans)
        if orphans:
            make_private_directory(self.quarantine_directory)
            make_private_directory(quarantined)
            for name in orphans:
                with contextlib.suppress(FileNotFoundError):
                    os.replace(self.blocks_directory / name, quarantined / name)
        return freed

    def _block_users(self, block_ids: list[str]) -> list[str]:
        users: set[str] = set()
        for block_id in block_ids:
            users.update(
                archive_id
                for (archive_id,) in self._db.execute(
                    "SELECT archive_id FROM archive_kv_blocks WHERE block_id = ?", [block_id]
                ).fetchall()
            )
        return sorted(users)

    def _leftover_restore_files(self) -> list[str]:
        """Files made for restores that no restore of this process still lends the server."""
        with os.scandir(self.directory) as entries:
            names = [entry.name for entry in entries if RESTORE_NAME_PATTERN.fullmatch(entry.name)]
        return [
            name
            for name in names
            if name not in self._in_flight
            and (not self.shared or self._older_than_a_save(self.path_for(name)))
        ]
