"""The disk tier's storage: archived slot states as files in one folder, indexed in SQLite or
PostgreSQL (`cacheproxy.db`; several proxies may share a PostgreSQL index and one folder).

Each archive is a llama-server slot save file (`slot_file.py`) named by an opaque id, plus a row
holding its tenant, its exact token ids and a compatibility fingerprint. Lookups find the archive
sharing the longest prefix with a request through chained hashes of fixed 64-token blocks, so they
cost a few index probes, not a scan. Space is bounded per tenant (bytes and count, given by the
caller per call) and in total (`budget_bytes`), through reserve-then-commit transactions: room is
taken before a file is written, so no moment exists at which committed plus reserved bytes exceed
a quota, however many threads and processes save at once. Every transaction that counts and
then writes holds the index's write lock from its start (`Database.write`: SQLite's
`BEGIN IMMEDIATE`, a transaction-scoped advisory lock on PostgreSQL), so no other process can
change what was counted before it commits; single-row changes are conditional statements
(`UPDATE ... WHERE`, `DELETE ... RETURNING`).

No HTTP here: the caller asks llama-server to write `reservation.path` (its `--slot-save-path`
must be this folder) and to read `archive.path`; the store only decides and remembers. One
`ArchiveStore` per process; it is safe to share between threads (one lock around one connection).

It stays one module (over 1000 lines) for now: the schema, recovery and the quota transactions
share one connection, one lock and one reserve-then-commit discipline. The seam, when it is
split, is the schema and crash recovery apart from the quota and lookup logic.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import socket
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from cacheproxy.db.connection import (
    DATABASE_ERRORS,
    DatabaseTarget,
    connect,
    is_database_url,
    is_lock_timeout,
    shown_target,
)
from cacheproxy.db.migrations import Migrations
from cacheproxy.disk.eviction import EvictionCandidate, EvictionPolicy
from cacheproxy.disk.slot_file import SlotFileError, SlotFileHeader, read_slot_file
from cacheproxy.tokens import common_prefix_length

# Tokens per hashed block. The hashes in the index depend on it: changing it needs a migration
# that re-hashes every archive.
BLOCK_TOKENS = 64
TOKEN_BYTES = 4
BLOCK_BYTES = BLOCK_TOKENS * TOKEN_BYTES
# A match shorter than one block is never looked for, so shorter states are not worth a file:
# restoring one would cost more than prefilling it.
MIN_ARCHIVE_TOKENS = BLOCK_TOKENS
HASH_BYTES = 16  # 128-bit chained hashes; a collision is also caught by the exact token check
# "a_" + 32 hex + ".slot": passes llama-server's fs_validate_filename and says nothing about
# the tenant or the prompt.
FILE_NAME_PATTERN = re.compile(r"a_[0-9a-f]{32}\.slot")
BUSY_TIMEOUT_S = 10.0
# Files named like archives that no row claims are moved here, never deleted: the index may be
# the thing that was lost. llama-server cannot address it (its file names take no "/").
QUARANTINE_DIR = "quarantine"
# A save still unfinished after this long has failed, even if its process lives on.
DEFAULT_RESERVATION_TIMEOUT_S = 600.0
SQL_PARAMS_PER_QUERY = 500  # far below SQLite's (and PostgreSQL's) limit on bound parameters
ARCHIVE_COLUMNS = "id, tenant_id, file_name, fingerprint, n_tokens, bytes, created, last_used, hits"


class ArchiveError(Exception):
    """A storage operation that did not happen; the store is left as it was."""


class QuotaExceeded(ArchiveError):
    """No room for the state, even after evicting every archive the quotas allow to leave."""


class ReservationLost(ArchiveError):
    """The reservation is gone (recovery judged it stale); its file has been removed."""


class ArchiveFileMismatch(ArchiveError):
    """The saved file is missing, has another size, or holds other tokens than claimed."""


class DiskFull(QuotaExceeded):
    """Not enough free space on the archive folder's file system, even after evicting."""


class ArchiveIndexUnusable(ArchiveError):
    """The index file cannot be opened as an archive index (corrupt, not SQLite): one line for
    the operator, naming the file and the fix."""


