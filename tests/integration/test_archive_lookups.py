"""Lookups through the index's ordered next blocks (`next_tokens`) and last blocks
(`last_hash`): exact against brute force when many archives share a system prompt, and an
index written before those columns upgraded in place.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from cacheproxy.db.connection import Database, connect
from cacheproxy.db.migrations import Migrations
from cacheproxy.disk.archive_schema import MIGRATIONS
from cacheproxy.disk.archive_types import Committed, unlink_files
from cacheproxy.disk.blocks import block_hashes, pack, token_array
from cacheproxy.disk.fingerprint import compatibility_fingerprint
from cacheproxy.disk.slot_file import encode_slot_file
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.plugins import load_plugin
from cacheproxy.tokens import common_prefix_length
from tests.support import databases
from tests.support.slot_files import kv_state, random_tokens

FINGERPRINT = compatibility_fingerprint({"model": "tiny", "n_stream": 1})
TENANT = "t_aaaa"
RELEASED = 5  # the steps released before the lookup columns

pytestmark = pytest.mark.database


def test_an_index_from_before_the_lookup_columns_finds_and_replaces_its_archives(
    tmp_path: Path,
) -> None:
    where = index_of(tmp_path)
    system = random_tokens(450, 1)
    first = [*system, *random_tokens(100, 2)]  # 550 tokens: 8 whole blocks and a tail
    other = [*system, *random_tokens(170, 3)]  # 620 tokens: 9 whole blocks and a tail
    released = Migrations(MIGRATIONS.name)
    released.steps = MIGRATIONS.steps[:RELEASED]
    db = connect(where, busy_timeout_s=5.0, lock_name="archive")
    try:
        released.migrate(db)
        with db.write():
            for number, tokens in enumerate((first, other)):
                insert_as_released(db, f"ar_{number:016x}", tokens)
            # the second was cut into blocks (its frame set, as the released cut set it)
            db.execute("UPDATE archives SET frame = '{}' WHERE id = 'ar_0000000000000001'")
    finally:
        db.close()

    with open_index(tmp_path, where) as index:
        assert MIGRATIONS.applied(index._db) == [step.name for step in MIGRATIONS.steps]
        # the columns are filled in for the archives there were
        packed, hashes = pack(token_array(first)), block_hashes(pack(token_array(first)))
        (last_hash,) = index._db.execute(
            "SELECT last_hash FROM archives WHERE id = 'ar_0000000000000000'"
        ).fetchone()
        nexts = index._db.execute(
            "SELECT depth, next_tokens FROM archive_blocks WHERE archive_id = 'ar_0000000000000000'"
            " ORDER BY depth"
        ).fetchall()
        assert bytes(last_hash) == hashes[-1]
        in_blocks = index._db.execute("SELECT id, in_blocks FROM archives ORDER BY id").fetchall()
        assert in_blocks == [("ar_0000000000000000", 0), ("ar_0000000000000001", 1)]
        assert [(depth, bytes(tokens)) for depth, tokens in nexts] == [
            (depth, packed[depth * 256 : (depth + 1) * 256]) for depth in range(1, 9)
        ]
        # the request continues `first`: its archive, exactly
        match = index.find(TENANT, FINGERPRINT, [*first, *random_tokens(30, 4)])
        assert match is not None and (match.archive.id, match.n_common) == (
            "ar_0000000000000000",
            550,
        )
        # a new conversation shares the system prompt with both: the smaller file wins
        match = index.find(TENANT, FINGERPRINT, [*system, *random_tokens(90, 5)])
        assert match is not None and match.n_common == len(system)
        assert match.archive.id == "ar_0000000000000000"
        # a save that contains `first` replaces it, found through its backfilled last block
        longer = [*first, *random_tokens(80, 6)]
        committed = save(index, longer)
        assert committed.replaced_ids == ("ar_0000000000000000",)
        assert {archive.id for archive in index.list()} == {
            "ar_0000000000000001",
            committed.archive.id,
        }
        # an older proxy sharing the index still writes rows without the lookup columns: its
        # archive is found all the same
        third = [*system, *random_tokens(200, 7)]
        with index._lock, index._db.write():
            insert_as_released(index._db, "ar_0000000000000002", third)
        match = index.find(TENANT, FINGERPRINT, [*third, 1, 2, 3])
        assert match is not None and (match.archive.id, match.n_common) == (
            "ar_0000000000000002",
            650,
        )


def test_many_archives_behind_one_prompt_are_told_apart_exactly(tmp_path: Path) -> None:
    """Archives share a 450-token system prompt and then runs of one another's tokens of every
    length into the next block (ties, and orders of bytes that are not orders of numbers); the
    lookup's archive is the one brute force picks: the longest shared prefix, then the smallest
    file, then the most recently used (most files are of one size here)."""
    rng = random.Random(5)
    system = random_tokens(450, 1)
    trunks = [random_tokens(150, seed) for seed in range(10, 16)]
    clock = iter(range(1_700_000_000, 1_800_000_000))
    with open_index(tmp_path, index_of(tmp_path), clock=lambda: float(next(clock))) as index:
        stored: dict[str, list[int]] = {}
        for _ in range(120):
            tokens = [
                *system,
                *rng.choice(trunks)[: rng.choice([0, 1, 2, 5, 30, 61, 62, 63, 64, 90])],
            ]
            tokens += [
                rng.choice([0, 1, 255, 256, 31999, rng.randrange(32000)])
                for _ in range(rng.randint(0, 70))
            ]
            if len(tokens) >= 64 and tokens not in stored.values():
                committed = save(index, tokens, size=rng.choice([None, 40_000, 40_000]))
                stored[committed.archive.id] = tokens
        for archive_id in rng.sample(sorted(stored), 20):
            index.touch(archive_id)
        archives = {archive.id: archive for archive in index.list()}
        assert len(archives) > 60
        for _ in range(150):
            request = [*system, *rng.choice(trunks)[: rng.randint(0, 100)]]
            request += random_tokens(rng.randint(0, 40), rng.randrange(10**6))
            match = index.find(TENANT, FINGERPRINT, request)
            reach = {
                archive_id: common_prefix_length(tokens, request)
                for archive_id, tokens in stored.items()
                if archive_id in archives
            }
            best = max(reach.values())
            expected = max(
                (archive_id for archive_id, n in reach.items() if n == best),
                key=lambda archive_id: (
                    -archives[archive_id].bytes,
                    archives[archive_id].last_used,
                    archive_id,
                ),
            )
            assert match is not None and (match.archive.id, match.n_common) == (expected, best)


def insert_as_released(db: Database, archive_id: str, tokens: Sequence[int]) -> None:
    """An archive's rows as the released code wrote them (no lookup columns)."""
    packed = pack(token_array(tokens))
    now = time.time()
    db.execute(
        "INSERT INTO archives (id, tenant_id, file_name, fingerprint, n_tokens, bytes, created,"
        " last_used, hits, tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
        [
            archive_id,
            TENANT,
            f"{archive_id}.bin",
            FINGERPRINT,
            len(tokens),
            1000 + len(tokens),
            now,
            now,
            packed,
        ],
    )
    db.executemany(
        "INSERT INTO archive_blocks (archive_id, depth, tenant_id, fingerprint, hash)"
        " VALUES (?, ?, ?, ?, ?)",
        [
            (archive_id, depth, TENANT, FINGERPRINT, block_hash)
            for depth, block_hash in enumerate(block_hashes(packed), start=1)
        ],
    )


def index_of(root: Path) -> databases.DatabaseTarget:
    """The test's PostgreSQL database (under `--database postgresql`), or a SQLite file."""
    (root / "state").mkdir(exist_ok=True)
    return databases.target(
        os.environ.get(databases.ENV_DATABASE_URL), root / "state" / "archive.db"
    )


def open_index(
    root: Path, where: databases.DatabaseTarget, clock: Callable[[], float] = time.time
) -> ArchiveIndex:
    return ArchiveIndex(
        root / "archive", where, load_plugin("eviction", "lru"), 10**12, clock=clock
    )


def save(index: ArchiveIndex, tokens: Sequence[int], size: int | None = None) -> Committed:
    """Reserve, write the file as llama-server would (padded to `size` bytes), commit."""
    data = encode_slot_file(tokens, kv_state(1, 0, len(tokens), data_bytes=16))
    data += bytes(0 if size is None else size - len(data))
    reservation = index.reserve(TENANT, len(data), None, None)
    reservation.path.write_bytes(data)
    committed = index.commit(reservation, tokens, len(data), FINGERPRINT)
    unlink_files(committed.paths_to_unlink)
    return committed
