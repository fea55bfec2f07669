"""The archive index's schema, and the index opened on it: one connection under one lock, the
folder of archive files beside it, and its health checks.

The schema's migrations are append-only: once released, a migration is never edited, only
followed by another. `IndexedFolder` is the base of the blocking store (`store.ArchiveIndex`):
the lookups (`archive_reads`), the quota transactions (`archive_quotas`) and recovery and repair
(`archive_repair`) build on the connection, the lock and the paths it holds.
"""

from __future__ import annotations

import contextlib
import copy
import secrets
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

from cacheproxy.db.connection import (
    DATABASE_ERRORS,
    DatabaseTarget,
    connect,
    is_database_url,
    is_lock_timeout,
    shown_target,
)
from cacheproxy.db.migrations import Migrations
from cacheproxy.disk.archive_types import QUARANTINE_DIR, Archive, ArchiveIndexUnusable
from cacheproxy.disk.checked_blocks import CheckedBlocks
from cacheproxy.disk.eviction import EvictionPolicy
from cacheproxy.disk.kv_assembly import BlockCheck
from cacheproxy.disk.kv_blocks import BLOCKS_DIR
from cacheproxy.ops.processes import host_identity

BUSY_TIMEOUT_S = 10.0
# A save still unfinished after this long has failed, even if its process lives on.
DEFAULT_RESERVATION_TIMEOUT_S = 600.0
ARCHIVE_COLUMNS = "id, tenant_id, file_name, fingerprint, n_tokens, bytes, created, last_used, hits"
# the bytes an archive's row itself counts: its file's; a block archive's are its blocks'
STORED_BYTES = "CASE WHEN in_blocks = 0 THEN bytes ELSE 0 END"
# the bytes of a block archive's whole copy, kept while the budget has room (`whole_copy`)
COPY_BYTES = "CASE WHEN in_blocks <> 0 AND whole_copy <> 0 THEN bytes ELSE 0 END"
# what an `Archive` is read from: its columns, whether it is kept as blocks, and with a copy
# (from its frame: a proxy of an earlier release sharing the index sets no `in_blocks`, which
# only makes the sums above count its archive's file beside its blocks)
IN_BLOCKS = "coalesce(frame, '') <> ''"
ARCHIVE_FIELDS = f"{ARCHIVE_COLUMNS}, {IN_BLOCKS}, {IN_BLOCKS} AND whole_copy <> 0"

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

# Archives kept as blocks of KV cells (`kv_blocks`): a block holds the cells of one run of
# tokens, is written once per tenant and fingerprint (the key: the hash of the tokens up to its
# end, and its cell count) and is used by every archive that holds those tokens. An archive's
# `frame` says which: NULL, its whole slot file not yet looked at; '', kept as that file (a
# layout the code does not cut); otherwise the KV frame (JSON) its blocks fill, in order.
MIGRATIONS.add(
    "m004_kv_blocks",
    """
    ALTER TABLE archives ADD COLUMN frame TEXT;
    CREATE TABLE kv_blocks (
        id TEXT PRIMARY KEY,  -- the block file's name, in the folder's blocks/
        tenant_id TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        hash {blob} NOT NULL,  -- of the tokens from the first up to the block's last cell
        n_cells {int} NOT NULL CHECK (n_cells > 0),
        bytes {int} NOT NULL CHECK (bytes > 0),
        crc {int} NOT NULL,  -- crc32 of the cells' data
        created {float} NOT NULL,
        UNIQUE (tenant_id, fingerprint, hash, n_cells)
    ) {strict};
    CREATE TABLE archive_kv_blocks (
        archive_id TEXT NOT NULL REFERENCES archives(id) ON DELETE CASCADE,
        ordinal {int} NOT NULL CHECK (ordinal >= 0),
        block_id TEXT NOT NULL REFERENCES kv_blocks(id),
        PRIMARY KEY (archive_id, ordinal)
    ) {strict};
    CREATE INDEX archive_kv_blocks_by_block ON archive_kv_blocks(block_id);
    """,
)