class ArchiveRefused(ArchiveError):
    """A state the archive does not keep: shorter than a block, or holding media chunks."""


@dataclass(frozen=True)
class Archive:
    id: str  # opaque ("ar_" + 16 hex)
    tenant_id: str
    file_name: str
    path: Path
    fingerprint: str
    n_tokens: int
    bytes: int
    created: float  # unix seconds
    last_used: float  # unix seconds: the last restore, or creation
    hits: int  # restores


@dataclass(frozen=True)
class Match:
    archive: Archive
    n_common: int  # tokens the request shares with the archive, exactly
    tokens: list[int]  # the archive's tokens: what the slot holds once restored


@dataclass(frozen=True)
class Reservation:
    id: str
    tenant_id: str
    file_name: str  # give this to llama-server's save action
    path: Path
    expected_bytes: int
    quota_bytes: int | None
    quota_archives: int | None
    evicted_ids: tuple[str, ...]
    # Evicted archives' files, and those of dead reservations: unlink them (`unlink_files`).
    paths_to_unlink: tuple[Path, ...]


@dataclass(frozen=True)
class Committed:
    archive: Archive
    replaced_ids: tuple[str, ...]  # older archives of the tenant this one contains
    evicted_ids: tuple[str, ...]  # archives that left because the file was larger than reserved
    paths_to_unlink: tuple[Path, ...]


class Usage(NamedTuple):
    bytes: int
    count: int


@dataclass
class RecoveryReport:
    stale_reservations: list[str] = field(default_factory=list)  # ids; their files removed
    missing_files: list[str] = field(default_factory=list)  # archive ids; rows removed
    damaged_files: list[str] = field(default_factory=list)  # archive ids; rows and files removed
    # our file names without a row: moved to the quarantine folder, for `archives adopt`
    orphan_files: list[str] = field(default_factory=list)
    foreign_files: list[str] = field(default_factory=list)  # not ours: left alone

    @property
    def changed(self) -> bool:
        return bool(
            self.stale_reservations or self.missing_files or self.damaged_files or self.orphan_files
        )


def archive_summary(archive: Archive) -> dict[str, Any]:
    """An archive as the admin API and the CLI show it: no path, no tokens."""
    summary = dataclasses.asdict(archive)
    del summary["path"], summary["file_name"]
    return summary


def archive_listing(store: ArchiveStore, tenant_id: str | None = None) -> dict[str, Any]:
    """Archives, oldest first (one tenant's, or everyone's), with their totals and the budget:
    what the admin API and the CLI answer."""
    archives = store.list(tenant_id)
    used = store.usage(tenant_id)
    return {
        "archives": [archive_summary(archive) for archive in archives],
        "bytes": used.bytes,
        "count": used.count,
        "budget_bytes": store.budget_bytes,
    }


def compatibility_fingerprint(facts: Mapping[str, str | int | float | bool | None]) -> str:
    """An opaque fingerprint of what a restore depends on; archives only match equal ones.

    A slot file names neither the model nor the KV layout, and restoring it elsewhere fails
    (n_stream) or, worse, loads a wrong-shaped state. Put in every fact that must be equal:
    the model (path and size, or a hash), the llama-server build, the KV layout (`-np`,
    unified or not), the KV cache types. Key order does not matter.
    """
    canonical = json.dumps(dict(facts), sort_keys=True, separators=(",", ":"))
    return "fp_" + hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def block_hashes(packed_tokens: bytes) -> list[bytes]:
    """h_i = blake2b(h_(i-1) || block_i) for every whole block; a partial last block has none.

    Chaining makes each hash stand for the whole prefix up to its block, so one index probe
    answers "does any archive start with these i blocks?".
    """
    view = memoryview(packed_tokens)
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(view) - BLOCK_BYTES + 1, BLOCK_BYTES):
        block_hash = hashlib.blake2b(previous, digest_size=HASH_BYTES)
        block_hash.update(view[start : start + BLOCK_BYTES])
        previous = block_hash.digest()
        hashes.append(previous)
    return hashes


def unlink_files(paths: Iterable[Path]) -> int:
    """Remove files the store released; a missing one is fine. Returns how many were removed."""
    removed = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed


def new_file_name() -> str:
    return f"a_{secrets.token_hex(16)}.slot"


