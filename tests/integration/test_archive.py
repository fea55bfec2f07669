"""The archive store on real SQLite files (or a real PostgreSQL database: `--database
postgresql`) and real slot files: lookups against brute force, tenant
separation, replacement, quotas under threads and 20 processes, recovery from each fault, SIGKILL
in the middle of saving, and a round trip through a real llama-server."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import re
import signal
import sqlite3
import stat
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from cacheproxy.disk.archive_types import (
    FILE_NAME_PATTERN,
    ArchiveError,
    ArchiveFileMismatch,
    ArchiveRefused,
    Committed,
    DiskFull,
    Match,
    QuotaExceeded,
    Reservation,
    ReservationLost,
    new_file_name,
    unlink_files,
)
from cacheproxy.disk.blocks import BLOCK_TOKENS
from cacheproxy.disk.eviction import EvictionCandidate, EvictionPolicy
from cacheproxy.disk.fingerprint import compatibility_fingerprint
from cacheproxy.disk.slot_file import encode_slot_file, read_slot_file
from cacheproxy.disk.store import ArchiveIndex, ArchiveStore
from cacheproxy.plugins import load_plugin
from cacheproxy.tokens import common_prefix_length
from tests.support import databases
from tests.support.mounts import small_tmpfs
from tests.support.servers import StartServer
from tests.support.slot_files import kv_state, post_json, random_tokens

# every test here runs on the chosen database backend (the store's index); the folder is a folder
pytestmark = pytest.mark.database

FINGERPRINT = compatibility_fingerprint({"model": "tiny", "n_stream": 1})
TENANT_A, TENANT_B = "t_aaaa", "t_bbbb"

# the concurrency tests: three tenants, quotas a few states deep, a budget below their sum
TENANTS = ("t_0", "t_1", "t_2")
QUOTA_BYTES = 20_000
QUOTA_ARCHIVES = 4
BUDGET_BYTES = 45_000


class SteppingClock:
    """Wall time that moves one second per reading: every event has its own instant."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def lru() -> EvictionPolicy:
    return load_plugin("eviction", "lru")


def open_store(
    root: Path,
    budget_bytes: int = 10**12,
    clock: SteppingClock | None = None,
    eviction: EvictionPolicy | None = None,
    database: Path | None = None,
) -> ArchiveIndex:
    return ArchiveIndex(
        root / "archive",
        database or index_of(root),
        eviction or lru(),
        budget_bytes,
        clock=clock or time.time,
    )


def index_of(root: Path) -> databases.DatabaseTarget:
    """The test's PostgreSQL database (set for the test, inherited by its processes), or the
    SQLite file under `root`."""
    return databases.target(
        os.environ.get(databases.ENV_DATABASE_URL), root / "state" / "archive.db"
    )


