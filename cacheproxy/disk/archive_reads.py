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

from cacheproxy.disk.archive_schema import ARCHIVE_FIELDS, COPY_BYTES, STORED_BYTES, IndexedFolder
from cacheproxy.disk.archive_types import Archive, Match, Sharing, Usage
from cacheproxy.disk.blocks import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    TOKEN_BYTES,
    block_hashes,
    pack,
    token_array,
    unpack,
)
from cacheproxy.disk.kv_blocks import block_file_holds
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
                f"SELECT {ARCHIVE_FIELDS}, tokens FROM archives WHERE id = ? AND tenant_id = ?",
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
                f"SELECT {ARCHIVE_FIELDS} FROM archives WHERE id = ?", [archive_id]
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
                f"SELECT {ARCHIVE_FIELDS} FROM archives {where} ORDER BY created, id", params
            ).fetchall()
        return [self._archive(row) for row in rows]

    def usage(self, tenant_id: str | None = None, *, include_reserved: bool = False) -> Usage:
        """Bytes and count of committed archives (plus reservations in progress, if asked).
        The bytes are what the archives hold on disk: each block once, however many archives
        use it (what the quotas count)."""
        where, params = ("WHERE tenant_id = ?", [tenant_id]) if tenant_id is not None else ("", [])
        reserved_part = (
            f"UNION ALL SELECT bytes, 1 FROM reservations {where}" if include_reserved else ""
        )
        # one statement: a consistent snapshot even while other processes commit
        sql = (
            "SELECT CAST(coalesce(sum(bytes), 0) AS BIGINT), CAST(coalesce(sum(n), 0) AS BIGINT)"
            f" FROM (SELECT {STORED_BYTES} AS bytes, 1 AS n FROM archives {where}"
            f" UNION ALL SELECT bytes, 0 FROM kv_blocks {where} {reserved_part}) AS counted"
        )
        params = params * (3 if include_reserved else 2)
        with self._lock:
            total, count = self._db.execute(sql, params).fetchone()
        return Usage(total, count)

    def usage_by_tenant(self) -> dict[str, Usage]:
        """Bytes and count of committed archives, for every tenant that has any (bytes as
        `usage` counts them)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT tenant_id, CAST(sum(bytes) AS BIGINT), CAST(sum(n) AS BIGINT) FROM"
                f" (SELECT tenant_id, {STORED_BYTES} AS bytes, 1 AS n FROM archives"
                " UNION ALL SELECT tenant_id, bytes, 0 FROM kv_blocks) AS counted"
                " GROUP BY tenant_id HAVING sum(n) > 0"
            ).fetchall()
        return {tenant_id: Usage(total, count) for tenant_id, total, count in rows}

    def sharing_by_tenant(self) -> dict[str, Sharing]:
        """For every tenant with archives: the bytes its archives would take as whole slot
        files, the bytes of its blocks that more than one of its archives use, and the bytes
        of the whole copies its block archives keep."""
        with self._lock:
            whole = self._db.execute(
                "SELECT tenant_id, CAST(sum(bytes) AS BIGINT),"
                f" CAST(sum({COPY_BYTES}) AS BIGINT) FROM archives GROUP BY tenant_id"
            ).fetchall()
            shared = self._db.execute(
                "SELECT b.tenant_id, CAST(sum(b.bytes) AS BIGINT) FROM kv_blocks b WHERE"
                " (SELECT count(*) FROM archive_kv_blocks r WHERE r.block_id = b.id) > 1"
                " GROUP BY b.tenant_id"
            ).fetchall()
        shared_bytes = dict(shared)
        return {
            tenant_id: Sharing(total, shared_bytes.get(tenant_id, 0), copies)
            for tenant_id, total, copies in whole
        }

    def intact(self, archive: Archive, tokens: Sequence[int]) -> bool:
        """Whether the archive's file is still the one saved: its size, and the tokens in its
        header (a truncated or replaced file would restore less, or someone else's state);
        for an archive kept as blocks, whether it holds `tokens` and each of its blocks' files
        has its size and header (their data are checked as a restore reads them)."""
        with self._lock:
            row = self._db.execute(
                "SELECT coalesce(frame, '') <> '', tokens FROM archives WHERE id = ?",
                [archive.id],
            ).fetchone()
            blocks = (
                []
                if row is None or not row[0]
                else self._db.execute(
                    "SELECT b.id, b.hash, b.n_cells, b.bytes FROM archive_kv_blocks r"
                    " JOIN kv_blocks b ON b.id = r.block_id WHERE r.archive_id = ?",
                    [archive.id],
                ).fetchall()
            )
        packed = pack(token_array(tokens))
        if row is not None and row[0]:
            return bytes(row[1]) == packed and all(
                block_file_holds(self.blocks_directory / block_id, bytes(key), n_cells, size)
                for block_id, key, n_cells, size in blocks
            )
        try:
            size = archive.path.stat().st_size
        except OSError:
            return False
        return size == archive.bytes and file_holds(archive.path, packed)

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

        Their next blocks are in the lookup index's order (`next_tokens`): the furthest reach is
        that of the request's own next block's neighbours there, and the archives reaching as
        far are one range of it, from which the smallest file (then the most recently used)
        is taken. Two probes and one range, however many archives share the blocks.
        """
        wanted = packed_request[depth * BLOCK_BYTES : (depth + 1) * BLOCK_BYTES]
        same_block = "tenant_id = ? AND fingerprint = ? AND hash = ? AND depth = ?"
        params = [tenant_id, fingerprint, hashes[depth - 1], depth]
        # the request's neighbours in that order: the last row not after it, the first after
        neighbours = [
            found
            for (found,) in self._db.execute(
                "SELECT next_tokens FROM (SELECT next_tokens FROM archive_blocks WHERE"
                f" {same_block} AND next_tokens <= ? ORDER BY next_tokens DESC LIMIT 1) AS below"
                " UNION ALL SELECT next_tokens FROM (SELECT next_tokens FROM archive_blocks"
                f" WHERE {same_block} AND next_tokens > ? ORDER BY next_tokens LIMIT 1) AS above",
                [*params, wanted, *params, wanted],
            ).fetchall()
        ]
        request_next = unpack(wanted)
        reach = max(
            (common_prefix_length(unpack(other), request_next) for other in neighbours), default=0
        )
        shared = wanted[: reach * TOKEN_BYTES]
        above = successor(shared)
        # the rows whose next block starts with the `reach` tokens shared: from `shared` on, up
        # to the first string that does not start with it; then, if none has a next block (an
        # older proxy sharing the index wrote them), any row
        in_range = (
            ("AND b.next_tokens >= ?", [shared])
            if above is None
            else ("AND b.next_tokens >= ? AND b.next_tokens < ?", [shared, above])
        )
        for condition, bounds in (in_range, ("", [])):
            best = self._db.execute(
                "SELECT a.id FROM archive_blocks b JOIN archives a ON a.id = b.archive_id"
                " WHERE b.tenant_id = ? AND b.fingerprint = ? AND b.hash = ? AND b.depth = ?"
                f" AND a.tenant_id = ? {condition}"
                " ORDER BY a.bytes, a.last_used DESC, a.id DESC LIMIT 1",
                [*params, tenant_id, *bounds],
            ).fetchone()
            if best is not None:
                break
        return best[0]

    def _contained_archives(
        self, tenant_id: str, fingerprint: str, packed: bytes, hashes: Sequence[bytes]
    ) -> dict[str, str]:
        """The tenant's archives whose tokens are a prefix of `packed`: id -> file name.

        Such an archive's deepest whole block is one of ours (`last_hash`); only the archives
        ending in one of our blocks are read and compared exactly.
        """
        contained: dict[str, str] = {}
        for first in range(0, len(hashes), SQL_PARAMS_PER_QUERY):
            chunk = hashes[first : first + SQL_PARAMS_PER_QUERY]
            # a hash stands for one depth (the chain includes every block before it), so no
            # depth test is needed; the exact comparison below settles the rest
            rows = self._db.execute(
                "SELECT id, file_name, tokens FROM archives WHERE tenant_id = ?"
                f" AND fingerprint = ? AND last_hash IN ({', '.join('?' * len(chunk))})"
                " AND n_tokens <= ?",
                [tenant_id, fingerprint, *chunk, len(packed) // 4],
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
    what the admin API and the CLI answer. Per tenant: `unique_bytes`, what its archives hold
    on disk, each block once (what its quota counts); `shared_bytes`, the part of it more than
    one archive uses; `whole_bytes`, what they would take as whole slot files; `copy_bytes`,
    the whole copies kept beside blocks (the budget counts them, the quota does not)."""
    archives = store.list(tenant_id)
    used = store.usage(tenant_id)
    usage, sharing = store.usage_by_tenant(), store.sharing_by_tenant()
    tenants = {
        tenant: {
            "unique_bytes": figures.bytes,
            "shared_bytes": sharing.get(tenant, Sharing(0, 0)).shared_bytes,
            "whole_bytes": sharing.get(tenant, Sharing(0, 0)).whole_bytes,
            "copy_bytes": sharing.get(tenant, Sharing(0, 0)).copy_bytes,
            "count": figures.count,
        }
        for tenant, figures in sorted(usage.items())
        if tenant_id is None or tenant == tenant_id
    }
    return {
        "archives": [archive_summary(archive) for archive in archives],
        "bytes": used.bytes,
        "count": used.count,
        "budget_bytes": store.budget_bytes,
        "unique_bytes": used.bytes,
        "shared_bytes": sum(figures["shared_bytes"] for figures in tenants.values()),
        "whole_bytes": sum(figures["whole_bytes"] for figures in tenants.values()),
        "copy_bytes": sum(figures["copy_bytes"] for figures in tenants.values()),
        "tenants": tenants,
    }


def successor(prefix: bytes) -> bytes | None:
    """The least byte string greater than every string that starts with `prefix` (None: no
    such string, every string from `prefix` on starts with it)."""
    kept = prefix.rstrip(b"\xff")
    if not kept:
        return None
    return kept[:-1] + bytes([kept[-1] + 1])


def file_holds(path: Path, packed_tokens: bytes) -> bool:
    try:
        header = read_slot_file(path)
    except (OSError, SlotFileError):
        return False
    return pack(header.tokens) == packed_tokens