MIGRATIONS = Migrations("cacheproxy.archive")

# Migrations are append-only: once released, a migration is never edited, only followed by another.
# The SQLite texts are those released before PostgreSQL was supported; PostgreSQL's say the same
# with its types (BIGINT, DOUBLE PRECISION for REAL, BYTEA for BLOB) and no STRICT.
MIGRATIONS.add(
    "m001_archives_blocks_reservations",
    sqlite="""
        CREATE TABLE archives (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL,
            file_name TEXT NOT NULL UNIQUE,
            fingerprint TEXT NOT NULL,
            n_tokens INTEGER NOT NULL CHECK (n_tokens > 0),
            bytes INTEGER NOT NULL CHECK (bytes > 0),
            tokens BLOB NOT NULL CHECK (length(tokens) = 4 * n_tokens),  -- int32 little-endian
            created REAL NOT NULL,
            last_used REAL NOT NULL,
            hits INTEGER NOT NULL DEFAULT 0 CHECK (hits >= 0)
        ) STRICT;
        CREATE INDEX archives_by_tenant ON archives(tenant_id);

        -- One row per whole 64-token block of an archive: the chained hash of its prefix up to
        -- and including that block. tenant_id and fingerprint are copied here so that a lookup
        -- is one probe of one index, and can never reach another tenant's rows.
        CREATE TABLE archive_blocks (
            archive_id TEXT NOT NULL REFERENCES archives(id) ON DELETE CASCADE,
            depth INTEGER NOT NULL CHECK (depth >= 1),  -- blocks covered by the hash
            tenant_id TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            hash BLOB NOT NULL,
            PRIMARY KEY (archive_id, depth)
        ) STRICT, WITHOUT ROWID;
        CREATE INDEX archive_blocks_lookup ON archive_blocks(tenant_id, fingerprint, hash);

        -- Room taken for a save in progress: counted against the quotas like an archive.
        CREATE TABLE reservations (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL,
            file_name TEXT NOT NULL UNIQUE,
            bytes INTEGER NOT NULL CHECK (bytes > 0),
            pid INTEGER NOT NULL,
            pid_started INTEGER,  -- the process's start time (Linux): tells a reused pid apart
            created REAL NOT NULL
        ) STRICT;
        CREATE INDEX reservations_by_tenant ON reservations(tenant_id);
    """,
    postgresql="""
        CREATE TABLE archives (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL,
            file_name TEXT NOT NULL UNIQUE,
            fingerprint TEXT NOT NULL,
            n_tokens BIGINT NOT NULL CHECK (n_tokens > 0),
            bytes BIGINT NOT NULL CHECK (bytes > 0),
            tokens BYTEA NOT NULL CHECK (length(tokens) = 4 * n_tokens),
            created DOUBLE PRECISION NOT NULL,
            last_used DOUBLE PRECISION NOT NULL,
            hits BIGINT NOT NULL DEFAULT 0 CHECK (hits >= 0)
        );
        CREATE INDEX archives_by_tenant ON archives(tenant_id);

        CREATE TABLE archive_blocks (
            archive_id TEXT NOT NULL REFERENCES archives(id) ON DELETE CASCADE,
            depth BIGINT NOT NULL CHECK (depth >= 1),
            tenant_id TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            hash BYTEA NOT NULL,
            PRIMARY KEY (archive_id, depth)
        );
        CREATE INDEX archive_blocks_lookup ON archive_blocks(tenant_id, fingerprint, hash);

        CREATE TABLE reservations (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL,
            file_name TEXT NOT NULL UNIQUE,
            bytes BIGINT NOT NULL CHECK (bytes > 0),
            pid BIGINT NOT NULL,  -- with pid_started, only meaningful on the host that wrote it
            pid_started BIGINT,
            created DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX reservations_by_tenant ON reservations(tenant_id);
    """,
)

# Fingerprints of the upstreams that attached, with what they were computed from: a file
# adopted from quarantine is given the one its operator names, or the latest one seen.
MIGRATIONS.add(
    "m002_fingerprints",
    """
    CREATE TABLE fingerprints (
        fingerprint TEXT PRIMARY KEY,
        facts TEXT NOT NULL,  -- JSON
        last_seen {float} NOT NULL
    ) {strict};
    """,
)