def lose_index(root: Path) -> None:
    """The index gone, its folder kept: the SQLite files deleted, or every PostgreSQL table."""
    where = index_of(root)
    if databases.uses_postgresql(where):
        databases.run(where, "DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        return
    database = Path(where)
    for suffix in ("", "-wal", "-shm"):
        database.with_name(database.name + suffix).unlink(missing_ok=True)


@pytest.fixture
def clock() -> SteppingClock:
    return SteppingClock()


@pytest.fixture
def store(tmp_path: Path, clock: SteppingClock) -> Iterator[ArchiveIndex]:
    with open_store(tmp_path, clock=clock) as opened:
        yield opened


def slot_file_bytes(tokens: Sequence[int], size: int | None = None) -> bytes:
    """A slot file holding `tokens`, zero-padded to `size` bytes (a stand-in for KV data)."""
    data = encode_slot_file(tokens, kv_state(1, 0, len(tokens), data_bytes=16))
    if size is None:
        return data
    assert size >= len(data), f"{len(tokens)} tokens need at least {len(data)} bytes"
    return data + bytes(size - len(data))


async def written(store: ArchiveStore, tokens: Sequence[int]) -> tuple[Reservation, int]:
    """A slot file of `tokens` written into room the store reserved for it (not committed):
    the reservation, and the file's size."""
    data = slot_file_bytes(tokens)
    reservation = await store.reserve(TENANT_A, len(data), None, None)
    reservation.path.write_bytes(data)
    return reservation, len(data)


def save(
    store: ArchiveIndex,
    tenant_id: str,
    tokens: Sequence[int],
    *,
    size: int | None = None,
    quota_bytes: int | None = None,
    quota_archives: int | None = None,
    fingerprint: str = FINGERPRINT,
) -> tuple[Reservation, Committed]:
    """Reserve, write the file as llama-server would, commit, unlink what the store released."""
    data = slot_file_bytes(tokens, size)
    reservation = store.reserve(tenant_id, len(data), quota_bytes, quota_archives)
    unlink_files(reservation.paths_to_unlink)
    reservation.path.write_bytes(data)
    committed = store.commit(reservation, tokens, len(data), fingerprint)
    unlink_files(committed.paths_to_unlink)
    return reservation, committed


def audit(directory: Path, database: databases.DatabaseTarget) -> None:
    """Index and folder agree: every row's file exists at its size and holds its tokens, every
    file of ours has a row, every archive has its block rows, and no reservation is left."""
    rows = databases.query(database, "SELECT id, file_name, bytes, n_tokens, tokens FROM archives")
    reservations = databases.query(database, "SELECT count(*) FROM reservations")[0][0]
    blocks = dict(
        databases.query(database, "SELECT archive_id, count(*) FROM archive_blocks GROUP BY 1")
    )
    files = {
        path.name: path.stat().st_size
        for path in directory.iterdir()
        if FILE_NAME_PATTERN.fullmatch(path.name)
    }
    assert reservations == 0
    assert {file_name: size for _, file_name, size, _, _ in rows} == files
    for archive_id, file_name, _, n_tokens, tokens in rows:
        assert read_slot_file(directory / file_name).tokens.tobytes() == tokens
        assert blocks.get(archive_id, 0) == n_tokens // BLOCK_TOKENS


# -- files, modes, schema ----------------------------------------------------------------------


def test_files_folder_and_database_are_private_and_opaquely_named(
    store: ArchiveIndex, tmp_path: Path
) -> None:
    _, committed = save(store, TENANT_A, random_tokens(100))
    archive = committed.archive
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    if store.database_file is not None:  # a SQLite index; PostgreSQL's files are the server's
        assert stat.S_IMODE(store.database_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(archive.path.stat().st_mode) == 0o600
    assert FILE_NAME_PATTERN.fullmatch(archive.file_name)
    assert TENANT_A not in archive.file_name and archive.path.parent == store.directory
    # reopening migrates nothing twice and sees the same archive
    with open_store(tmp_path) as reopened:
        assert reopened.get(archive.id) == archive


def test_the_fingerprint_ignores_key_order_and_tells_layouts_apart() -> None:
    assert compatibility_fingerprint({"a": 1, "b": "x"}) == compatibility_fingerprint(
        {"b": "x", "a": 1}
    )
    assert compatibility_fingerprint({"n_stream": 1}) != compatibility_fingerprint({"n_stream": 4})


# -- lookups -----------------------------------------------------------------------------------

BOUNDARIES = [63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 400, 511, 512, 513]


def variant(rng: random.Random, bases: Sequence[list[int]]) -> list[int]:
    """A base sequence's first `shared` tokens, then a tail that departs from it at once."""
    base = rng.choice(bases)
    shared = rng.choice(BOUNDARIES)
    tail = [rng.randrange(32000) for _ in range(rng.choice([0, 1, 40, 64, 150]))]
    if tail and tail[0] == base[shared]:
        tail[0] = (tail[0] + 1) % 32000
    return base[:shared] + tail


def test_find_agrees_with_brute_force(store: ArchiveIndex) -> None:
    rng = random.Random(7)
    bases = [random_tokens(700, seed) for seed in range(3)]
    scopes = [(TENANT_A, FINGERPRINT), (TENANT_A, "fp_other"), (TENANT_B, FINGERPRINT)]
    for _ in range(45):
        tenant, fingerprint = rng.choice(scopes)
        save(store, tenant, variant(rng, bases), fingerprint=fingerprint)
    stored = {archive.id: store.tokens(archive.id) for archive in store.list()}
    requests = [variant(rng, bases) for _ in range(120)]
    requests += [tokens[: rng.randint(1, len(tokens))] for tokens in stored.values()]
    requests += [[*tokens, 1, 2, 3] for tokens in stored.values()]

    archives_in = {
        (tenant, fingerprint): [a for a in store.list(tenant) if a.fingerprint == fingerprint]
        for tenant, fingerprint in scopes
    }
    hits = 0
    for request in requests:
        for tenant, fingerprint in scopes:
            in_scope = archives_in[(tenant, fingerprint)]
            best = max(
                (common_prefix_length(stored[archive.id], request) for archive in in_scope),
                default=0,
            )
            match = store.find(tenant, fingerprint, request)
            if best < BLOCK_TOKENS:
                assert match is None
                continue
            hits += 1
            assert match is not None and match.n_common == best
            assert (match.archive.tenant_id, match.archive.fingerprint) == (tenant, fingerprint)
            assert match.tokens == stored[match.archive.id]
            # among equally good archives, the smallest file (cheapest restore)
            sizes = [
                archive.bytes
                for archive in in_scope
                if common_prefix_length(stored[archive.id], request) == best
            ]
            assert match.archive.bytes == min(sizes)
    assert hits > 200  # the comparison was not vacuous


def test_a_save_and_a_lookup_read_no_archives_rows_but_through_an_index(tmp_path: Path) -> None:
    """What a save and a lookup ask of `archives`, `archive_blocks` and `kv_blocks` is found
    through an index (or read from one alone), never by reading every row: behind one system
    prompt every archive of the tenant shares its first blocks, and the rows hold their tokens.
    Checked on SQLite's plan of each statement the store ran (PostgreSQL's planner scans tables
    this small whatever the indexes)."""
    store = open_store(tmp_path, database=tmp_path / "plan.db")
    system = random_tokens(450, 1)
    conversation = [*system, *random_tokens(100, 2)]
    save(store, TENANT_A, conversation, quota_bytes=10**9, quota_archives=100)
    ran: list[str] = []
    # the store's own connection: the statements it runs, their parameters filled in
    store._db._connection.set_trace_callback(ran.append)
    try:
        longer = [*conversation, *random_tokens(100, 3)]
        _, committed = save(store, TENANT_A, longer, quota_bytes=10**9, quota_archives=100)
        match = store.find(TENANT_A, FINGERPRINT, [*system, *random_tokens(100, 4)])
    finally:
        store._db._connection.set_trace_callback(None)
        store.close()
    assert len(committed.replaced_ids) == 1  # the archive it contains was looked for
    assert match is not None and match.n_common == len(system)
    connection = sqlite3.connect(tmp_path / "plan.db")
    try:
        plans = {
            statement: [row[-1] for row in connection.execute(f"EXPLAIN QUERY PLAN {statement}")]
            for statement in ran
            if statement.split()[0].upper() in ("SELECT", "UPDATE", "DELETE")
        }
    finally:
        connection.close()
    read_whole = {
        statement: plan
        for statement, plan in plans.items()
        for step in plan
        if re.match(r"SCAN (archives|archive_blocks|kv_blocks|a|b)\b", step)
        and "COVERING INDEX" not in step
    }
    assert read_whole == {}
    # and the block rows are searched by key, never scanned (even through an index)
    block_reads = [
        step
        for plan in plans.values()
        for step in plan
        if re.match(r"(SEARCH|SCAN) (archive_blocks|b)\b", step)
    ]
    assert block_reads and all(step.startswith("SEARCH") for step in block_reads)


def test_tenants_never_see_each_others_archives(store: ArchiveIndex) -> None:
    tokens = random_tokens(300, seed=1)
    _, committed = save(store, TENANT_A, tokens)

    # the same tenant hits: the other half of the pair makes the miss mean something
    hit = store.find(TENANT_A, FINGERPRINT, [*tokens[:200], 7])
    assert hit is not None and hit.archive.id == committed.archive.id and hit.n_common == 200
    assert store.covering(TENANT_A, FINGERPRINT, tokens[:200]) == committed.archive

    assert store.find(TENANT_B, FINGERPRINT, [*tokens[:200], 7]) is None
    assert store.covering(TENANT_B, FINGERPRINT, tokens[:200]) is None
    assert store.list(TENANT_B) == [] and store.usage(TENANT_B) == (0, 0)

    # B's identical archive neither replaces A's nor is found for A
    _, theirs = save(store, TENANT_B, tokens)
    assert theirs.replaced_ids == ()
    assert {archive.id for archive in store.list()} == {committed.archive.id, theirs.archive.id}
    assert store.find(TENANT_A, FINGERPRINT, tokens).archive.id == committed.archive.id
    assert store.find(TENANT_B, FINGERPRINT, tokens).archive.id == theirs.archive.id
    # another fingerprint (another model or KV layout) matches nothing either
    assert store.find(TENANT_A, "fp_other", tokens) is None


def test_covering_and_replacement_of_contained_archives(store: ArchiveIndex) -> None:
    tokens = random_tokens(200, seed=2)
    _, first = save(store, TENANT_A, tokens)
    first_id = first.archive.id
    assert store.covering(TENANT_A, FINGERPRINT, tokens[:150]).id == first_id
    assert store.covering(TENANT_A, FINGERPRINT, tokens).id == first_id
    assert store.covering(TENANT_A, FINGERPRINT, [*tokens, 5]) is None
    assert store.covering(TENANT_A, FINGERPRINT, tokens[:50]) is None  # below one block

    _, other_fingerprint = save(store, TENANT_A, tokens, fingerprint="fp_other")
    _, diverging = save(store, TENANT_A, tokens[:150] + random_tokens(100, seed=9))
    assert other_fingerprint.replaced_ids == diverging.replaced_ids == ()

    longer_tokens = tokens + random_tokens(60, seed=3)
    _, longer = save(store, TENANT_A, longer_tokens)
    assert longer.replaced_ids == (first_id,)
    assert longer.paths_to_unlink == (first.archive.path,) and not first.archive.path.exists()
    assert store.get(first_id) is None
    assert {archive.id for archive in store.list(TENANT_A)} == {
        other_fingerprint.archive.id,
        diverging.archive.id,
        longer.archive.id,
    }
    assert store.covering(TENANT_A, FINGERPRINT, tokens).id == longer.archive.id

    # saving identical tokens again replaces the older copy too
    _, again = save(store, TENANT_A, longer_tokens)
    assert again.replaced_ids == (longer.archive.id,)
    audit(store.directory, index_of(store.directory.parent))


def test_usage_figures_are_whole_numbers(store: ArchiveIndex) -> None:
    # they go into JSON answers and metrics: PostgreSQL's sum() of BIGINT is a numeric
    # (Decimal in Python), which JSON encoders refuse
    save(store, TENANT_A, random_tokens(100))
    store.reserve(TENANT_B, 1000, None, None)
    figures = [
        *store.usage(),
        *store.usage(include_reserved=True),
        *store.usage_by_tenant()[TENANT_A],
    ]
    assert [type(figure) for figure in figures] == [int] * 6


def test_touch_remove_and_list(store: ArchiveIndex) -> None:
    _, first = save(store, TENANT_A, random_tokens(100, seed=1))
    _, second = save(store, TENANT_B, random_tokens(100, seed=2))
    assert store.touch(first.archive.id)
    touched = store.get(first.archive.id)
    assert touched.hits == 1 and touched.last_used > first.archive.last_used
    assert [archive.id for archive in store.list()] == [first.archive.id, second.archive.id]
    assert store.usage() == (first.archive.bytes + second.archive.bytes, 2)

    assert store.remove(first.archive.id)
    assert not first.archive.path.exists() and store.get(first.archive.id) is None
    assert not store.remove(first.archive.id) and not store.touch(first.archive.id)
    assert store.find(TENANT_A, FINGERPRINT, random_tokens(100, seed=1)) is None
    audit(store.directory, index_of(store.directory.parent))


async def test_the_services_store_runs_every_call_in_its_own_thread(tmp_path: Path) -> None:
    """What the service holds: each call awaits the index in the store's worker thread (never
    the loop's), keeps the index's answers and errors, and closing the store ends its
    threads."""
    loop_thread = threading.current_thread()
    before = set(threading.enumerate())  # other tests' threads may still be ending
    store = await ArchiveStore.open(lambda: open_store(tmp_path))
    threads: set[threading.Thread] = set()

    def fits(path: Path) -> bool:
        threads.add(threading.current_thread())
        return path.exists()

    try:
        tokens = random_tokens(100, seed=1)
        reservation, size = await written(store, tokens)
        committed = await store.commit(reservation, tokens, size, FINGERPRINT)
        match = await store.find(TENANT_A, FINGERPRINT, tokens)
        assert match is not None and match.archive == committed.archive
        [looking_up] = [
            thread
            for thread in set(threading.enumerate()) - before
            if thread.name.startswith("archive-lookups")
        ]
        with pytest.raises(QuotaExceeded, match="no archives"):
            await store.reserve(TENANT_A, size, None, 0)
        assert await store.relabel(FINGERPRINT, "fp_other", fits) == 1
        assert (await store.listing(TENANT_A))["count"] == 1
    finally:
        await store.close()
    [worker] = threads
    assert worker is not loop_thread and worker.name.startswith("archive-store")
    for thread in (worker, looking_up):
        thread.join(timeout=10)
        assert not thread.is_alive()


async def test_archives_are_cut_into_blocks_on_a_thread_at_the_lowest_cpu_priority(
    tmp_path: Path,
) -> None:
    """The cuts are background work: their thread runs at nice 19 (on Linux a thread's own), so
    that the server beside the proxy comes first when the cores are busy; the index's worker
    keeps the process's priority."""
    store = await ArchiveStore.open(lambda: open_store(tmp_path))
    try:
        tokens = random_tokens(100, seed=2)
        reservation, size = await written(store, tokens)
        committed = await store.commit(reservation, tokens, size, FINGERPRINT)
        await store.convert(committed.archive.id)  # started its thread, whatever it cut
        threads = {thread.name.split("_")[0]: thread for thread in threading.enumerate()}
        cutter, worker = threads["archive-blocks"], threads["archive-store"]
        assert cutter.native_id is not None and worker.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, cutter.native_id) == 19
        own = os.getpriority(os.PRIO_PROCESS, os.getpid())
        assert os.getpriority(os.PRIO_PROCESS, worker.native_id) == own
    finally:
        await store.close()


async def test_a_commit_release_or_touch_is_queued_when_called_not_when_awaited(
    tmp_path: Path,
) -> None:
    """A save's commit and a restore's release and touch run beside the request (disk/saves.py,
    disk/restores.py): what the store is asked after the call, even before it is awaited, is
    answered with it done."""
    store = await ArchiveStore.open(lambda: open_store(tmp_path))
    try:
        tokens = random_tokens(100, seed=1)
        reservation, size = await written(store, tokens)
        committing = store.commit(reservation, tokens, size, FINGERPRINT)
        match = await store.find(TENANT_A, FINGERPRINT, tokens)  # asked after, awaited first
        assert match is not None and match.archive == (await committing).archive
        touching = store.touch(match.archive.id)
        [listed] = (await store.listing(TENANT_A))["archives"]
        assert listed["hits"] == 1
        assert await touching
        made = await store.restore_file(match.archive, match.tokens, len(tokens))
        assert made is not None and not made.temporary  # the whole file, lent
        releasing = store.release(made)
        # given back first: the archive's removal then removes its file (a lent one stays)
        assert await store.remove(match.archive.id)
        assert not match.archive.path.exists()
        await releasing
    finally:
        await store.close()


async def test_a_lookup_waits_for_the_commits_asked_before_it_not_for_the_workers_queue(
    tmp_path: Path,
) -> None:
    """A restore's lookup is on its request's path: it runs on a connection and a thread of
    its own while the worker is busy (a touch is held there), and waits only for the
    tenant's own commits asked before it (queued behind the held touch), not another's."""
    store = await ArchiveStore.open(lambda: open_store(tmp_path))
    release = threading.Event()
    try:
        tokens, later = random_tokens(100, seed=1), random_tokens(100, seed=2)
        reservation, size = await written(store, tokens)
        committed = await store.commit(reservation, tokens, size, FINGERPRINT)
        later_reservation, later_size = await written(store, later)
        theirs = slot_file_bytes(later)
        their_reservation = await store.reserve(TENANT_B, len(theirs), None, None)
        their_reservation.path.write_bytes(theirs)
        touch = store.blocking.touch

        def held_touch(archive_id: str) -> bool:
            release.wait(30)
            return touch(archive_id)

        store.blocking.touch = held_touch  # type: ignore[method-assign]
        touching = store.touch(committed.archive.id)
        their_commit = store.commit(their_reservation, later, len(theirs), FINGERPRINT)
        match = await asyncio.wait_for(store.find(TENANT_A, FINGERPRINT, tokens), 30)
        assert match is not None and match.archive == committed.archive
        assert not touching.done()

        committing = store.commit(later_reservation, later, later_size, FINGERPRINT)
        finding = asyncio.ensure_future(store.find(TENANT_A, FINGERPRINT, later))
        await asyncio.wait([finding], timeout=0.5)
        assert not finding.done()  # the commit it waits for cannot run yet
        release.set()
        found = await asyncio.wait_for(finding, 30)
        assert found is not None and found.archive == (await committing).archive
        assert await touching
        assert (await their_commit).archive.tenant_id == TENANT_B
    finally:
        release.set()
        await store.close()


async def test_a_save_looks_up_chooses_and_reserves_in_one_turn_of_the_worker(
    tmp_path: Path,
) -> None:
    """`find_and_reserve`: the lookup's answer goes to the choice, in the store's worker thread,
    and room is reserved only when it chooses a save (a refusal of room is an answer, not an
    error); the eviction path waits for this one turn before the server's save."""
    store = await ArchiveStore.open(lambda: open_store(tmp_path))
    try:
        tokens = random_tokens(200, seed=3)
        reservation, size = await written(store, tokens[:128])
        await store.commit(reservation, tokens[:128], size, FINGERPRINT)
        seen: list[tuple[int | None, str]] = []

        def declines(match: Match | None) -> int | None:
            n_common = None if match is None else match.n_common
            seen.append((n_common, threading.current_thread().name))
            return None

        found = await store.find_and_reserve(TENANT_A, FINGERPRINT, tokens, declines, None, None)
        assert found.match is not None and found.match.n_common == 128
        assert found.reservation is None and found.refused is None
        assert seen[0][0] == 128 and seen[0][1].startswith("archive-store")
        assert store.blocking.usage(include_reserved=True) == store.blocking.usage()

        chosen = await store.find_and_reserve(
            TENANT_A, FINGERPRINT, tokens, lambda match: 4096, None, None
        )
        assert chosen.reservation is not None and chosen.reservation.expected_bytes == 4096
        reserved = store.blocking.usage(include_reserved=True).bytes
        assert reserved == store.blocking.usage().bytes + 4096
        await store.abort(chosen.reservation)

        # one archive is all the tenant may keep: room is refused, the lookup still answered
        refused = await store.find_and_reserve(
            TENANT_A, FINGERPRINT, tokens, lambda match: 4096, None, 0
        )
        assert refused.reservation is None and isinstance(refused.refused, QuotaExceeded)
        assert refused.match is not None and refused.match.n_common == 128
    finally:
        await store.close()


# -- commit checks -----------------------------------------------------------------------------


def nothing_reserved(store: ArchiveIndex) -> bool:
    return store.usage(include_reserved=True) == store.usage()


def test_commit_checks_the_file_and_releases_the_room_when_it_fails(
    store: ArchiveIndex,
) -> None:
    tokens = random_tokens(100)
    data = slot_file_bytes(tokens)

    missing = store.reserve(TENANT_A, len(data), None, None)
    with pytest.raises(ArchiveFileMismatch, match="was not written"):
        store.commit(missing, tokens, len(data), FINGERPRINT)
    assert nothing_reserved(store)

    cases: list[tuple[bytes, Sequence[int] | None, int, type[ArchiveError], str]] = [
        (data, tokens, len(data) + 1, ArchiveFileMismatch, "not the"),
        (data, random_tokens(100, seed=5), len(data), ArchiveFileMismatch, "other tokens"),
        (b"not a slot file at all", tokens, 22, ArchiveFileMismatch, "not a slot file"),
    ]
    short = slot_file_bytes(tokens[:63])
    cases.append((short, None, len(short), ArchiveRefused, "fewer"))
    media_tokens = [*tokens[:10], -1, -1, *tokens[12:]]
    media = encode_slot_file(media_tokens, kv_state(1, 0, 100), media_chunks=[(10, b"img")])
    cases.append((media, None, len(media), ArchiveRefused, "media"))
    for written, claimed, reported, error, message in cases:
        reservation = store.reserve(TENANT_A, len(written), None, None)
        reservation.path.write_bytes(written)
        with pytest.raises(error, match=message):
            store.commit(reservation, claimed, reported, FINGERPRINT)
        assert not reservation.path.exists() and nothing_reserved(store)

    # tokens=None: the file says what the slot held
    reservation = store.reserve(TENANT_A, len(data), None, None)
    reservation.path.write_bytes(data)
    committed = store.commit(reservation, None, len(data), FINGERPRINT)
    assert store.tokens(committed.archive.id) == tokens
    assert nothing_reserved(store)

    aborted = store.reserve(TENANT_A, len(data), None, None)
    aborted.path.write_bytes(data)
    store.abort(aborted)
    assert not aborted.path.exists() and nothing_reserved(store)
    audit(store.directory, index_of(store.directory.parent))


def test_a_commit_after_the_reservation_was_dropped_is_refused(
    store: ArchiveIndex, clock: SteppingClock
) -> None:
    tokens = random_tokens(100)
    data = slot_file_bytes(tokens)
    reservation = store.reserve(TENANT_A, len(data), None, None)
    reservation.path.write_bytes(data)
    clock.now += store.reservation_timeout_s + 1
    assert store.recover().stale_reservations == [reservation.id]
    reservation.path.write_bytes(data)  # the server finished writing after all
    with pytest.raises(ReservationLost):
        store.commit(reservation, tokens, len(data), FINGERPRINT)
    assert not reservation.path.exists() and store.list() == []


# -- quotas and eviction -----------------------------------------------------------------------

SIZE = 3000


def test_a_tenant_quota_evicts_its_least_recently_used_archive(store: ArchiveIndex) -> None:
    archives = [
        save(store, TENANT_A, random_tokens(100, seed), size=SIZE, quota_bytes=3 * SIZE)[1].archive
        for seed in range(3)
    ]
    _, others = save(store, TENANT_B, random_tokens(100, seed=9), size=SIZE)
    store.touch(archives[0].id)

    reservation, committed = save(
        store, TENANT_A, random_tokens(100, seed=3), size=SIZE, quota_bytes=3 * SIZE
    )

    assert reservation.evicted_ids == (archives[1].id,)
    assert reservation.paths_to_unlink == (archives[1].path,) and not archives[1].path.exists()
    assert {archive.id for archive in store.list(TENANT_A)} == {
        archives[0].id,
        archives[2].id,
        committed.archive.id,
    }
    assert store.usage(TENANT_A) == (3 * SIZE, 3)
    assert store.get(others.archive.id) is not None  # another tenant's quota is not ours
    audit(store.directory, index_of(store.directory.parent))


def test_an_archive_count_quota_evicts_too(store: ArchiveIndex) -> None:
    first = save(store, TENANT_A, random_tokens(100, 1), quota_archives=2)[1].archive.id
    second = save(store, TENANT_A, random_tokens(100, 2), quota_archives=2)[1].archive.id
    reservation, third = save(store, TENANT_A, random_tokens(100, 3), quota_archives=2)
    assert reservation.evicted_ids == (first,)
    assert {a.id for a in store.list(TENANT_A)} == {second, third.archive.id}


def test_the_global_budget_evicts_anyones_oldest(tmp_path: Path, clock: SteppingClock) -> None:
    with open_store(tmp_path, budget_bytes=4 * SIZE, clock=clock) as store:
        oldest = save(store, TENANT_B, random_tokens(100, 1), size=SIZE)[1].archive.id
        save(store, TENANT_B, random_tokens(100, 2), size=SIZE)
        save(store, TENANT_A, random_tokens(100, 3), size=SIZE)
        save(store, TENANT_A, random_tokens(100, 4), size=SIZE)
        reservation, _ = save(store, TENANT_A, random_tokens(100, 5), size=SIZE)
        assert reservation.evicted_ids == (oldest,)
        assert store.usage() == (4 * SIZE, 4)
        with pytest.raises(QuotaExceeded, match="global budget"):
            store.reserve(TENANT_A, 4 * SIZE + 1, None, None)


def test_what_cannot_fit_evicts_nothing(store: ArchiveIndex) -> None:
    for seed in range(2):
        save(store, TENANT_A, random_tokens(100, seed), size=SIZE, quota_bytes=2 * SIZE)
    before = store.list()
    with pytest.raises(QuotaExceeded, match="tenant quota"):
        store.reserve(TENANT_A, 2 * SIZE + 1, 2 * SIZE, None)
    with pytest.raises(QuotaExceeded, match="no archives"):
        store.reserve(TENANT_A, SIZE, None, 0)
    assert store.list() == before and nothing_reserved(store)


def test_reservations_count_and_cannot_be_evicted(store: ArchiveIndex) -> None:
    quota = 2 * SIZE
    _, committed = save(store, TENANT_A, random_tokens(100), size=SIZE, quota_bytes=quota)
    first = store.reserve(TENANT_A, SIZE, quota, None)
    assert first.evicted_ids == ()
    second = store.reserve(TENANT_A, SIZE, quota, None)
    assert second.evicted_ids == (committed.archive.id,)
    unlink_files(second.paths_to_unlink)
    with pytest.raises(QuotaExceeded):
        store.reserve(TENANT_A, SIZE, quota, None)  # only reservations left: nothing may go
    assert store.usage(TENANT_A, include_reserved=True) == (2 * SIZE, 2)
    store.abort(first)
    third = store.reserve(TENANT_A, SIZE, quota, None)
    assert store.usage(TENANT_A, include_reserved=True) == (2 * SIZE, 2)
    for reservation in (second, third):
        store.abort(reservation)


def test_a_file_larger_than_reserved_is_checked_again(store: ArchiveIndex) -> None:
    quota = 3 * SIZE
    oldest = save(store, TENANT_A, random_tokens(100, 1), size=SIZE, quota_bytes=quota)[1]
    save(store, TENANT_A, random_tokens(100, 2), size=SIZE, quota_bytes=quota)

    reservation = store.reserve(TENANT_A, SIZE, quota, None)
    reservation.path.write_bytes(slot_file_bytes(random_tokens(100, 3), 2 * SIZE))
    committed = store.commit(reservation, random_tokens(100, 3), 2 * SIZE, FINGERPRINT)
    assert committed.evicted_ids == (oldest.archive.id,)
    assert oldest.archive.path in committed.paths_to_unlink
    assert store.usage(TENANT_A) == (3 * SIZE, 2)

    reservation = store.reserve(TENANT_A, SIZE, quota, None)
    reservation.path.write_bytes(slot_file_bytes(random_tokens(100, 4), quota + 1))
    before = store.list()
    with pytest.raises(QuotaExceeded):
        store.commit(reservation, random_tokens(100, 4), quota + 1, FINGERPRINT)
    assert not reservation.path.exists() and nothing_reserved(store)
    assert store.list() == before


class StingyEviction:
    def choose_victims(
        self, candidates: Sequence[EvictionCandidate], bytes_to_free: int, archives_to_free: int
    ) -> list[str]:
        return []


class MadeUpEviction:
    def choose_victims(
        self, candidates: Sequence[EvictionCandidate], bytes_to_free: int, archives_to_free: int
    ) -> list[str]:
        return ["ar_made_up"]


def test_an_eviction_policys_answer_is_checked(tmp_path: Path) -> None:
    with open_store(tmp_path, eviction=StingyEviction()) as store:
        save(store, TENANT_A, random_tokens(100), size=SIZE)
        with pytest.raises(QuotaExceeded, match="policy's choice frees 0 bytes"):
            store.reserve(TENANT_A, SIZE, SIZE, None)
        assert len(store.list()) == 1
    with open_store(tmp_path, eviction=MadeUpEviction()) as store:
        with pytest.raises(ArchiveError, match="unknown or repeated"):
            store.reserve(TENANT_A, SIZE, SIZE, None)
        assert len(store.list()) == 1 and nothing_reserved(store)


# -- quotas under concurrency: threads and processes -------------------------------------------


def check_limits(store: ArchiveIndex) -> None:
    """Committed plus reserved never exceeds a quota or the budget, at any moment we look."""
    for tenant in TENANTS:
        used = store.usage(tenant, include_reserved=True)
        assert used.bytes <= QUOTA_BYTES and used.count <= QUOTA_ARCHIVES, (tenant, used)
    assert store.usage(include_reserved=True).bytes <= BUDGET_BYTES


def saving_loop(store: ArchiveIndex, seed: int, iterations: int) -> None:
    """Random saves for one tenant: sizes, files larger than reserved, aborts, lookups."""
    rng = random.Random(seed)
    tenant = TENANTS[seed % len(TENANTS)]
    # a shared first block per tenant: replacements and lookups happen along the way
    prefix = random_tokens(BLOCK_TOKENS, seed=seed % len(TENANTS))
    for _ in range(iterations):
        tokens = prefix + [rng.randrange(32000) for _ in range(rng.randint(0, 26))]
        natural = len(slot_file_bytes(tokens))
        expected = rng.randint(2000, 9000)
        try:
            reservation = store.reserve(tenant, expected, QUOTA_BYTES, QUOTA_ARCHIVES)
        except QuotaExceeded:
            check_limits(store)
            continue
        check_limits(store)
        unlink_files(reservation.paths_to_unlink)
        actual = expected
        if rng.random() < 0.3:
            actual = rng.randint(max(natural, expected // 2), expected * 3 // 2)
        reservation.path.write_bytes(slot_file_bytes(tokens, actual))
        if rng.random() < 0.1:
            store.abort(reservation)
        else:
            with contextlib.suppress(QuotaExceeded):
                unlink_files(store.commit(reservation, tokens, actual, FINGERPRINT).paths_to_unlink)
        check_limits(store)
        match = store.find(tenant, FINGERPRINT, tokens)
        if match is not None:
            store.touch(match.archive.id)


def saving_process(root: Path, seed: int, iterations: int) -> None:
    with open_store(root, budget_bytes=BUDGET_BYTES) as store:
        saving_loop(store, seed, iterations)


def test_threads_sharing_a_store_never_exceed_a_quota(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def run(store: ArchiveIndex, seed: int) -> None:
        try:
            saving_loop(store, seed, iterations=12)
        except BaseException as exc:
            errors.append(exc)

    with open_store(tmp_path, budget_bytes=BUDGET_BYTES) as store:
        threads = [threading.Thread(target=run, args=(store, seed)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        check_limits(store)
        assert not store.recover().changed
    audit(tmp_path / "archive", index_of(tmp_path))


def test_twenty_processes_never_exceed_a_quota(tmp_path: Path) -> None:
    open_store(tmp_path, budget_bytes=BUDGET_BYTES).close()  # created once, as at start-up
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=saving_process, args=(tmp_path, seed, 12)) for seed in range(20)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    # a worker whose check failed exits non-zero (its assertion is on its stderr)
    assert [worker.exitcode for worker in workers] == [0] * 20
    with open_store(tmp_path, budget_bytes=BUDGET_BYTES) as store:
        check_limits(store)
        assert len(store.list()) > 0
        assert not store.recover().changed
    audit(tmp_path / "archive", index_of(tmp_path))


# -- recovery ----------------------------------------------------------------------------------


def test_recovery_repairs_each_fault(tmp_path: Path, clock: SteppingClock) -> None:
    with open_store(tmp_path, clock=clock) as store:
        kept = save(store, TENANT_A, random_tokens(100, 1))[1].archive
        missing = save(store, TENANT_A, random_tokens(100, 2))[1].archive
        truncated = save(store, TENANT_A, random_tokens(100, 3))[1].archive
        corrupted = save(store, TENANT_A, random_tokens(100, 4))[1].archive
        missing.path.unlink()
        os.truncate(truncated.path, truncated.bytes // 2)
        # same size, other tokens: only the header check sees it
        corrupted.path.write_bytes(slot_file_bytes(random_tokens(100, 5), corrupted.bytes))
        orphan = store.path_for(new_file_name())
        orphan.write_bytes(slot_file_bytes(random_tokens(100, 6)))
        foreign = store.directory / "notes.txt"
        foreign.write_text("not ours")
        stale = store.reserve(TENANT_A, 5000, None, None)
        stale.path.write_bytes(b"half a")
        clock.now += store.reservation_timeout_s + 1

        report = store.recover()

        assert report.stale_reservations == [stale.id]
        assert report.missing_files == [missing.id]
        assert sorted(report.damaged_files) == sorted([truncated.id, corrupted.id])
        assert report.orphan_files == [orphan.name]
        assert report.foreign_files == ["notes.txt"]
        assert [archive.id for archive in store.list()] == [kept.id]
        for path in (stale.path, truncated.path, corrupted.path, orphan):
            assert not path.exists()
        # a file without a row is kept aside, never deleted: the index may be what was lost
        assert (store.quarantine_directory / orphan.name).read_bytes() == slot_file_bytes(
            random_tokens(100, 6)
        )
        assert kept.path.exists() and foreign.exists()
        assert store.usage(include_reserved=True) == (kept.bytes, 1)

        # a save in progress (a live process, within the timeout) is left alone
        live = store.reserve(TENANT_A, 5000, None, None)
        live.path.write_bytes(b"still writing")
        assert not store.recover().changed
        assert live.path.exists() and store.usage(include_reserved=True) == (kept.bytes + 5000, 2)
        store.abort(live)
    audit(tmp_path / "archive", index_of(tmp_path))


def reserve_and_die(root: Path, quota: int) -> None:
    store = open_store(root)
    reservation = store.reserve(TENANT_A, quota, quota, None)
    reservation.path.write_bytes(b"the first bytes of a state")
    os._exit(0)  # no abort, no close: as if killed


def test_a_dead_processs_reservation_is_dropped_without_waiting(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")

    def die_holding_a_reservation() -> None:
        # forked with no connection open here: SQLite connections must not cross a fork
        dying = context.Process(target=reserve_and_die, args=(tmp_path, SIZE))
        dying.start()
        dying.join()

    die_holding_a_reservation()
    with open_store(tmp_path) as store:
        assert store.usage(TENANT_A, include_reserved=True) == (SIZE, 1)
        # reserving drops it on its way: the quota is not held hostage until a restart
        reservation = store.reserve(TENANT_A, SIZE, SIZE, None)
        assert len(reservation.paths_to_unlink) == 1
        assert unlink_files(reservation.paths_to_unlink) == 1
        store.abort(reservation)
    die_holding_a_reservation()
    with open_store(tmp_path) as store:
        report = store.recover()
        assert len(report.stale_reservations) == 1 and not report.orphan_files
    audit(tmp_path / "archive", index_of(tmp_path))


def test_a_reservation_left_by_an_earlier_process_with_this_pid_is_stale(tmp_path: Path) -> None:
    """A restarted proxy may get its predecessor's pid (in a container, often at once): the
    start time the reservation was made with tells this process's saves in progress from the
    dead one's."""
    with open_store(tmp_path) as store:
        own = store.reserve(TENANT_A, SIZE, None, None)
        [(pid, started)] = databases.query(
            index_of(tmp_path), "SELECT pid, pid_started FROM reservations"
        )
        assert pid == os.getpid() and started is not None
        databases.run(
            index_of(tmp_path),
            "INSERT INTO reservations (id, tenant_id, file_name, bytes, pid, pid_started,"
            f" created, host) VALUES ('r_predecessor', '{TENANT_B}', '{new_file_name()}',"
            f" {SIZE}, {pid}, {started - 1}, {time.time()}, '{store.host}')",
        )
        assert store.recover().stale_reservations == ["r_predecessor"]
        assert store.usage(TENANT_A, include_reserved=True) == (SIZE, 1)  # its own stays
        assert store.usage(TENANT_B, include_reserved=True) == (0, 0)
        store.abort(own)


def test_another_hosts_reservation_waits_for_the_timeout(
    tmp_path: Path, clock: SteppingClock
) -> None:
    """Proxies on several hosts share a PostgreSQL index: a pid from another host says nothing
    here, so its saves in progress are dropped by the timeout only, never as a dead process."""
    with open_store(tmp_path, clock=clock) as store:
        own = store.reserve(TENANT_A, SIZE, None, None)
        reserved_by = databases.query(index_of(tmp_path), "SELECT host FROM reservations")
        assert reserved_by == [(store.host,)] and store.host != "another-host"
        store.abort(own)
        dead_pid = subprocess.Popen(["true"])  # a pid no process has here any more
        dead_pid.wait()
        databases.run(
            index_of(tmp_path),
            "INSERT INTO reservations (id, tenant_id, file_name, bytes, pid, pid_started,"
            f" created, host) VALUES ('r_elsewhere', '{TENANT_B}', '{new_file_name()}', {SIZE},"
            f" {dead_pid.pid}, 1, {clock.now}, 'another-host')",
        )
        report = store.recover()
        assert report.stale_reservations == []
        assert store.usage(TENANT_B, include_reserved=True) == (SIZE, 1)
        clock.now += store.reservation_timeout_s + 1
        assert store.recover().stale_reservations == ["r_elsewhere"]


def save_forever(root: Path, seed: int) -> None:
    """Save without end, writing each file in pieces as a server writes a large state."""
    rng = random.Random(seed)
    tenant = TENANTS[seed % len(TENANTS)]
    prefix = random_tokens(BLOCK_TOKENS, seed=seed % 2)
    with open_store(root, budget_bytes=BUDGET_BYTES) as store:
        while True:
            tokens = prefix + [rng.randrange(32000) for _ in range(rng.randint(0, 40))]
            data = slot_file_bytes(tokens, rng.randint(2000, 9000))
            try:
                reservation = store.reserve(tenant, len(data), QUOTA_BYTES, QUOTA_ARCHIVES)
            except QuotaExceeded:
                continue
            unlink_files(reservation.paths_to_unlink)
            with open(reservation.path, "wb") as file:
                for start in range(0, len(data), 1024):
                    file.write(data[start : start + 1024])
                    file.flush()
                    time.sleep(rng.uniform(0, 0.002))
            if rng.random() < 0.1:
                store.abort(reservation)
                continue
            with contextlib.suppress(QuotaExceeded):
                committed = store.commit(reservation, tokens, len(data), FINGERPRINT)
                for path in committed.paths_to_unlink:
                    unlink_files([path])


def test_sigkill_in_the_middle_of_saving_then_recovery(tmp_path: Path) -> None:
    open_store(tmp_path, budget_bytes=BUDGET_BYTES).close()
    context = multiprocessing.get_context("fork")
    rng = random.Random(11)
    stale_reservations = 0
    for round_number in range(6):
        workers = [
            context.Process(target=save_forever, args=(tmp_path, 2 * round_number + index))
            for index in range(2)
        ]
        for worker in workers:
            worker.start()
        time.sleep(rng.uniform(0.15, 0.45))
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)
        for worker in workers:
            worker.join()
        assert [worker.exitcode for worker in workers] == [-signal.SIGKILL] * 2

        with open_store(tmp_path, budget_bytes=BUDGET_BYTES) as store:
            report = store.recover()
            stale_reservations += len(report.stale_reservations)
            assert not report.missing_files and not report.damaged_files
            check_limits(store)
        audit(tmp_path / "archive", index_of(tmp_path))
    # the kills did land in the middle of saves (the loop spends most of its time there)
    assert stale_reservations > 0


def commit_then_die(root: Path, tokens: list[int]) -> None:
    """Save one archive, then die at once (SIGKILL: no close, no checkpoint, no atexit)."""
    store = open_store(root)
    save(store, "t_0", tokens)
    os.kill(os.getpid(), signal.SIGKILL)


def test_an_archive_committed_survives_its_process_killed_right_after(tmp_path: Path) -> None:
    """The SQLite index syncs its write-ahead log at checkpoints, not at every commit
    (`synchronous = NORMAL`): a commit is in the log, in the kernel's page cache, when it
    returns, so a process killed right after loses none (only a power cut may lose the last
    ones, which start-up recovery mends)."""
    tokens = random_tokens(2 * BLOCK_TOKENS, seed=5)
    open_store(tmp_path).close()
    writer = multiprocessing.get_context("fork").Process(
        target=commit_then_die, args=(tmp_path, tokens)
    )
    writer.start()
    writer.join()
    assert writer.exitcode == -signal.SIGKILL
    with open_store(tmp_path) as store:
        if not databases.uses_postgresql(index_of(tmp_path)):
            (synchronous,) = store._db.execute("PRAGMA synchronous").fetchone()
            assert synchronous == 1  # NORMAL: no sync per transaction
        report = store.recover()
        assert not report.missing_files and not report.damaged_files and not report.orphan_files
        match = store.find("t_0", FINGERPRINT, tokens)
        assert match is not None and match.n_common == len(tokens)
    audit(tmp_path / "archive", index_of(tmp_path))


# -- a real llama-server writes and reads the archive's files ----------------------------------


def test_a_real_llama_server_saves_into_a_reservation_and_restores_from_it(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=4096)
    prompt = random_tokens(200, seed=21)
    with ArchiveIndex(server.slot_save_path, index_of(tmp_path), lru(), 10**9) as store:
        completion = post_json(
            server.url + "/completion",
            {
                "prompt": prompt,
                "n_predict": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_tokens": True,
                "id_slot": 0,
            },
        )
        held = (prompt + completion["tokens"])[: completion["tokens_cached"]]
        reservation = store.reserve(TENANT_A, 2_000_000, None, None)
        saved = post_json(server.url + "/slots/0?action=save", {"filename": reservation.file_name})
        committed = store.commit(reservation, held, saved["n_written"], FINGERPRINT)
        assert committed.archive.n_tokens == saved["n_saved"] == len(held)
        assert stat.S_IMODE(committed.archive.path.stat().st_mode) == 0o600

        request = [*prompt, 5, 6, 7]
        match = store.find(TENANT_A, FINGERPRINT, request)
        assert match is not None and match.n_common == 200 and match.tokens == held
        assert store.find(TENANT_B, FINGERPRINT, request) is None

        restored = post_json(
            server.url + "/slots/1?action=restore", {"filename": match.archive.file_name}
        )
        assert restored["n_restored"] == len(match.tokens)
        store.touch(match.archive.id)
        again = post_json(
            server.url + "/completion",
            {"prompt": request, "n_predict": 1, "id_slot": 1, "temperature": 0},
        )
        assert again["timings"]["cache_n"] == 200  # slot 1 never saw the prompt: restored KV


# -- a lost index: quarantine and adoption -------------------------------------------------------


def test_a_lost_index_quarantines_every_file_and_adopt_reindexes_under_quotas(
    tmp_path: Path, clock: SteppingClock
) -> None:
    with open_store(tmp_path, clock=clock) as store:
        saved = [save(store, TENANT_A, random_tokens(100, seed))[1].archive for seed in (1, 2, 3)]
    lose_index(tmp_path)

    with open_store(tmp_path, clock=clock) as store:
        report = store.recover()
        assert report.orphan_files == sorted(archive.file_name for archive in saved)
        quarantined = store.quarantined()
        assert [item.file_name for item in quarantined] == [a.file_name for a in saved]
        assert all(item.n_tokens == 100 and item.problem is None for item in quarantined)
        assert store.list() == []

        # one archive allowed: the second adoption evicts the first, as a save would
        first = store.adopt(saved[0].file_name, TENANT_B, FINGERPRINT, None, 1).archive
        second = store.adopt(saved[1].file_name, TENANT_B, FINGERPRINT, None, 1).archive
        assert [archive.id for archive in store.list()] == [second.id]
        assert not first.path.exists()
        assert store.find(TENANT_B, FINGERPRINT, random_tokens(100, 2)).n_common == 100
        assert store.find(TENANT_A, FINGERPRINT, random_tokens(100, 2)) is None
        assert [item.file_name for item in store.quarantined()] == [saved[2].file_name]
        with pytest.raises(ArchiveError):
            store.adopt(saved[0].file_name, TENANT_B, FINGERPRINT, None, None)  # gone
    audit(tmp_path / "archive", index_of(tmp_path))


def test_saves_make_room_on_the_file_system_not_only_in_the_budget(
    tmp_path: Path, clock: SteppingClock
) -> None:
    # a 256 KiB file system of its own: its free space moves only with this test's files
    with small_tmpfs(tmp_path / "archive", "256k"), open_store(tmp_path, clock=clock) as store:
        store.min_free_bytes = 64 * 1024
        first = save(store, TENANT_A, random_tokens(100, 1), size=100_000)[1].archive
        # 100 kB more and 64 KiB spare do not fit beside the first: the oldest must go
        second = save(store, TENANT_B, random_tokens(100, 2), size=100_000)[1].archive
        assert [archive.id for archive in store.list()] == [second.id]
        assert not first.path.exists()
        # more than evicting everything frees: the save is skipped, nothing is lost
        with pytest.raises(DiskFull):
            store.reserve(TENANT_A, 300_000, None, None)
        assert [archive.id for archive in store.list()] == [second.id]
        assert second.path.exists()