# A block archive's whole slot file, kept beside its blocks while the global budget has room
# (`whole_copy` 1; its `file_name`): a restore of most of the archive reads it rather than a
# file put together from the blocks. It counts against the budget but no tenant's quota, and
# goes before any archive does when room is needed (`ArchiveRoom._drop_copies`).
MIGRATIONS.add(
    "m005_whole_copies", "ALTER TABLE archives ADD COLUMN whole_copy {int} NOT NULL DEFAULT 0"
)

# Each archive's deepest whole block (the chained hash of its first n_tokens // 64 blocks,
# its `archive_blocks` row at that depth): the archives a new save contains are found through
# it, among those ending where the save's blocks go, not among every archive sharing a block
# with it (behind one system prompt, all of the tenant's).
MIGRATIONS.add(
    "m006_archive_last_block",
    """
    ALTER TABLE archives ADD COLUMN last_hash {blob};
    UPDATE archives SET last_hash = (
        SELECT b.hash FROM archive_blocks b
        WHERE b.archive_id = archives.id AND b.depth = archives.n_tokens / 64
    );
    CREATE INDEX archives_by_last_block ON archives(tenant_id, fingerprint, last_hash);
    """,
)

# Whether an archive is kept as blocks (`in_blocks` 1: its `frame` holds a KV frame, set with
# it), and what a save counts (`ArchiveRoom`: the bytes stored, the whole copies, without the
# archives leaving; the blocks' bytes) and a lookup's choice among equally long matches reads
# (size, last use), read from indexes rather than from the rows, which hold every archive's
# tokens: a few pages, not one or more an archive (3,000 archives: 10 ms a save in its sums,
# 0.5 with them; 20,000 blocks: 1.2 ms a sum of their bytes, 0.5).
MIGRATIONS.add(
    "m007_archive_usage",
    """
    ALTER TABLE archives ADD COLUMN in_blocks {int} NOT NULL DEFAULT 0;
    UPDATE archives SET in_blocks = 1 WHERE coalesce(frame, '') <> '';
    CREATE INDEX archives_usage
        ON archives(tenant_id, whole_copy, bytes, last_used, in_blocks, id);
    CREATE INDEX archives_choice ON archives(id, tenant_id, bytes, last_used);
    CREATE INDEX kv_blocks_usage ON kv_blocks(tenant_id, bytes);
    """,
)

# Beside each block row, the archive's next 64 tokens after it (fewer at its end), in the
# lookup's index: among the archives sharing a request's deepest block (behind one system
# prompt, all of the tenant's), the one going furthest into the next block is beside the
# request's own in that order, two probes away, not one read of every archive's tokens.
MIGRATIONS.add(
    "m008_archive_blocks_next",
    """
    ALTER TABLE archive_blocks ADD COLUMN next_tokens {blob};
    UPDATE archive_blocks SET next_tokens = (
        SELECT substr(a.tokens, CAST(archive_blocks.depth * 256 + 1 AS INTEGER), 256)
        FROM archives a WHERE a.id = archive_blocks.archive_id
    );
    DROP INDEX archive_blocks_lookup;
    CREATE INDEX archive_blocks_lookup_next
        ON archive_blocks(tenant_id, fingerprint, hash, depth, next_tokens);
    """,
)


class IndexedFolder:
    """Archived slot states in `directory`, indexed in the SQLite file (or PostgreSQL database)
    `database`: opened, its schema migrated, one connection serving every thread under one lock.

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
        blocks: bool = False,
        whole_copies: bool = True,
        checked_blocks: CheckedBlocks | None = None,
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
        # archives are cut into blocks of KV cells once saved (`ArchiveBlocks.convert`)
        self.blocks = blocks
        # an archive cut into blocks keeps its whole file while the budget has room
        self.whole_copies = whole_copies
        # the folder's file system's room beyond the saves reserved, `min_free_bytes` and the
        # state last asked room for, as that last ask found it (None: not asked yet); read
        # without the lock, by a save weighing a write beside its lookup (`Saves`)
        self.spare_bytes: int | None = None
        # files this process is writing, or lends llama-server: recovery leaves them alone
        self._in_flight: set[str] = set()
        # whole files a cut has mapped: an unlinked one keeps its room until the cut unmaps it
        self._cut_sources: set[str] = set()
        # block files restores hold open (a file put together from them is checked while the
        # server reads it): an unlinked one keeps its room until the last of them closes it
        self._open_blocks: Counter[str] = Counter()
        # restore files put together from blocks whose checksums are being checked meanwhile:
        # file name -> its archive, the check and the blocks it holds open (`checked`)
        self._checks: dict[str, tuple[str, BlockCheck, tuple[str, ...]]] = {}
        # blocks whose files have not changed since their payloads last matched
        self._checked_blocks = checked_blocks or CheckedBlocks()
        self._clock = clock
        self.host = host_identity()
        # One connection serves every thread, one operation at a time: a transaction never
        # interleaves with another thread's statements.
        self._lock = threading.RLock()
        with contextlib.suppress(OSError):
            # a folder that cannot be made now leaves the disk tier off until it can (`check`)
            make_private_directory(self.directory)
        if self.database_file is not None:
            make_private_directory(self.database_file.parent)
        is_new = self.database_file is not None and not self.database_file.exists()
        self._target, self._busy_timeout_s = database, busy_timeout_s  # for `lookups`
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
                # WAL without a sync per transaction: a killed process loses no commit (the
                # WAL is in the page cache), a power cut may lose the last ones, which start-up
                # recovery mends as any lost row (files without rows go to quarantine). A sync
                # per commit was half of a reservation's time in the store's worker.
                self._db.execute("PRAGMA synchronous = NORMAL")
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

    def lookups(self) -> Self:
        """This index with a connection and a lock of its own, for lookups (`find`) in another
        thread beside the index's other work: they see what is committed, as another process
        would. Everything else is shared: use it for reads alone. Close it with `close`."""
        view = copy.copy(self)
        view._lock = threading.RLock()
        view._db = connect(self._target, busy_timeout_s=self._busy_timeout_s, lock_name="archive")
        return view

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def path_for(self, file_name: str) -> Path:
        return self.directory / file_name

    def _unlent_paths(self, file_names: Sequence[str]) -> list[Path]:
        """The paths of those dropped archives' files that no restore has lent to the server
        (called holding `_lock`, in the transaction that drops their rows): a lent one is
        removed when it is given back (`release`), not under the server reading it."""
        return [self.path_for(name) for name in file_names if name not in self._in_flight]

    def _freed_at_once(self, file_names: Sequence[str]) -> list[str]:
        """Those of the dropped archives' `file_names` whose room their unlink frees at once
        (called holding `_lock`): not one lent to the server (removed when given back) nor
        one a cut has mapped (its pages stay until the cut is done with them)."""
        held = self._in_flight | self._cut_sources
        return [name for name in file_names if name not in held]

    @property
    def quarantine_directory(self) -> Path:
        return self.directory / QUARANTINE_DIR

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
        make_private_directory(self.directory)
        probe = self.directory / f".probe_{secrets.token_hex(4)}"
        try:
            probe.write_bytes(b"")
        finally:
            with contextlib.suppress(FileNotFoundError):
                probe.unlink()
        with self._lock, self._db.write():
            pass

    # -- internals -----------------------------------------------------------------------------

    @property
    def blocks_directory(self) -> Path:
        return self.directory / BLOCKS_DIR

    def _archive(self, row: Sequence[Any]) -> Archive:
        """An `Archive` from a row of `ARCHIVE_FIELDS`."""
        (
            archive_id,
            tenant_id,
            file_name,
            fingerprint,
            n_tokens,
            size,
            created,
            last_used,
            hits,
            in_blocks,
            copy,
        ) = row
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
            blocks=bool(in_blocks),
            whole_copy=bool(copy),
        )


def make_private_directory(directory: Path) -> None:
    if directory.is_dir():
        # an existing folder keeps its mode: the operator may share it with llama-server's group
        return
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)  # mkdir's mode is filtered through the umask