# Which host a reservation's pid belongs to: proxies on several hosts may share a PostgreSQL
# index, and a pid says whether a save is still under way only on its own host. Older rows
# (null) are this host's, as they always were.
MIGRATIONS.add("m003_reservation_host", "ALTER TABLE reservations ADD COLUMN host TEXT")


@dataclass(frozen=True)
class QuarantinedFile:
    file_name: str
    path: Path
    bytes: int
    modified: float  # unix seconds
    n_tokens: int | None  # from the slot file header; None when the header is unreadable
    problem: str | None  # why it cannot be adopted, if it cannot


class ArchiveStore:
    """Archived slot states in `directory`, indexed in the SQLite file `database`.

    `min_free_bytes`: room a save must leave free on the folder's file system beyond the
    state's expected size; archives are evicted (by the eviction policy) to make it.
    """

    def __init__(
        self,
        directory: Path,
        database: DatabaseTarget,
        eviction: EvictionPolicy,
        budget_bytes: int,
        *,
        reservation_timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        min_free_bytes: int = 0,
        shared: bool = False,
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive whole number (got {budget_bytes!r})")
        self.directory = Path(directory)
        # what messages name (a URL without its password); the SQLite file, None for PostgreSQL
        self.database = shown_target(database)
        self.database_file = None if is_database_url(database) else Path(database)
        self.eviction = eviction
        self.budget_bytes = budget_bytes
        self.reservation_timeout_s = reservation_timeout_s
        self.min_free_bytes = min_free_bytes
        # several proxies, maybe on several hosts, write the folder and the index: a pid in a
        # reservation may be another host's (so reservations end by age alone), and recovery
        # leaves alone files younger than the reservation timeout (another proxy's save may be
        # that young, its reservation not yet visible here)
        self.shared = shared
        self._clock = clock
        self.host = host_identity()
        # One connection serves every thread, one operation at a time: a transaction never
        # interleaves with another thread's statements.
        self._lock = threading.RLock()
        # set by whoever could not run `recover` at start-up; the disk tier runs it once it can
        self.recovery_pending = False
        with contextlib.suppress(OSError):
            # a folder that cannot be made now leaves the disk tier off until it can (`check`)
            _make_private_directory(self.directory)
        if self.database_file is not None:
            _make_private_directory(self.database_file.parent)
        is_new = self.database_file is not None and not self.database_file.exists()
        try:
            self._db = connect(database, busy_timeout_s=busy_timeout_s, lock_name="archive")
        except DATABASE_ERRORS as exc:
            if is_lock_timeout(exc):
                raise
            raise self._unopenable(exc) from exc
        if is_new and self.database_file is not None:
            # the rows hold prompt tokens: nobody else's business (SQLite's -wal/-shm files
            # take the database file's mode)
            self.database_file.chmod(0o600)
        try:
            if not self._db.is_postgresql:
                self._db.execute("PRAGMA foreign_keys = ON")
            MIGRATIONS.migrate(self._db)
        except DATABASE_ERRORS as exc:
            self._db.close()
            if is_lock_timeout(exc):
                raise
            if self._db.is_postgresql or isinstance(exc, sqlite3.OperationalError):
                raise self._unopenable(exc) from exc
            raise ArchiveIndexUnusable(
                f"archive index {self.database} is not a usable SQLite file ({exc}): move it away"
                f" to start a new index (the archive files then go to"
                f" {self.directory / QUARANTINE_DIR}, for `cacheproxy archives adopt`), or"
                " restore it from a backup"
            ) from exc
        except BaseException:
            self._db.close()
            raise

    def _unopenable(self, exc: Exception) -> ArchiveIndexUnusable:
        if self.database_file is None:
            return ArchiveIndexUnusable(
                f"archive index {self.database} cannot be used ({exc}): check that the"
                " PostgreSQL server runs and database_url names a database this user may create"
                " tables in"
            )
        return ArchiveIndexUnusable(
            f"archive index {self.database} cannot be opened ({exc}): make"
            f" {self.database_file.parent} writable by this user, or set disk.database"
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> ArchiveStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def path_for(self, file_name: str) -> Path:
        return self.directory / file_name

    # -- lookups -------------------------------------------------------------------------------

    def find(self, tenant_id: str, fingerprint: str, tokens: Sequence[int]) -> Match | None:
        """The tenant's archive sharing the longest prefix with `tokens` (at least one block).

        Among equally long matches the smallest file wins (cheapest to restore), then the most
        recently used. `n_common` is exact: it is computed on the stored tokens.
        """
        request = _token_array(tokens)
        packed = _pack(request)
        hashes = block_hashes(packed)
        if not hashes:
            return None
        with self._lock, self._db.read():
            depth = self._deepest_shared_depth(tenant_id, fingerprint, hashes)
            if depth == 0:
                return None
            best_id = self._best_candidate(tenant_id, fingerprint, hashes, depth, packed)
            row = self._db.execute(
                f"SELECT {ARCHIVE_COLUMNS}, tokens FROM archives WHERE id = ? AND tenant_id = ?",
                [best_id, tenant_id],
            ).fetchone()
        archive_tokens = _unpack(row[-1])
        n_common = common_prefix_length(archive_tokens, request)
        if n_common < BLOCK_TOKENS:  # only a hash collision gets here
            return None
        return Match(self._archive(row[:-1]), n_common, archive_tokens.tolist())

    def covering(self, tenant_id: str, fingerprint: str, tokens: Sequence[int]) -> Archive | None:
        """An archive of the tenant that starts with all of `tokens`: saving them would add nothing.

        None for states shorter than `MIN_ARCHIVE_TOKENS`, which are not archived at all.
        """
        match = self.find(tenant_id, fingerprint, tokens)
        if match is None or match.n_common < len(tokens):
            return None
        return match.archive

    def get(self, archive_id: str) -> Archive | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {ARCHIVE_COLUMNS} FROM archives WHERE id = ?", [archive_id]
            ).fetchone()
        return None if row is None else self._archive(row)

    def tokens(self, archive_id: str) -> builtins.list[int] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT tokens FROM archives WHERE id = ?", [archive_id]
            ).fetchone()
        return None if row is None else _unpack(row[0]).tolist()

    def list(self, tenant_id: str | None = None) -> builtins.list[Archive]:
        """Archives, oldest first; one tenant's, or everyone's."""
        where, params = ("WHERE tenant_id = ?", [tenant_id]) if tenant_id is not None else ("", [])
        with self._lock:
            rows = self._db.execute(
                f"SELECT {ARCHIVE_COLUMNS} FROM archives {where} ORDER BY created, id", params
            ).fetchall()
        return [self._archive(row) for row in rows]

    def usage(self, tenant_id: str | None = None, *, include_reserved: bool = False) -> Usage:
        """Bytes and count of committed archives (plus reservations in progress, if asked)."""
        where, params = ("WHERE tenant_id = ?", [tenant_id]) if tenant_id is not None else ("", [])
        reserved_part = (
            f"UNION ALL SELECT bytes FROM reservations {where}" if include_reserved else ""
        )
        # one statement: a consistent snapshot even while other processes commit
        sql = (
            "SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT), count(*) FROM "
            f"(SELECT bytes FROM archives {where} {reserved_part}) AS counted"
        )
        if include_reserved:
            params = params * 2
        with self._lock:
            total, count = self._db.execute(sql, params).fetchone()
        return Usage(total, count)

    def usage_by_tenant(self) -> dict[str, Usage]:
        """Bytes and count of committed archives, for every tenant that has any."""
        with self._lock:
            rows = self._db.execute(
                "SELECT tenant_id, CAST(sum(bytes) AS BIGINT), count(*) FROM archives"
                " GROUP BY tenant_id"
            ).fetchall()
        return {tenant_id: Usage(total, count) for tenant_id, total, count in rows}

    def intact(self, archive: Archive, tokens: Sequence[int]) -> bool:
        """Whether the archive's file is still the one saved: its size, and the tokens in its
        header (a truncated or replaced file would restore less, or someone else's state)."""
        try:
            size = archive.path.stat().st_size
        except OSError:
            return False
        return size == archive.bytes and _file_holds(archive.path, _pack(_token_array(tokens)))

    # -- saving: reserve, let llama-server write the file, commit (or abort) -------------------

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
                    _process_start_ticks(pid),
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
            stored = _archivable_tokens(header, tokens)
        except (ArchiveError, ValueError):
            self.abort(reservation)
            raise
        packed = _pack(stored)
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

    def recover(self, *, check_headers: bool = True) -> RecoveryReport:
        """Make the index and the folder agree again after a crash; run it at start-up.

        - reservations of dead processes, or older than the timeout: dropped, their files removed;
        - rows whose file is missing: removed;
        - rows whose file has another size (half-written, truncated) or, with `check_headers`,
          another header or tokens: removed with the file;
        - files named like ours without a row: moved to the quarantine folder, never deleted (the
          index may be what was lost). They are not re-indexed here: a slot file does not say
          whose prompt it holds, and the tenant is never guessed; an operator may `adopt` them;
        - other files in the folder are not ours and are left alone (listed in the report);
        - a `shared` store (several proxies) judges reservations by age alone and quarantines
          only files older than the reservation timeout: another live proxy's save is younger.

        Runs in one write transaction, so a live process's save in progress is not disturbed.
        """
        report = RecoveryReport()
        doomed_files: builtins.list[str] = []
        with self._lock, self._db.write():
            stale = self._drop_stale_reservations()
            report.stale_reservations = builtins.list(stale)
            doomed_files += stale.values()
            reserved = {name for (name,) in self._db.execute("SELECT file_name FROM reservations")}
            files = self._files_on_disk(report)
            for name in stale.values():
                files.pop(name, None)  # already going, and reported as a stale reservation
            doomed_rows: dict[str, str] = {}
            for archive_id, file_name, size, stored in self._db.execute(
                "SELECT id, file_name, bytes, tokens FROM archives"
            ):
                if file_name not in files:
                    report.missing_files.append(archive_id)
                    doomed_rows[archive_id] = file_name
                elif files[file_name] != size or (
                    check_headers and not _file_holds(self.path_for(file_name), stored)
                ):
                    report.damaged_files.append(archive_id)
                    doomed_rows[archive_id] = file_name
                    doomed_files.append(file_name)
                files.pop(file_name, None)
            self._delete_archives(doomed_rows)
            orphans = [name for name in files if name not in reserved]
            if self.shared:
                orphans = [name for name in orphans if self._older_than_a_save(name)]
            report.orphan_files = sorted(orphans)
            self._quarantine(report.orphan_files)
        unlink_files(self.path_for(name) for name in doomed_files)
        return report

    # -- quarantine: files without a row, kept for an operator to attribute --------------------

    @property
    def quarantine_directory(self) -> Path:
        return self.directory / QUARANTINE_DIR

    def _quarantine(self, file_names: Iterable[str]) -> None:
        names = builtins.list(file_names)
        if not names:
            return
        _make_private_directory(self.quarantine_directory)
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path_for(name), self.quarantine_directory / name)

    def quarantined(self) -> builtins.list[QuarantinedFile]:
        """Files in quarantine, oldest first, with what their headers say."""
        found: builtins.list[QuarantinedFile] = []
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
                _archivable_tokens(header, None)
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
            _archivable_tokens(read_slot_file(source), None)
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
        with self._lock:
            rows = self._db.execute(
                "SELECT id, file_name FROM archives WHERE fingerprint = ?", [old]
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

    # -- health ------------------------------------------------------------------------------------

    def verify(self) -> None:
        """Raise ArchiveIndexUnusable unless SQLite finds the index file intact (start-up)."""
        if self.database_file is None:
            return  # PostgreSQL checks its own pages; a damaged one fails the query that reads it
        try:
            with self._lock:
                problems = [row[0] for row in self._db.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as exc:
            if is_lock_timeout(exc):
                raise
            problems = [str(exc)]
        if problems != ["ok"]:
            raise ArchiveIndexUnusable(
                f"archive index {self.database} is damaged ({problems[0]}): move it away to start"
                f" a new index (the archive files then go to {self.directory / QUARANTINE_DIR},"
                " for `cacheproxy archives adopt`), or restore it from a backup"
            )

    def check(self) -> None:
        """Raise OSError or a database error (`DATABASE_ERRORS`) unless a save could work now:
        the folder exists (it is made again if deleted) and takes a file, and the index takes a
        write lock."""
        _make_private_directory(self.directory)
        probe = self.directory / f".probe_{secrets.token_hex(4)}"
        try:
            probe.write_bytes(b"")
        finally:
            with contextlib.suppress(FileNotFoundError):
                probe.unlink()
        with self._lock, self._db.write():
            pass

    # -- internals -----------------------------------------------------------------------------

    def _archive(self, row: Sequence[Any]) -> Archive:
        archive_id, tenant_id, file_name, fingerprint, n_tokens, size, created, last_used, hits = (
            row
        )
        return Archive(
            id=archive_id,
            tenant_id=tenant_id,
            file_name=file_name,
            path=self.path_for(file_name),
            fingerprint=fingerprint,
            n_tokens=n_tokens,
            bytes=size,
            created=created,
            last_used=last_used,
            hits=hits,
        )

    def _deepest_shared_depth(
        self, tenant_id: str, fingerprint: str, hashes: Sequence[bytes]
    ) -> int:
        """How many leading blocks of the request some archive shares, by binary search.

        An archive holding blocks 1..d of the request also holds 1..d-1 (it has a row for every
        depth), so "some archive shares d blocks" only turns false once: log2 probes suffice.
        """
        shared, unknown_above = 0, len(hashes)
        while shared < unknown_above:
            depth = (shared + unknown_above + 1) // 2
            found = self._db.execute(
                "SELECT 1 FROM archive_blocks WHERE tenant_id = ? AND fingerprint = ? "
                "AND hash = ? AND depth = ? LIMIT 1",
                [tenant_id, fingerprint, hashes[depth - 1], depth],
            ).fetchone()
            if found:
                shared = depth
            else:
                unknown_above = depth - 1
        return shared

    def _best_candidate(
        self,
        tenant_id: str,
        fingerprint: str,
        hashes: Sequence[bytes],
        depth: int,
        packed_request: bytes,
    ) -> str:
        """Among archives sharing `depth` blocks, the one that goes furthest into the next block.

        Only that next block of each is read (substr), not whole token lists.
        """
        start = depth * BLOCK_BYTES
        next_block = _unpack(packed_request[start : start + BLOCK_BYTES])
        rows = self._db.execute(
            "SELECT a.id, a.bytes, a.last_used, "
            "substr(a.tokens, CAST(? AS INTEGER), CAST(? AS INTEGER)) "
            "FROM archive_blocks b JOIN archives a ON a.id = b.archive_id "
            "WHERE b.tenant_id = ? AND b.fingerprint = ? AND b.hash = ? AND b.depth = ? "
            "AND a.tenant_id = ?",
            [start + 1, BLOCK_BYTES, tenant_id, fingerprint, hashes[depth - 1], depth, tenant_id],
        ).fetchall()

        def preference(row: tuple[str, int, float, bytes]) -> tuple[int, int, float, str]:
            archive_id, size, last_used, their_next = row
            reach = common_prefix_length(_unpack(their_next), next_block)
            return (reach, -size, last_used, archive_id)

        return max(rows, key=preference)[0]

    def _contained_archives(
        self, tenant_id: str, fingerprint: str, packed: bytes, hashes: Sequence[bytes]
    ) -> dict[str, str]:
        """The tenant's archives whose tokens are a prefix of `packed`: id -> file name.

        Such an archive's deepest block hash is one of ours at the same depth; only those
        candidates are read and compared exactly.
        """
        contained: dict[str, str] = {}
        for first in range(0, len(hashes), SQL_PARAMS_PER_QUERY):
            chunk = hashes[first : first + SQL_PARAMS_PER_QUERY]
            # a hash stands for one depth (the chain includes every block before it), so no
            # depth test is needed per hash; the exact comparison below settles the rest
            rows = self._db.execute(
                "SELECT a.id, a.file_name, a.tokens FROM archive_blocks b "
                "JOIN archives a ON a.id = b.archive_id "
                "WHERE b.tenant_id = ? AND b.fingerprint = ? AND a.tenant_id = ? "
                f"AND b.hash IN ({', '.join('?' * len(chunk))}) "
                "AND b.depth = a.n_tokens / ? AND a.n_tokens <= ?",
                [tenant_id, fingerprint, tenant_id, *chunk, BLOCK_TOKENS, len(packed) // 4],
            ).fetchall()
            for archive_id, file_name, stored in rows:
                if packed.startswith(stored):
                    contained[archive_id] = file_name
        return contained

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
        leaving_ids = builtins.list(leaving)
        tenant_bytes, tenant_count = self._used(tenant_id, leaving_ids, ignored_reservation)
        need_bytes = 0 if quota_bytes is None else tenant_bytes + new_bytes - quota_bytes
        need_count = 0 if quota_archives is None else tenant_count + 1 - quota_archives
        if need_bytes > 0 or need_count > 0:
            candidates = self._candidates(tenant_id, excluded=leaving_ids)
            victims |= self._victims(candidates, need_bytes, need_count, "the tenant quota")
        total_bytes, _ = self._used(None, leaving_ids + builtins.list(victims), ignored_reservation)
        need_bytes = total_bytes + new_bytes - self.budget_bytes
        if need_bytes > 0:
            candidates = self._candidates(None, excluded=leaving_ids + builtins.list(victims))
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
        candidates = self._candidates(None, excluded=builtins.list(leaving))
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
                and not _process_alive(pid, pid_started)
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

    def _older_than_a_save(self, file_name: str) -> bool:
        try:
            modified = self.path_for(file_name).stat().st_mtime
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
                elif entry.name != QUARANTINE_DIR:
                    report.foreign_files.append(entry.name)
        report.foreign_files.sort()
        return files


def _archivable_tokens(header: SlotFileHeader, claimed: Sequence[int] | None) -> array:
    if header.media_positions:
        raise ArchiveRefused("the state holds media chunks, which token ids cannot match")
    if claimed is not None and _pack(_token_array(claimed)) != _pack(header.tokens):
        raise ArchiveFileMismatch("the file holds other tokens than the slot was thought to hold")
    if len(header.tokens) < MIN_ARCHIVE_TOKENS:
        raise ArchiveRefused(
            f"{len(header.tokens)} tokens are fewer than the {MIN_ARCHIVE_TOKENS} worth archiving"
        )
    return header.tokens


def _file_holds(path: Path, packed_tokens: bytes) -> bool:
    try:
        header = read_slot_file(path)
    except (OSError, SlotFileError):
        return False
    return _pack(header.tokens) == packed_tokens


def _token_array(tokens: Sequence[int]) -> array:
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    try:
        return array("i", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be 32-bit whole numbers: {exc}") from None


def _pack(tokens: array) -> bytes:
    """Token ids as stored: int32 little-endian, as in the slot file."""
    if sys.byteorder == "big":
        swapped = array("i", tokens)
        swapped.byteswap()
        return swapped.tobytes()
    return tokens.tobytes()


def _unpack(packed: bytes) -> array:
    tokens = array("i", packed)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


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


def _make_private_directory(directory: Path) -> None:
    if directory.is_dir():
        # an existing folder keeps its mode: the operator may share it with llama-server's group
        return
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)  # mkdir's mode is filtered through the umask


def host_identity() -> str:
    """This host's name and boot: the pids of one boot of one kernel are one namespace (a
    container with a pid namespace of its own should set a hostname of its own)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def _process_stat(pid: int) -> tuple[str, int] | None:
    """The process's state letter and start time (clock ticks since boot); None where unknown.

    The start time and the pid together name a process uniquely: pids are reused, in a container
    often at once (a restarted proxy may well get its predecessor's pid).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the fields after the command name (which may hold spaces) start after the last ')':
    # state is field 3 of the line, starttime field 22
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def _process_start_ticks(pid: int) -> int | None:
    stat = _process_stat(pid)
    return None if stat is None else stat[1]


def _process_alive(pid: int, started: int | None) -> bool:
    # Assumes every process using the database shares this host's pid namespace (a `shared`
    # store, whose writers may be on other hosts, does not ask).
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    stat = _process_stat(pid)
    if stat is None:
        return True
    state, current_start = stat
    # a zombie has exited: only its parent has not collected its status yet
    return state not in ("Z", "X") and (started is None or current_start == started)
