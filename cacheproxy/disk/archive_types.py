"""What the archive store takes and gives: archives, matches, reservations, reports; its errors;
how its files are named."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

# "a_" + 32 hex + ".slot": passes llama-server's fs_validate_filename and says nothing about
# the tenant or the prompt.
FILE_NAME_PATTERN = re.compile(r"a_[0-9a-f]{32}\.slot")
# slot files made for one restore (a prefix put together from blocks, or a link to an archive)
RESTORE_NAME_PATTERN = re.compile(r"r_[0-9a-f]{32}\.slot")
# Files named like archives that no row claims are moved here, never deleted: the index may be
# the thing that was lost. llama-server cannot address it (its file names take no "/").
QUARANTINE_DIR = "quarantine"


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
    # kept as blocks of KV cells shared with the tenant's other archives (`bytes` is then the
    # size of the whole slot file they make up); False: kept as that slot file
    blocks: bool = False
    # kept as blocks, with that whole slot file too, for restores of most of it
    whole_copy: bool = False


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
class FoundRoom:
    """A lookup and, when the save was chosen, its reservation (`ArchiveStore.find_and_reserve`);
    `refused`: the save was chosen but no room could be made."""

    match: Match | None
    reservation: Reservation | None
    refused: ArchiveError | None = None


@dataclass(frozen=True)
class Committed:
    archive: Archive
    replaced_ids: tuple[str, ...]  # older archives of the tenant this one contains
    evicted_ids: tuple[str, ...]  # archives that left because the file was larger than reserved
    paths_to_unlink: tuple[Path, ...]


@dataclass(frozen=True)
class RestoreFile:
    """A slot file in the archive folder for llama-server to restore (`ArchiveBlocks`)."""

    file_name: str
    n_tokens: int  # the tokens it holds
    bytes: int
    temporary: bool  # made for this restore: removed once the server has read it
    made_ms: float  # how long putting it together took (0 for a whole file)


class Usage(NamedTuple):
    bytes: int  # on disk: each block once
    count: int


class Sharing(NamedTuple):
    whole_bytes: int  # what the archives would take as whole slot files
    shared_bytes: int  # bytes of blocks more than one archive uses (each counted once)
    copy_bytes: int = 0  # whole copies kept beside blocks (the budget counts them, no quota)


@dataclass
class RecoveryReport:
    stale_reservations: list[str] = field(default_factory=list)  # ids; their files removed
    missing_files: list[str] = field(default_factory=list)  # archive ids; rows removed
    damaged_files: list[str] = field(default_factory=list)  # archive ids; rows and files removed
    # our file names without a row: moved to the quarantine folder, for `archives adopt`
    orphan_files: list[str] = field(default_factory=list)
    foreign_files: list[str] = field(default_factory=list)  # not ours: left alone
    # blocks whose file was missing or damaged: removed, with the archives using them
    damaged_blocks: list[str] = field(default_factory=list)
    # block files without a row: moved to the quarantine folder's blocks/
    orphan_blocks: list[str] = field(default_factory=list)
    # files no row needs: whole files of archives cut into blocks, files made for restores
    leftover_files: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(
            self.stale_reservations
            or self.missing_files
            or self.damaged_files
            or self.orphan_files
            or self.damaged_blocks
            or self.orphan_blocks
            or self.leftover_files
        )


@dataclass(frozen=True)
class QuarantinedFile:
    file_name: str
    path: Path
    bytes: int
    modified: float  # unix seconds
    n_tokens: int | None  # from the slot file header; None when the header is unreadable
    problem: str | None  # why it cannot be adopted, if it cannot


def new_file_name() -> str:
    return f"a_{secrets.token_hex(16)}.slot"


def unlink_files(paths: Iterable[Path]) -> int:
    """Remove files the store released; a missing one is fine. Returns how many were removed."""
    removed = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed
