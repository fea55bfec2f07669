"""Room in the archive index: what the archives hold on disk, which of them leave to make room
for a new state (the eviction policy's choice, checked), and their removal.

What an archive holds is its file's bytes, or, kept as blocks, the bytes of the blocks it uses;
a block two archives use is counted once, and freed only when the last of them leaves. So what
an archive frees when it leaves is what no archive staying uses: the policy is shown that, and
when its choice frees less than that promised (archives sharing blocks left together), the
store counts again and asks for more. Every call runs inside the caller's write transaction.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from cacheproxy.disk.archive_reads import SQL_PARAMS_PER_QUERY, ArchiveReads
from cacheproxy.disk.archive_schema import COPY_BYTES, STORED_BYTES
from cacheproxy.disk.archive_types import ArchiveError, DiskFull, QuotaExceeded
from cacheproxy.disk.eviction import EvictionCandidate

# an archive the eviction policy may choose: what it frees, its file's name, kept as blocks?
Candidate = tuple[EvictionCandidate, str, bool]
# what makes room: the archives that leave (id -> file name), and the whole copies of block
# archives dropped first (their file names), each to be unlinked once the transaction commits
Room = tuple[dict[str, str], list[str]]


class ArchiveRoom(ArchiveReads):
    """Counting, choosing and removing archives to make room (under the connection's lock,
    in the caller's write transaction)."""

    def _make_room(
        self,
        tenant_id: str,
        new_bytes: int,
        quota_bytes: int | None,
        quota_archives: int | None,
        *,
        leaving: Mapping[str, str],
        ignored_reservation: str | None = None,
        added: str | None = None,
    ) -> Room:
        """Victims (id -> file name) whose removal lets one more state of `new_bytes` fit, or
        lets the archive `added`, already in the index (and counted), stay; and the whole
        copies dropped before any archive leaves for the global budget, which counts them.

        Counts committed archives, minus those already `leaving`, plus every reservation but
        `ignored_reservation` (the one being committed). Raises QuotaExceeded when the policy's
        choice cannot make it fit; the caller's transaction then rolls back whole.
        """
        victims: dict[str, str] = {}
        leaving_ids = list(leaving)
        new_count = 0 if added is not None else 1
        kept = () if added is None else (added,)
        if quota_bytes is not None or quota_archives is not None:
            tenant_bytes, tenant_count = self._used(tenant_id, leaving_ids, ignored_reservation)
            need_bytes = 0 if quota_bytes is None else tenant_bytes + new_bytes - quota_bytes
            need_count = 0 if quota_archives is None else tenant_count + new_count - quota_archives
            if need_bytes > 0 or need_count > 0:
                victims |= self._victims(
                    tenant_id, need_bytes, need_count, "the tenant quota", leaving_ids, kept
                )
        gone = leaving_ids + list(victims)
        need_bytes = self._over_budget(new_bytes, gone, ignored_reservation)
        copies, freed = self._drop_copies(need_bytes, gone)
        if need_bytes - freed > 0:
            victims |= self._victims(None, need_bytes - freed, 0, "the global budget", gone, kept)
        return victims, copies

    def _over_budget(
        self, new_bytes: int, gone: Sequence[str], ignored_reservation: str | None
    ) -> int:
        """By how many bytes one more state of `new_bytes` overruns the global budget, with
        the `gone` archives gone (0 or less: it fits)."""

        def over(excluded: Sequence[str]) -> int:
            total_bytes, _ = self._used(None, excluded, ignored_reservation)
            return total_bytes + self._copy_bytes(excluded) + new_bytes - self.budget_bytes

        # counted with them first (a cheaper count): under the budget so, under without
        if gone and (with_them := over([])) <= 0:
            return with_them
        return over(gone)

    def _room_on_disk(
        self,
        new_bytes: int,
        leaving: Mapping[str, str],
        stale: Mapping[str, str],
        dropped_copies: Sequence[str] = (),
    ) -> Room:
        """More victims, if the file system has less free space than the new state, the other
        saves in progress and `min_free_bytes` need (quotas and budget say nothing of a disk
        that other things fill); whole copies go first. Raises DiskFull when evicting cannot
        make enough room."""
        shortfall = self._disk_shortfall(new_bytes)
        if shortfall <= 0 and not (leaving or stale or dropped_copies):
            return {}, []  # room to spare, and nothing leaving whose room would count (most saves)
        freed = self._file_bytes(
            self._freed_at_once([*leaving.values(), *stale.values(), *dropped_copies])
        )
        # what stays stored, and what blocks held open leave, as the victims so far are gone
        stored_left = self._stored(None, list(leaving))[0]
        open_blocks = self._open_block_users()
        blocks_held = held_block_bytes(open_blocks, list(leaving))
        freed += self._stored(None, [])[0] - stored_left
        freed -= self._whole_bytes(list(leaving))  # their files are counted by their size
        freed -= blocks_held
        copies, copies_freed = self._drop_copies(shortfall - freed, list(leaving))
        need = shortfall - freed - copies_freed + self._held_file_bytes(copies)
        victims: dict[str, str] = {}
        while need > 0:
            gone = [*leaving, *victims]
            try:
                more = self._victims(None, need, 0, "the free disk space", gone)
            except QuotaExceeded as exc:
                raise DiskFull(
                    f"{self.directory} lacks {shortfall} bytes of free space for {new_bytes} more"
                    f" and {self.min_free_bytes} spare ({exc})"
                ) from None
            victims |= more
            # the policy counted their files and blocks, but those still held free room later
            gone = [*leaving, *victims]
            now_left, now_held = self._stored(None, gone)[0], held_block_bytes(open_blocks, gone)
            held = self._held_file_bytes(more.values()) + now_held - blocks_held
            need -= stored_left - now_left - held
            stored_left, blocks_held = now_left, now_held
        return victims, copies

    def _disk_shortfall(self, new_bytes: int) -> int:
        """How many bytes the file system lacks to hold `new_bytes` more beside the saves
        reserved and `min_free_bytes` (0 or less: none). What is done about it is the caller's:
        a save evicts for it, a cut only drops whole copies."""
        stats = os.statvfs(self.directory)
        (reserved,) = self._db.execute(
            "SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT) FROM reservations"
        ).fetchone()
        shortfall = new_bytes + reserved + self.min_free_bytes - stats.f_bavail * stats.f_frsize
        self.spare_bytes = -shortfall
        return shortfall

    def _copy_bytes(self, excluded: Sequence[str], used_by: float | None = None) -> int:
        """The bytes of the whole copies kept, but those of `excluded` archives (and, with
        `used_by`, of archives used since)."""
        where, params = _copies_where(excluded, used_by)
        (total,) = self._db.execute(
            f"SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT) FROM archives WHERE {where}", params
        ).fetchone()
        return total

    def _drop_copies(
        self, need_bytes: int, excluded: Sequence[str], used_by: float | None = None
    ) -> tuple[list[str], int]:
        """Drop whole copies (of archives but `excluded` ones, and with `used_by`, but those
        used since), least recently used first, until they free `need_bytes` (all of them, if
        that is not enough): their file names, to unlink once the transaction commits, and the
        bytes they free. The archives stay, as their blocks."""
        if need_bytes <= 0:
            return [], 0
        where, params = _copies_where(excluded, used_by)
        rows = self._db.execute(
            f"SELECT id, file_name, bytes FROM archives WHERE {where} ORDER BY last_used, id",
            params,
        ).fetchall()
        dropped: list[tuple[str, str]] = []
        freed = 0
        for archive_id, file_name, size in rows:
            if freed >= need_bytes:
                break
            dropped.append((archive_id, file_name))
            freed += size
        self._db.executemany(
            "UPDATE archives SET whole_copy = 0 WHERE id = ?",
            [(archive_id,) for archive_id, _ in dropped],
        )
        return [file_name for _, file_name in dropped], freed

    def _held_file_bytes(self, file_names: Iterable[str]) -> int:
        """The bytes of those files whose unlink would not free their room at once."""
        names = list(file_names)
        freed = set(self._freed_at_once(names))
        return self._file_bytes(name for name in names if name not in freed)

    def _open_block_users(self) -> dict[str, tuple[set[str], int]]:
        """The blocks restores hold open that archives still use: block id -> those archives
        and the block's bytes (read once a room is made, `held_block_bytes` asks of it)."""
        users: dict[str, tuple[set[str], int]] = {}
        for chunk in _chunks(list(self._open_blocks)):
            for block_id, archive_id, size in self._db.execute(
                "SELECT r.block_id, r.archive_id, b.bytes FROM archive_kv_blocks r"
                f" JOIN kv_blocks b ON b.id = r.block_id WHERE r.block_id IN ({_marks(chunk)})",
                chunk,
            ).fetchall():
                users.setdefault(block_id, (set(), size))[0].add(archive_id)
        return users

    def _file_bytes(self, file_names: Iterable[str]) -> int:
        total = 0
        for name in file_names:
            with contextlib.suppress(OSError):
                total += self.path_for(name).stat().st_size
        return total

    def _whole_bytes(self, archive_ids: Sequence[str]) -> int:
        """What the index counts for these archives' own files (their blocks aside)."""
        total = 0
        for chunk in _chunks(archive_ids):
            (part,) = self._db.execute(
                f"SELECT CAST(coalesce(sum({STORED_BYTES}), 0) AS BIGINT) FROM archives"
                f" WHERE id IN ({_marks(chunk)})",
                chunk,
            ).fetchone()
            total += part
        return total

    def _stored(self, tenant_id: str | None, excluded: Sequence[str]) -> tuple[int, int]:
        """(bytes, count) the archives hold on disk, without `excluded` archives: their files,
        and each block some archive but those uses, once."""
        tenant_filter = "" if tenant_id is None else "AND tenant_id = ?"
        tenant_params = [] if tenant_id is None else [tenant_id]
        excluded_filter, excluded_params = _not_in("id", excluded)
        files, count = self._db.execute(
            f"SELECT CAST(coalesce(sum({STORED_BYTES}), 0) AS BIGINT), count(*) FROM archives "
            f"WHERE 1 = 1 {tenant_filter} {excluded_filter}",
            [*tenant_params, *excluded_params],
        ).fetchone()
        (blocks,) = self._db.execute(
            "SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT) FROM kv_blocks"
            f" WHERE 1 = 1 {tenant_filter}",
            tenant_params,
        ).fetchone()
        if excluded:
            # a block stays while an archive that is not leaving uses it: those the leaving
            # ones alone use go, found from their own rows (not by asking of every block)
            block_tenant = "" if tenant_id is None else "AND b.tenant_id = ?"
            (leaving_only,) = self._db.execute(
                "SELECT CAST(coalesce(sum(b.bytes), 0) AS BIGINT) FROM (SELECT DISTINCT block_id"
                f" FROM archive_kv_blocks WHERE archive_id IN ({_marks(excluded)})) AS theirs"
                f" JOIN kv_blocks b ON b.id = theirs.block_id WHERE 1 = 1 {block_tenant}"
                " AND NOT EXISTS (SELECT 1 FROM archive_kv_blocks r WHERE r.block_id = b.id"
                f" AND r.archive_id NOT IN ({_marks(excluded)}))",
                [*excluded, *tenant_params, *excluded],
            ).fetchone()
            blocks -= leaving_only
        return files + blocks, count

    def _used(
        self, tenant_id: str | None, excluded: Sequence[str], ignored_reservation: str | None
    ) -> tuple[int, int]:
        """Committed plus reserved (bytes, count), without `excluded` archives."""
        stored_bytes, stored_count = self._stored(tenant_id, excluded)
        tenant_filter = "" if tenant_id is None else "AND tenant_id = ?"
        tenant_params = [] if tenant_id is None else [tenant_id]
        ignored_filter = "" if ignored_reservation is None else "AND id <> ?"
        ignored_params = [] if ignored_reservation is None else [ignored_reservation]
        reserved = self._db.execute(
            f"SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT), count(*) FROM reservations "
            f"WHERE 1 = 1 {ignored_filter} {tenant_filter}",
            [*ignored_params, *tenant_params],
        ).fetchone()
        return stored_bytes + reserved[0], stored_count + reserved[1]

    def _candidates(
        self, tenant_id: str | None, excluded: Sequence[str], kept: Sequence[str] = ()
    ) -> dict[str, Candidate]:
        """The archives that may leave (not `kept` ones), each with the bytes it would free
        leaving now (with `excluded` gone): its file, or the blocks only it still uses."""
        tenant_filter = "" if tenant_id is None else "AND tenant_id = ?"
        tenant_params = [] if tenant_id is None else [tenant_id]
        excluded_filter, excluded_params = _not_in("id", [*excluded, *kept])
        rows = self._db.execute(
            f"SELECT id, {STORED_BYTES}, last_used, hits, created, file_name,"
            " coalesce(frame, '') <> '' FROM archives "
            f"WHERE 1 = 1 {tenant_filter} {excluded_filter}",
            [*tenant_params, *excluded_params],
        ).fetchall()
        exclusive = self._exclusive_block_bytes(tenant_id, excluded)
        return {
            archive_id: (
                EvictionCandidate(
                    archive_id, size + exclusive.get(archive_id, 0), last_used, hits, created
                ),
                file_name,
                bool(in_blocks),
            )
            for archive_id, size, last_used, hits, created, file_name, in_blocks in rows
        }

    def _exclusive_block_bytes(
        self, tenant_id: str | None, excluded: Sequence[str]
    ) -> dict[str, int]:
        """Per block archive, the bytes of its blocks no other archive (but `excluded` ones)
        uses."""
        tenant_filter = "" if tenant_id is None else "AND a.tenant_id = ?"
        tenant_params = [] if tenant_id is None else [tenant_id]
        excluded_filter, excluded_params = _not_in("a.id", excluded)
        others_filter, _ = _not_in("o.archive_id", excluded)
        rows = self._db.execute(
            "SELECT r.archive_id, CAST(sum(b.bytes) AS BIGINT) FROM archive_kv_blocks r"
            " JOIN kv_blocks b ON b.id = r.block_id JOIN archives a ON a.id = r.archive_id"
            f" WHERE 1 = 1 {tenant_filter} {excluded_filter} AND NOT EXISTS (SELECT 1 FROM"
            " archive_kv_blocks o WHERE o.block_id = r.block_id AND o.archive_id <> r.archive_id"
            f" {others_filter}) GROUP BY r.archive_id",
            [*tenant_params, *excluded_params, *excluded_params],
        ).fetchall()
        return dict(rows)

    def _victims(
        self,
        tenant_id: str | None,
        need_bytes: int,
        need_count: int,
        what: str,
        leaving: Sequence[str],
        kept: Sequence[str] = (),
    ) -> dict[str, str]:
        """The policy's choice among `tenant_id`'s archives (anyone's: None) besides `leaving`
        and `kept`, freeing `need_bytes` and `need_count` archives; raises QuotaExceeded when
        it cannot.

        Archives kept whole free what the policy was shown. Block archives that share blocks
        free more together than the sum shown, so their choice is walked in the policy's order
        and cut where it frees enough; and if it frees less (blocks of the chosen ones shared
        with others that stay), the policy is asked again for the rest."""
        need_bytes, need_count = max(need_bytes, 0), max(need_count, 0)
        held, _ = self._stored(tenant_id, leaving)
        victims: dict[str, str] = {}
        freed = 0
        while freed < need_bytes or len(victims) < need_count:
            candidates = self._candidates(tenant_id, [*leaving, *victims], kept)
            chosen = self.eviction.choose_victims(
                [candidate for candidate, _, _ in candidates.values()],
                max(need_bytes - freed, 0),
                max(need_count - len(victims), 0),
            )
            # the policy is a plugin: its answer is checked, not trusted
            if len(set(chosen)) != len(chosen) or not set(chosen) <= set(candidates):
                raise ArchiveError(f"eviction policy chose unknown or repeated archives: {chosen}")
            sharing = any(candidates[archive_id][2] for archive_id in chosen)
            for archive_id in chosen:
                victims[archive_id] = candidates[archive_id][1]
                if sharing:
                    freed = held - self._stored(tenant_id, [*leaving, *victims])[0]
                    if freed >= need_bytes and len(victims) >= need_count:
                        break
            freed = held - self._stored(tenant_id, [*leaving, *victims])[0]
            if not sharing or not chosen:
                break  # what the policy was shown is what its choice frees: no more to ask
        if freed < need_bytes or len(victims) < need_count:
            raise QuotaExceeded(
                f"{what} leaves no room: {need_bytes} bytes and {need_count} archives must go, "
                f"the eviction policy's choice frees {freed} bytes and {len(victims)} archives"
            )
        return victims

    def _blocks_with_keys(
        self, tenant_id: str, fingerprint: str, keys: Sequence[bytes]
    ) -> dict[tuple[bytes, int], tuple[str, int]]:
        """The tenant's kept blocks under these keys: (key, cells) -> (block id, bytes)."""
        found: dict[tuple[bytes, int], tuple[str, int]] = {}
        with self._lock:
            for first in range(0, len(keys), SQL_PARAMS_PER_QUERY):
                chunk = list(keys[first : first + SQL_PARAMS_PER_QUERY])
                rows = self._db.execute(
                    "SELECT hash, n_cells, id, bytes FROM kv_blocks WHERE tenant_id = ? AND"
                    f" fingerprint = ? AND hash IN ({_marks(chunk)})",
                    [tenant_id, fingerprint, *chunk],
                ).fetchall()
                found.update(
                    {(bytes(key), cells): (block_id, size) for key, cells, block_id, size in rows}
                )
        return found

    def _delete_archives(self, archive_ids: Iterable[str]) -> list[Path]:
        """Delete the archives' rows (their lookup rows go with them) and the rows of the
        blocks no other archive uses; returns those blocks' files, for the caller to unlink
        once the transaction is committed."""
        doomed = list(archive_ids)
        if not doomed:
            return []
        blocks: set[str] = set()
        for chunk in _chunks(doomed):
            blocks.update(
                block_id
                for (block_id,) in self._db.execute(
                    "SELECT DISTINCT block_id FROM archive_kv_blocks"
                    f" WHERE archive_id IN ({_marks(chunk)})",
                    chunk,
                ).fetchall()
            )
        # the block and lookup rows go with them (ON DELETE CASCADE)
        self._db.executemany(
            "DELETE FROM archives WHERE id = ?", [(archive_id,) for archive_id in doomed]
        )
        return self._free_unused_blocks(sorted(blocks))

    def _free_unused_blocks(self, block_ids: Sequence[str]) -> list[Path]:
        """Delete the rows of those blocks no archive uses any more: their files."""
        freed: list[Path] = []
        for chunk in _chunks(block_ids):
            rows = self._db.execute(
                f"DELETE FROM kv_blocks WHERE id IN ({_marks(chunk)}) AND NOT EXISTS"
                " (SELECT 1 FROM archive_kv_blocks r WHERE r.block_id = kv_blocks.id)"
                " RETURNING id",
                chunk,
            ).fetchall()
            freed += [self.blocks_directory / block_id for (block_id,) in rows]
        return freed


def _chunks(values: Sequence[str]) -> list[list[str]]:
    return [
        list(values[first : first + SQL_PARAMS_PER_QUERY])
        for first in range(0, len(values), SQL_PARAMS_PER_QUERY)
    ]


def _marks(values: Sequence[object]) -> str:
    return ", ".join("?" * len(values))


def _copies_where(excluded: Sequence[str], used_by: float | None) -> tuple[str, list[object]]:
    """The archives whose whole copies are kept, but `excluded` ones and, with `used_by`,
    those used after it: a WHERE clause and its parameters."""
    excluded_filter, excluded_params = _not_in("id", excluded)
    where = f"{COPY_BYTES} > 0 {excluded_filter}"
    if used_by is None:
        return where, list(excluded_params)
    return f"{where} AND last_used <= ?", [*excluded_params, used_by]


def _not_in(column: str, values: Sequence[str]) -> tuple[str, list[str]]:
    if not values:
        return "", []
    return f"AND {column} NOT IN ({_marks(values)})", list(values)


def held_block_bytes(open_blocks: Mapping[str, tuple[set[str], int]], gone: Sequence[str]) -> int:
    """The bytes of the blocks held open (`_open_block_users`) that only `gone` archives use:
    they leave with them, but free their room only once closed."""
    gone_set = set(gone)
    return sum(size for users, size in open_blocks.values() if users <= gone_set)
