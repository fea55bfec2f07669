"""The archive index's reads: the archive sharing the longest prefix with a request, an
archive by id, the listings and totals the admin API and the CLI show.

Lookups go through the chained hashes of whole 64-token blocks (`blocks.block_hashes`): the
deepest block some archive of the tenant shares with the request is found by binary search over
the depths, a few index probes, and `n_common` is then computed exactly on the stored tokens.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheproxy.disk.archive_schema import ARCHIVE_COLUMNS, IndexedFolder
from cacheproxy.disk.archive_types import Archive, Match, Usage
from cacheproxy.disk.blocks import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    block_hashes,
    pack,
    token_array,
    unpack,
)
from cacheproxy.disk.slot_file import SlotFileError, read_slot_file
from cacheproxy.tokens import common_prefix_length

SQL_PARAMS_PER_QUERY = 500  # far below SQLite's (and PostgreSQL's) limit on bound parameters


class ArchiveReads(IndexedFolder):
    """Lookups and listings of the archive index (each under the connection's lock)."""

    def find(self, tenant_id: str, fingerprint: str, tokens: Sequence[int]) -> Match | None:
        """The tenant's archive sharing the longest prefix with `tokens` (at least one block).

        Among equally long matches the smallest file wins (cheapest to restore), then the most
        recently used. `n_common` is exact: it is computed on the stored tokens.
        """
        request = token_array(tokens)
        packed = pack(request)
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
        archive_tokens = unpack(row[-1])
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
        return None if row is None else unpack(row[0]).tolist()

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
        return size == archive.bytes and file_holds(archive.path, pack(token_array(tokens)))

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
        next_block = unpack(packed_request[start : start + BLOCK_BYTES])
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
            reach = common_prefix_length(unpack(their_next), next_block)
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


def archive_summary(archive: Archive) -> dict[str, Any]:
    """An archive as the admin API and the CLI show it: no path, no tokens."""
    summary = dataclasses.asdict(archive)
    del summary["path"], summary["file_name"]
    return summary


def archive_listing(store: ArchiveReads, tenant_id: str | None = None) -> dict[str, Any]:
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


def file_holds(path: Path, packed_tokens: bytes) -> bool:
    try:
        header = read_slot_file(path)
    except (OSError, SlotFileError):
        return False
    return pack(header.tokens) == packed_tokens
