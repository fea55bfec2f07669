"""Archives kept as blocks of KV cells, on real SQLite files (or PostgreSQL: `--database
postgresql`) and real files: a shared prefix stored once, any prefix restored byte for byte,
only what a save adds kept, eviction freeing only what no archive uses, damaged blocks never
restored, recovery from each fault and from SIGKILL at any point of a cut."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import random
import shutil
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheproxy.disk.archive_reads import archive_listing
from cacheproxy.disk.archive_types import RESTORE_NAME_PATTERN, Archive, unlink_files
from cacheproxy.disk.checked_blocks import CheckedBlocks
from cacheproxy.disk.fingerprint import compatibility_fingerprint
from cacheproxy.disk.kv_blocks import (
    BLOCK_HEADER,
    BLOCKS_DIR,
    StoredBlock,
    block_cuts,
    block_file_bytes,
    read_payload,
)
from cacheproxy.disk.kv_frame import KvFrame
from cacheproxy.disk.slot_file import encode_slot_file
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.plugins import load_plugin
from tests.support import databases
from tests.support.mounts import small_tmpfs
from tests.support.slot_files import conversation_state, kv_frame, kv_state, random_tokens

pytestmark = pytest.mark.database

FINGERPRINT = compatibility_fingerprint({"model": "tiny", "n_stream": 2, "blocks": True})
TENANT_A, TENANT_B = "t_aaaa", "t_bbbb"
FRAME = kv_frame(v_trans=True, n_stream=2, stream=1)


class SteppingClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def index_of(root: Path) -> databases.DatabaseTarget:
    return databases.target(
        os.environ.get(databases.ENV_DATABASE_URL), root / "state" / "archive.db"
    )


def open_store(
    root: Path,
    clock: SteppingClock | None = None,
    index: type[ArchiveIndex] = ArchiveIndex,
    **options: object,
) -> ArchiveIndex:
    """The store under `root` (an `index` of that class), cutting archives into blocks;
    keeping no whole copies unless `whole_copies=True` (the tests of blocks restore from
    blocks)."""
    options.setdefault("whole_copies", False)
    return index(
        root / "archive",
        index_of(root),
        load_plugin("eviction", "lru"),
        options.pop("budget_bytes", 10**12),  # type: ignore[arg-type]
        clock=clock or time.time,
        blocks=True,
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ArchiveIndex]:
    with open_store(tmp_path, SteppingClock()) as opened:
        yield opened


def slot_file(tokens: list[int], frame: KvFrame = FRAME) -> bytes:
    return encode_slot_file(tokens, conversation_state(frame, tokens))


def save(
    store: ArchiveIndex,
    tenant: str,
    tokens: list[int],
    *,
    cut: bool = True,
    quota_bytes: int | None = None,
    data: bytes | None = None,
) -> Archive:
    """Reserve, write the file as llama-server would, commit, and cut it into blocks."""
    data = slot_file(tokens) if data is None else data
    reservation = store.reserve(tenant, len(data), quota_bytes, None)
    unlink_files(reservation.paths_to_unlink)
    reservation.path.write_bytes(data)
    committed = store.commit(reservation, tokens, len(data), FINGERPRINT)
    unlink_files(committed.paths_to_unlink)
    if cut:
        store.convert(committed.archive.id)
    archive = store.get(committed.archive.id)
    assert archive is not None
    return archive


def blocks_bytes(tokens: list[int], start: int = 0, end: int | None = None) -> int:
    """What the blocks of `tokens` between those cells take on disk."""
    return sum(
        block_file_bytes(FRAME, cut.n_cells)
        for cut in block_cuts(_array(tokens))
        if cut.start >= start and (end is None or cut.end <= end)
    )


def _array(tokens: list[int]):  # noqa: ANN202
    from cacheproxy.disk.blocks import token_array

    return token_array(tokens)


def block_files(store: ArchiveIndex) -> set[str]:
    return {path.name for path in store.blocks_directory.glob("b_*.kv")}


def restored(store: ArchiveIndex, archive: Archive, n_tokens: int) -> bytes:
    """The bytes of the file a restore of `n_tokens` of the archive hands llama-server."""
    tokens = store.tokens(archive.id)
    assert tokens is not None
    made = store.restore_file(archive, tokens, n_tokens)
    assert made is not None
    path = store.path_for(made.file_name)
    try:
        assert store.checked(made)
        assert RESTORE_NAME_PATTERN.fullmatch(made.file_name)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        return path.read_bytes()
    finally:
        store.release(made)
        assert not path.exists()


# -- sharing and prefixes ----------------------------------------------------------------------


def test_a_shared_head_is_stored_once_and_any_prefix_of_an_archive_restores(
    store: ArchiveIndex,
) -> None:
    head = random_tokens(320, seed=1)  # five whole blocks
    first_tokens, second_tokens = head + random_tokens(100, 2), head + random_tokens(150, 3)
    first = save(store, TENANT_A, first_tokens)
    second = save(store, TENANT_A, second_tokens)

    assert first.blocks and second.blocks
    assert not first.path.exists() and not second.path.exists()  # the whole files are gone
    assert len(block_files(store)) == 5 + 2 + 3
    unique = blocks_bytes(first_tokens) + blocks_bytes(second_tokens, start=320)
    assert store.usage(TENANT_A) == (unique, 2)
    assert store.usage_by_tenant() == {TENANT_A: (unique, 2)}
    [(tenant, sharing)] = store.sharing_by_tenant().items()
    assert tenant == TENANT_A
    assert sharing == (first.bytes + second.bytes, blocks_bytes(head), 0)  # no copies kept
    assert store.intact(first, first_tokens) and not store.intact(first, second_tokens)

    # the whole archive, and any prefix of it: what llama-server wrote, cut there
    for archive, tokens in ((first, first_tokens), (second, second_tokens)):
        assert restored(store, archive, len(tokens)) == slot_file(tokens)
        for n_tokens in (1, 63, 64, 100, 320, 321, len(tokens) - 1):
            assert restored(store, archive, n_tokens) == slot_file(tokens[:n_tokens])


def test_each_save_of_a_growing_conversation_keeps_only_what_it_adds(
    store: ArchiveIndex,
) -> None:
    turns = [random_tokens(300, 4)]
    for seed in (5, 6, 7):
        turns.append(turns[-1] + random_tokens(150, seed))
    archives = [save(store, TENANT_A, turns[0])]
    for previous, tokens in itertools.pairwise(turns):
        reservation = store.reserve(TENANT_A, 10**6, None, None)
        reservation.path.write_bytes(slot_file(tokens))
        committed = store.commit(reservation, tokens, len(slot_file(tokens)), FINGERPRINT)
        # the archive it contains is replaced at once; the blocks both hold stay for it
        assert committed.replaced_ids == (archives[-1].id,)
        unlink_files(committed.paths_to_unlink)
        conversion = store.convert(committed.archive.id)
        assert conversion is not None
        whole_blocks = len(previous) // 64 * 64  # the earlier turn's tail block is not reused
        assert conversion.reused_bytes == blocks_bytes(tokens, end=whole_blocks)
        assert conversion.written_bytes == blocks_bytes(tokens, start=whole_blocks)
        archives.append(store.get(committed.archive.id))  # type: ignore[arg-type]
    # what is kept is the last turn's blocks, each once; nothing else is left in the folder
    assert [archive.id for archive in store.list()] == [archives[-1].id]
    assert store.usage(TENANT_A).bytes == blocks_bytes(turns[-1])
    assert len(block_files(store)) == len(block_cuts(_array(turns[-1])))
    assert restored(store, archives[-1], len(turns[-1])) == slot_file(turns[-1])


def test_a_save_cut_after_a_longer_one_replaced_it_writes_nothing_twice(
    store: ArchiveIndex,
) -> None:
    earlier = random_tokens(400, 8)
    later = earlier + random_tokens(200, 9)
    first = save(store, TENANT_A, earlier)
    second = save(store, TENANT_A, later, cut=False)  # replaces the first before its cut
    assert store.get(first.id) is None and not second.blocks
    # the blocks both hold are named by the new archive, so the first one's leaving kept them
    kept = blocks_bytes(earlier, end=384)
    assert store.usage(TENANT_A).bytes == second.bytes + kept
    conversion = store.convert(second.id)
    assert conversion is not None and conversion.reused_bytes == kept
    assert store.usage(TENANT_A).bytes == blocks_bytes(later)


def test_tenants_never_share_a_block(store: ArchiveIndex) -> None:
    tokens = random_tokens(300, 10)
    mine, theirs = save(store, TENANT_A, tokens), save(store, TENANT_B, tokens)
    assert len(block_files(store)) == 2 * len(block_cuts(_array(tokens)))
    assert store.usage(TENANT_A).bytes == store.usage(TENANT_B).bytes == blocks_bytes(tokens)
    assert store.remove(mine.id)
    assert len(block_files(store)) == len(block_cuts(_array(tokens)))
    assert restored(store, theirs, 300) == slot_file(tokens)


def test_a_state_of_another_layout_stays_a_whole_file(store: ArchiveIndex) -> None:
    tokens = random_tokens(200, 11)
    data = encode_slot_file(tokens, kv_state(2, 1, 200, data_bytes=5000))  # not framed
    archive = save(store, TENANT_A, tokens, data=data, cut=False)
    conversion = store.convert(archive.id)
    assert conversion is not None and conversion.kept_whole is not None
    assert store.convert(archive.id) is None  # looked at once
    assert store.unconverted() == []
    archive = store.get(archive.id)  # type: ignore[assignment]
    assert not archive.blocks and archive.path.read_bytes() == data
    assert store.usage(TENANT_A) == (len(data), 1)
    # restored whole, from its own file lent to the server: the archive keeps it
    made = store.restore_file(archive, tokens, 100)
    assert made is not None and made.file_name == archive.file_name and not made.temporary
    assert (made.n_tokens, made.bytes) == (200, len(data))
    store.release(made)
    assert archive.path.read_bytes() == data


def test_a_whole_file_lent_to_a_restore_outlives_its_cut_until_given_back(
    store: ArchiveIndex,
) -> None:
    tokens = random_tokens(300, 25)
    archive = save(store, TENANT_A, tokens, cut=False)
    lent = store.restore_file(archive, tokens, 200)
    assert lent is not None and lent.file_name == archive.file_name
    conversion = store.convert(archive.id)  # cut while the server reads the file
    assert conversion is not None and store.get(archive.id).blocks  # type: ignore[union-attr]
    assert archive.path.read_bytes() == slot_file(tokens)  # still the server's to read
    assert not store.recover().leftover_files
    store.release(lent)
    assert not archive.path.exists()  # given back: the blocks hold it now
    # a restore asked for after the cut is put together from the blocks
    assert restored(store, archive, 200) == slot_file(tokens[:200])


def test_a_whole_file_lent_to_a_restore_outlives_its_archive_until_given_back(
    tmp_path: Path,
) -> None:
    """An archive dropped while the server is about to read its file (replaced by a longer
    save of its conversation, evicted for room, removed) leaves the file until it is given
    back: llama-server would otherwise find no file, fail the restore and clear the slot."""
    tokens = random_tokens(300, 26)
    size = len(slot_file(tokens))
    with open_store(tmp_path, SteppingClock(), budget_bytes=2 * size) as store:
        replaced = save(store, TENANT_A, tokens, cut=False)
        lent = store.restore_file(replaced, tokens, 200)
        assert lent is not None and not lent.temporary
        longer = save(store, TENANT_A, [*tokens, *random_tokens(20, 27)], cut=False)
        assert store.get(replaced.id) is None  # replaced: its row is gone...
        assert replaced.path.read_bytes() == slot_file(tokens)  # ...its file still lent
        assert not store.recover().leftover_files
        store.release(lent)
        assert not replaced.path.exists()  # given back: removed
        # evicted for room (the oldest), and removed outright, while lent
        evicted = store.restore_file(longer, [*tokens, *random_tokens(20, 27)], 300)
        other = save(store, TENANT_A, random_tokens(300, 28), cut=False)
        assert store.get(longer.id) is None and longer.path.exists()
        removed = store.restore_file(other, random_tokens(300, 28), 300)
        assert store.remove(other.id) and other.path.exists()
        for made, archive in ((evicted, longer), (removed, other)):
            assert made is not None
            store.release(made)
            assert not archive.path.exists()
        assert not store.recover().leftover_files


def test_a_cut_without_room_for_its_blocks_waits_whole_and_cuts_once_there_is(
    tmp_path: Path,
) -> None:
    """A cut needs room for its new blocks beside the whole file until that goes: on a full
    file system the archive stays its whole file (no error, no block file left), and is cut
    once the room is back. A restore put together on a full one is refused, the archive kept."""
    with small_tmpfs(tmp_path / "archive", "2m"), open_store(tmp_path) as store:
        tokens = random_tokens(3600, 12)  # a 600 KB file, its blocks as much
        archive = save(store, TENANT_A, tokens, cut=False)
        filler = tmp_path / "archive" / "other-data"
        filler.write_bytes(bytes(1 << 20))  # what else fills the file system
        assert store.convert(archive.id) is None
        assert not store.get(archive.id).blocks  # type: ignore[union-attr]
        assert archive.path.read_bytes() == slot_file(tokens) and not block_files(store)
        assert store.unconverted() == [archive.id]
        assert store.usage(TENANT_A) == (len(slot_file(tokens)), 1)

        filler.unlink()
        conversion = store.convert(archive.id)
        assert conversion is not None and conversion.written_bytes == blocks_bytes(tokens)
        assert store.get(archive.id).blocks and not archive.path.exists()  # type: ignore[union-attr]
        assert store.usage(TENANT_A) == (blocks_bytes(tokens), 1)

        # a restore needs room to be put together too: without it, none (the archive stays)
        free = os.statvfs(filler.parent).f_bavail * os.statvfs(filler.parent).f_frsize
        filler.write_bytes(bytes(free - (64 << 10)))
        assert store.restore_file(archive, tokens, 3000) is None
        assert store.get(archive.id) is not None
        assert not list(filler.parent.glob("r_*.slot"))
        filler.unlink()
        assert restored(store, archive, 3000) == slot_file(tokens[:3000])


# -- room: eviction frees only what no archive uses ------------------------------------------


def test_eviction_frees_the_blocks_no_remaining_archive_uses(tmp_path: Path) -> None:
    clock = SteppingClock()
    with open_store(tmp_path, clock) as store:
        head = random_tokens(640, 12)
        first = save(store, TENANT_A, head + random_tokens(40, 13))
        second = save(store, TENANT_A, head + random_tokens(40, 14))
        other = save(store, TENANT_A, random_tokens(200, 15))
        used = store.usage(TENANT_A).bytes
        # room for a save as large as the shared head: only both archives sharing it free it,
        # though each alone frees only its own tail, and the lone archive frees more than
        # either (the policy, shown what each frees alone, asks for all three)
        quota = used
        need = blocks_bytes(head)
        reservation = store.reserve(TENANT_A, need, quota, None)
        assert set(reservation.evicted_ids) == {first.id, second.id}
        unlink_files(reservation.paths_to_unlink)
        assert store.get(other.id) is not None
        assert store.usage(TENANT_A, include_reserved=True).bytes <= quota
        # the freed blocks' files went with them; the lone archive's stayed
        assert len(block_files(store)) == len(block_cuts(_array(store.tokens(other.id))))  # type: ignore[arg-type]
        store.abort(reservation)


def test_what_a_quota_counts_without_the_archives_leaving_agrees_with_the_rows(
    tmp_path: Path,
) -> None:
    """The bytes kept without some archives (what a save that replaces or evicts them counts
    against a quota or the budget): their whole files go, and the blocks only they use, not
    those another archive still uses, whoever's the others are; against the rows, by brute
    force, for many sets of leaving archives."""
    rng = random.Random(3)
    with open_store(tmp_path, SteppingClock()) as store:
        heads = {
            tenant: random_tokens(200, seed) for tenant, seed in ((TENANT_A, 1), (TENANT_B, 2))
        }
        for number in range(10):
            tenant = rng.choice([TENANT_A, TENANT_B])
            tokens = [*heads[tenant], *random_tokens(rng.choice([10, 70, 150]), 100 + number)]
            save(store, tenant, tokens, cut=rng.random() < 0.8)
        archives = store.list()
        used_by = {archive.id: set(block_ids(tmp_path, archive.id)) for archive in archives}
        sizes = dict(databases.query(index_of(tmp_path), "SELECT id, bytes FROM kv_blocks"))
        owners = dict(databases.query(index_of(tmp_path), "SELECT id, tenant_id FROM kv_blocks"))
        for _ in range(40):
            leaving = rng.sample([a.id for a in archives], rng.randint(1, 4))
            for tenant in (TENANT_A, TENANT_B, None):
                staying = [
                    a for a in archives if a.id not in leaving and tenant in (None, a.tenant_id)
                ]
                kept_blocks = {
                    block
                    for a in archives
                    if a.id not in leaving
                    for block in used_by[a.id]
                    if tenant in (None, owners[block])
                }
                expected = sum(a.bytes for a in staying if not a.blocks) + sum(
                    sizes[block] for block in kept_blocks
                )
                with store._lock:
                    counted = store._stored(tenant, leaving)
                assert counted == (expected, len(staying)), (tenant, leaving)


def block_ids(root: Path, archive_id: str) -> list[str]:
    rows = databases.query(
        index_of(root), f"SELECT block_id FROM archive_kv_blocks WHERE archive_id = '{archive_id}'"
    )
    return [block_id for (block_id,) in rows]


class EvictedWhileCut(ArchiveIndex):
    """An index whose archives are all evicted at the moment a cut has read its whole file and
    asks for room for the blocks it will write: where a save on another thread, evicting for
    its quota, can land (a subclass rather than two threads: the moment is then certain)."""

    def _room_for_blocks(self, sizes):  # noqa: ANN001, ANN202
        for archive in self.list():
            assert self.remove(archive.id)
        return super()._room_for_blocks(sizes)


def test_an_archive_evicted_while_it_is_cut_leaves_no_block_and_no_error(
    tmp_path: Path,
) -> None:
    """The cut reads on from the file it mapped, writes its blocks, finds the archive gone when
    it records them, and removes them: no block file without a row (the index and the folder
    agree with no `recover`), no error (an error turned the whole disk tier off)."""
    tokens = random_tokens(420, 31)
    with open_store(tmp_path, SteppingClock(), EvictedWhileCut, whole_copies=True) as store:
        archive = save(store, TENANT_A, tokens, cut=False)
        assert store.convert(archive.id) is None
        assert store.get(archive.id) is None and not archive.path.exists()
        assert not block_files(store)
        assert store.usage(TENANT_A) == (0, 0)
        report = store.recover()
        assert not (report.orphan_files or report.missing_files or report.leftover_files)


def write_reserved(store: ArchiveIndex, n_bytes: int) -> None:
    """A save of `n_bytes` as llama-server makes it: room reserved (archives evicted for it
    unlinked), then the file written, which raises OSError (ENOSPC) when the room is not
    there. The reservation is given back once the file is written."""
    reservation = store.reserve(TENANT_A, n_bytes, None, None)
    unlink_files(reservation.paths_to_unlink)
    try:
        reservation.path.write_bytes(bytes(n_bytes))
    finally:
        store.abort(reservation)


class SavedWhileCut(ArchiveIndex):
    """An index where a save of `save_bytes` (once set) is written at the moment a cut has
    mapped its whole file and asks for room for its blocks (a subclass, as above: the moment
    is certain)."""

    save_bytes = 0

    def _room_for_blocks(self, sizes):  # noqa: ANN001, ANN202
        if self.save_bytes:
            write_reserved(self, self.save_bytes)
        return super()._room_for_blocks(sizes)


@pytest.mark.parametrize("held_by", ["cut", "restore of its file", "restore from its blocks"])
def test_a_save_counts_no_room_from_evicted_files_a_cut_or_a_restore_still_holds(
    tmp_path: Path, held_by: str
) -> None:
    """An archive's file that a cut has mapped or a restore has lent to the server, or its
    blocks a restore put together from and holds open while it checks them, keep their room on
    disk after the archive is evicted (until unmapped, given back or closed): a save that
    evicts it for room evicts more, so that the server's write finds the room it was promised
    (it failed, and the evicted conversation was not archived, when they counted as freed)."""
    older_tokens, held_tokens = random_tokens(1800, 61), random_tokens(1800, 62)
    with small_tmpfs(tmp_path / "archive", "2m"):
        with open_store(tmp_path, SteppingClock(), SavedWhileCut) as store:
            older = save(store, TENANT_A, older_tokens)  # kept as blocks
            from_blocks = held_by == "restore from its blocks"
            held = save(store, TENANT_A, held_tokens, cut=from_blocks)
            assert store.touch(older.id)  # the held one is now the least recently used
            lent = None
            if held_by != "cut":
                lent = store.restore_file(held, held_tokens, len(held_tokens))
                assert lent is not None and lent.temporary == from_blocks
            filler = tmp_path / "archive" / "other-data"
            stats = os.statvfs(filler.parent)
            free = 100 << 10
            filler.write_bytes(bytes(stats.f_bavail * stats.f_frsize - free))
            # more than the free space, less than it and what the held archive keeps
            save_bytes = free + min(len(slot_file(held_tokens)), blocks_bytes(held_tokens)) // 2
            if lent is None:
                store.save_bytes = save_bytes
                assert store.convert(held.id) is None  # evicted meanwhile: nothing recorded
            else:
                write_reserved(store, save_bytes)
                store.release(lent)
            # both went: what the held archive kept freed nothing when the save was written
            assert store.list() == []
            assert not held.path.exists() and not block_files(store)


def test_a_restore_put_together_takes_no_room_a_save_was_promised(tmp_path: Path) -> None:
    """A file put together from blocks for a restore is made only beside the room reserved for
    saves the server may be writing (else it took that room and the save failed): without
    room, no restore (the request is prefilled, the archive stays); the save is written."""
    tokens = random_tokens(1800, 71)
    with small_tmpfs(tmp_path / "archive", "2m"), open_store(tmp_path) as store:
        archive = save(store, TENANT_A, tokens)  # kept as blocks
        restore_bytes = len(slot_file(tokens))
        save_bytes = 200 << 10
        reservation = store.reserve(TENANT_B, save_bytes, None, None)
        filler = tmp_path / "archive" / "other-data"
        stats = os.statvfs(filler.parent)
        # room for the restore's file, or for the save, not for both
        filler.write_bytes(bytes(stats.f_bavail * stats.f_frsize - save_bytes - restore_bytes // 2))
        assert store.restore_file(archive, tokens, len(tokens)) is None
        assert not list(filler.parent.glob("r_*.slot"))
        reservation.path.write_bytes(bytes(save_bytes))  # as the server writes it
        store.abort(reservation)
        assert restored(store, archive, len(tokens)) == slot_file(tokens)


# -- damage and recovery --------------------------------------------------------------------


def test_a_damaged_block_drops_every_archive_using_it_and_nothing_else(
    store: ArchiveIndex,
) -> None:
    head = random_tokens(256, 16)
    first = save(store, TENANT_A, head + random_tokens(64, 17))
    second = save(store, TENANT_A, head + random_tokens(80, 18))
    other = save(store, TENANT_A, random_tokens(200, 19))
    shared = shared_block(store, first, second)
    path = store.blocks_directory / shared.file_name
    data = bytearray(path.read_bytes())
    data[BLOCK_HEADER.size + 7] ^= 0x40  # one bit of one cell
    path.write_bytes(bytes(data))
    assert store.intact(first, store.tokens(first.id))  # size and header: still the block
    tokens = store.tokens(second.id)
    # the file is put together unchecked, for the server to read while the blocks are checked:
    # what it restored from it is not to be used, and every archive using the block goes
    made = store.restore_file(second, tokens, len(tokens))  # type: ignore[arg-type]
    assert made is not None
    assert not store.checked(made)
    store.release(made)
    assert store.get(first.id) is None and store.get(second.id) is None
    assert [archive.id for archive in store.list()] == [other.id]
    assert len(block_files(store)) == len(block_cuts(_array(store.tokens(other.id))))  # type: ignore[arg-type]
    assert not list(store.directory.glob("r_*.slot"))
    assert restored(store, other, 200) == slot_file(store.tokens(other.id))  # type: ignore[arg-type]


def test_a_block_damaged_after_restores_that_did_not_read_it_is_still_refused(
    tmp_path: Path,
) -> None:
    """Blocks unchanged since they matched are not read again (`checked_blocks`); damage on
    disk moves the file's times, and the restore after it is refused all the same."""
    with open_store(tmp_path, checked_blocks=CheckedBlocks(settle_ns=0)) as store:
        tokens = random_tokens(300, 20)
        archive = save(store, TENANT_A, tokens)
        for path in store.blocks_directory.glob("b_*.kv"):
            os.utime(path, ns=(1, 1))  # older than any write below, whatever the clock's tick
        whole = slot_file(tokens)
        assert restored(store, archive, 300) == whole  # read and checked: remembered
        assert restored(store, archive, 300) == whole  # not read
        path = store.blocks_directory / sorted(block_files(store))[0]
        with open(path, "r+b") as damaged:
            damaged.seek(BLOCK_HEADER.size + 3)
            byte = damaged.read(1)[0]
            damaged.seek(BLOCK_HEADER.size + 3)
            damaged.write(bytes([byte ^ 0x01]))
        made = store.restore_file(archive, tokens, 300)
        assert made is not None
        assert not store.checked(made)
        store.release(made)
        assert store.get(archive.id) is None


def shared_block(store: ArchiveIndex, first: Archive, second: Archive) -> StoredBlock:
    with store._lock:  # the test reads the index as it is
        rows = store._db.execute(
            "SELECT b.id, b.hash, b.n_cells, b.crc, b.bytes FROM archive_kv_blocks r1"
            " JOIN archive_kv_blocks r2 ON r1.block_id = r2.block_id"
            " JOIN kv_blocks b ON b.id = r1.block_id"
            " WHERE r1.archive_id = ? AND r2.archive_id = ? ORDER BY r1.ordinal",
            [first.id, second.id],
        ).fetchall()
    block_id, key, n_cells, crc, size = rows[0]
    return StoredBlock(block_id, bytes(key), n_cells, crc, size)


def test_recovery_mends_every_block_fault(tmp_path: Path) -> None:
    clock = SteppingClock()
    with open_store(tmp_path, clock) as store:
        head = random_tokens(128, 20)
        kept = save(store, TENANT_A, random_tokens(200, 21))
        first = save(store, TENANT_A, head + random_tokens(70, 22))
        second = save(store, TENANT_A, head + random_tokens(90, 23))
        lost = shared_block(store, first, second)
        (store.blocks_directory / lost.file_name).unlink()
        # a cut killed before its transaction: a block file no row names
        orphan = store.blocks_directory / f"b_{'1' * 32}.kv"
        shutil.copyfile(store.blocks_directory / next(iter(block_files(store))), orphan)
        # a cut killed after it: the whole file of an archive kept as blocks
        leftover = kept.path
        leftover.write_bytes(slot_file(store.tokens(kept.id)))  # type: ignore[arg-type]
        # a restore killed before it gave its file back; another still lent to the server
        forgotten = store.path_for(f"r_{'2' * 32}.slot")
        forgotten.write_bytes(b"a restore file")
        tokens = store.tokens(kept.id)
        lent = store.restore_file(kept, tokens, 100)  # type: ignore[arg-type]
        assert lent is not None

        report = store.recover()

        assert report.damaged_blocks == [lost.file_name]
        assert sorted(report.damaged_files) == sorted([first.id, second.id])
        assert report.orphan_blocks == [orphan.name]
        assert sorted(report.leftover_files) == sorted([leftover.name, forgotten.name])
        assert not report.orphan_files and not report.missing_files
        assert [archive.id for archive in store.list()] == [kept.id]
        assert not leftover.exists() and not forgotten.exists()
        # a block file without a row is kept aside, never deleted: the index may be what was lost
        assert (store.quarantine_directory / BLOCKS_DIR / orphan.name).exists()
        assert store.path_for(lent.file_name).exists()  # still the server's to read
        store.release(lent)
        assert not store.recover().changed
        assert restored(store, kept, 200) == slot_file(tokens)  # type: ignore[arg-type]
    audit(tmp_path)


def test_blocks_a_lost_index_sent_to_quarantine_come_back_with_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the index is lost and restored as a copy of its file: on SQLite whichever backend the
    # run is for (PostgreSQL's loss and recovery are test_archive's lost-index tests)
    monkeypatch.delenv(databases.ENV_DATABASE_URL, raising=False)
    database = Path(index_of(tmp_path))
    with open_store(tmp_path, SteppingClock()) as store:
        tokens = random_tokens(300, 24)
        archive = save(store, TENANT_A, tokens)
        blocks = block_files(store)
    backup = tmp_path / "backup.db"
    shutil.copyfile(database, backup)
    database.unlink()
    with open_store(tmp_path, SteppingClock()) as store:  # a new, empty index
        report = store.recover()
        assert sorted(report.orphan_blocks) == sorted(blocks)  # none deleted
        assert block_files(store) == set()
    shutil.copyfile(backup, database)
    with open_store(tmp_path, SteppingClock()) as store:
        report = store.recover()
        assert not report.damaged_blocks and not report.damaged_files
        assert block_files(store) == blocks
        assert restored(store, archive, 300) == slot_file(tokens)


# -- whole copies --------------------------------------------------------------------------------


def copy_kept(store: ArchiveIndex, archive: Archive) -> bool:
    """Whether the archive is still there and keeps its whole copy."""
    now = store.get(archive.id)
    return now is not None and now.whole_copy


def test_a_cut_keeps_the_whole_file_as_a_copy_that_a_restore_may_read_instead(
    tmp_path: Path,
) -> None:
    tokens = random_tokens(300, 40)
    with open_store(tmp_path, SteppingClock(), whole_copies=True) as store:
        archive = save(store, TENANT_A, tokens, cut=False)
        conversion = store.convert(archive.id)
        assert conversion is not None and conversion.whole_copy
        archive = store.get(archive.id)  # type: ignore[assignment]
        assert archive.blocks and copy_kept(store, archive)
        assert archive.path.read_bytes() == slot_file(tokens)
        # the tenant's quota counts its blocks, not the copy; the listings show the copy
        assert store.usage(TENANT_A) == (blocks_bytes(tokens), 1)
        assert store.sharing_by_tenant()[TENANT_A].copy_bytes == archive.bytes
        listing = archive_listing(store)
        assert listing["copy_bytes"] == listing["tenants"][TENANT_A]["copy_bytes"] == archive.bytes
        assert listing["archives"][0]["whole_copy"] is True
        # asked for (where the disk tier finds it costs less to read): lent whole, and kept;
        # otherwise any prefix is put together from the blocks
        for n_tokens in (300, 120):
            made = store.restore_file(archive, tokens, n_tokens, True)
            assert made is not None and not made.temporary
            assert (made.file_name, made.n_tokens, made.bytes) == (
                archive.file_name,
                300,
                archive.bytes,
            )
            assert not store.recover().leftover_files  # lent: recovery leaves it alone
            store.release(made)
            assert archive.path.read_bytes() == slot_file(tokens)
        assert restored(store, archive, 300) == slot_file(tokens)
        assert restored(store, archive, 119) == slot_file(tokens[:119])
        # the archive leaving takes its copy with it
        assert store.remove(archive.id)
        assert not archive.path.exists() and block_files(store) == set()


def test_copies_go_least_recently_used_first_before_any_archive_leaves_for_room(
    tmp_path: Path,
) -> None:
    """A copy counts against the global budget, so room for a save is made by dropping copies
    (the least recently used first) and only then by evicting archives."""
    first_tokens, second_tokens = random_tokens(300, 41), random_tokens(300, 42)
    third_tokens = random_tokens(250, 43)
    size = len(slot_file(first_tokens))
    held = blocks_bytes(first_tokens) + blocks_bytes(second_tokens)
    clock = SteppingClock()
    # both archives' blocks and both copies, and not a byte more
    with open_store(tmp_path, clock, whole_copies=True, budget_bytes=held + 2 * size) as store:
        first = save(store, TENANT_A, first_tokens)
        second = save(store, TENANT_A, second_tokens)
        assert copy_kept(store, first) and copy_kept(store, second)
        assert store.touch(first.id)  # used since: the second's copy is now the older
        third = save(store, TENANT_A, third_tokens, cut=False)
        assert not copy_kept(store, second) and not second.path.exists()
        assert copy_kept(store, first) and first.path.exists()
        assert {archive.id for archive in store.list()} == {first.id, second.id, third.id}
        # cut, the third keeps its copy in the room the older copy left: the first's goes
        conversion = store.convert(third.id)
        assert conversion is not None and conversion.whole_copy
        assert not copy_kept(store, first) and not first.path.exists()
        assert len(store.list()) == 3  # no archive left for a copy
        assert restored(store, first, 300) == slot_file(first_tokens)  # from its blocks
        # a save the copies cannot make room for evicts archives, the copy gone first
        fourth = save(store, TENANT_A, random_tokens(600, 44), cut=False)
        assert not third.path.exists() and store.get(fourth.id) is not None
        assert store.get(second.id) is None  # the least recently used archive


def test_a_copy_is_kept_only_while_the_budget_has_room_for_it(tmp_path: Path) -> None:
    tokens = random_tokens(300, 45)
    # its whole file fits, then its blocks, but not the copy beside them
    budget = len(slot_file(tokens)) + 100
    assert blocks_bytes(tokens) < budget < blocks_bytes(tokens) + len(slot_file(tokens))
    with open_store(tmp_path, SteppingClock(), whole_copies=True, budget_bytes=budget) as store:
        archive = save(store, TENANT_A, tokens)
        assert archive.blocks and not copy_kept(store, archive) and not archive.path.exists()
        assert restored(store, archive, 300) == slot_file(tokens)


def test_a_damaged_or_missing_copy_is_dropped_and_its_archive_restored_from_its_blocks(
    tmp_path: Path,
) -> None:
    kept, truncated, deleted, at_restore = (random_tokens(300, seed) for seed in range(46, 50))
    with open_store(tmp_path, SteppingClock(), whole_copies=True) as store:
        archives = [save(store, TENANT_A, tokens) for tokens in (kept, truncated, deleted)]
        with archives[1].path.open("r+b") as file:
            file.truncate(archives[1].bytes - 1)
        archives[2].path.unlink()
        report = store.recover()
        assert report.leftover_files == [archives[1].file_name]
        assert not report.damaged_files and not report.missing_files and not report.orphan_files
        assert [copy_kept(store, archive) for archive in archives] == [True, False, False]
        assert archives[0].path.read_bytes() == slot_file(kept)
        assert not archives[1].path.exists()
        for archive, tokens in zip(archives, (kept, truncated, deleted), strict=True):
            assert store.get(archive.id) is not None  # every archive stays
            if archive is not archives[0]:
                assert restored(store, archive, 300) == slot_file(tokens)
        # a copy found damaged as a restore lends it: dropped, the file put together instead
        archive = save(store, TENANT_A, at_restore)
        archive.path.write_bytes(slot_file(random_tokens(300, 50)))  # another state's file
        made = store.restore_file(archive, at_restore, 300, True)
        assert made is not None and made.temporary  # put together from the blocks instead
        store.release(made)
        assert restored(store, archive, 300) == slot_file(at_restore)
        assert not copy_kept(store, archive) and not archive.path.exists()
    audit(tmp_path)


def test_a_copy_lent_to_a_restore_outlives_its_drop_until_given_back(tmp_path: Path) -> None:
    tokens = random_tokens(300, 51)
    size = len(slot_file(tokens))
    budget = blocks_bytes(tokens) + size + size // 2
    with open_store(tmp_path, SteppingClock(), whole_copies=True, budget_bytes=budget) as store:
        archive = save(store, TENANT_A, tokens)
        lent = store.restore_file(archive, tokens, 300, True)
        assert lent is not None and lent.file_name == archive.file_name
        # a save needing room drops the copy while the server reads it
        reservation = store.reserve(TENANT_A, size // 2 + 1, None, None)
        unlink_files(reservation.paths_to_unlink)
        assert not copy_kept(store, archive) and reservation.evicted_ids == ()
        assert archive.path.read_bytes() == slot_file(tokens)  # still the server's to read
        store.release(lent)
        assert not archive.path.exists()
        store.abort(reservation)


@pytest.mark.parametrize("lent", [False, True], ids=["copy-idle", "copy-lent"])
def test_a_cut_short_of_disk_room_drops_copies_for_it_as_a_save_does(
    tmp_path: Path, lent: bool
) -> None:
    """A cut whose new blocks the file system cannot hold beside the whole file drops whole
    copies (least recently used first) for them, as a save does, and waits where that frees
    too little: a copy lent to a restore frees its bytes only once the server gives it back."""
    first_tokens, second_tokens = random_tokens(1200, 52), random_tokens(1200, 53)
    with small_tmpfs(tmp_path / "archive", "2m"):
        with open_store(tmp_path, SteppingClock(), whole_copies=True) as store:
            first = save(store, TENANT_A, first_tokens)
            assert copy_kept(store, first)
            second = save(store, TENANT_A, second_tokens, cut=False)
            filler = tmp_path / "archive" / "other-data"
            stats = os.statvfs(filler.parent)
            # room for half of the second's blocks: the first's copy is worth twice that
            filler.write_bytes(
                bytes(stats.f_bavail * stats.f_frsize - blocks_bytes(second_tokens) // 2)
            )
            if lent:
                lent_copy = store.restore_file(first, first_tokens, 1200, True)
                assert lent_copy is not None and lent_copy.file_name == first.file_name
                assert store.convert(second.id) is None  # dropped, the copy frees nothing yet
                assert not store.get(second.id).blocks  # type: ignore[union-attr]
                assert not copy_kept(store, first) and first.path.exists()
                store.release(lent_copy)
            conversion = store.convert(second.id)
            assert conversion is not None and conversion.written_bytes == blocks_bytes(
                second_tokens
            )
            assert not copy_kept(store, first) and not first.path.exists()
            assert {archive.id for archive in store.list()} == {first.id, second.id}  # none left
            filler.unlink()
            assert restored(store, first, 1200) == slot_file(first_tokens)  # from its blocks
            assert restored(store, second, 1200) == slot_file(second_tokens)
        audit(tmp_path)


def audit(root: Path) -> None:
    """Index and folder agree: every block row's file is there and holds its block, every
    block archive's blocks cover its tokens in order, every whole archive has its file, and
    no block file, restore file or reservation is left without its row."""
    with open_store(root) as store:
        directory = store.directory
        with store._lock:  # read the index as it is
            blocks = {
                row[0]: StoredBlock(row[0], bytes(row[1]), row[2], row[3], row[4])
                for row in store._db.execute(
                    "SELECT id, hash, n_cells, crc, bytes FROM kv_blocks"
                ).fetchall()
            }
            refs = store._db.execute(
                "SELECT archive_id, ordinal, block_id FROM archive_kv_blocks"
                " ORDER BY archive_id, ordinal"
            ).fetchall()
            reservations = store._db.execute("SELECT count(*) FROM reservations").fetchone()[0]
            copies = {
                archive_id
                for (archive_id,) in store._db.execute(
                    "SELECT id FROM archives WHERE whole_copy <> 0"
                ).fetchall()
            }
        assert reservations == 0
        assert block_files(store) == set(blocks)
        assert not list(directory.glob("r_*.slot"))
        for block in blocks.values():
            read_payload(store.blocks_directory, block, FRAME)  # size, header, checksum
        by_archive: dict[str, list[tuple[int, str]]] = {}
        for archive_id, ordinal, block_id in refs:
            by_archive.setdefault(archive_id, []).append((ordinal, block_id))
        assert {block for _, _, block in refs} == set(blocks)  # no block without an archive
        for archive in store.list():
            tokens = store.tokens(archive.id)
            assert tokens is not None
            if not archive.blocks:
                assert archive.path.stat().st_size == archive.bytes
                continue
            if archive.id in copies:  # kept beside its blocks: the file the server wrote
                assert archive.path.read_bytes() == slot_file(tokens)
            else:
                assert not archive.path.exists()
            held = by_archive[archive.id]
            assert [ordinal for ordinal, _ in held] == list(range(len(held)))
            cuts = block_cuts(_array(tokens))
            assert [(blocks[b].key, blocks[b].n_cells) for _, b in held] == [
                (cut.key, cut.n_cells) for cut in cuts
            ]
            assert restored(store, archive, len(tokens)) == slot_file(tokens)


CRASH_HEAD = random_tokens(192, 30)
CRASH_TOKENS = {
    "first": CRASH_HEAD + random_tokens(100, 31),
    "second": CRASH_HEAD + random_tokens(150, 32),
}


def cut_and_die(root: Path, point: str) -> None:
    """Save two conversations sharing a head, cut the first, and die by SIGKILL at `point` of
    cutting the second."""
    import cacheproxy.disk.archive_blocks as archive_blocks

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    real_write, real_sync = archive_blocks.write_block, archive_blocks.sync_directory
    with open_store(root) as store:
        save(store, TENANT_A, CRASH_TOKENS["first"])
        second = save(store, TENANT_A, CRASH_TOKENS["second"], cut=False)
        if point == "between blocks":
            written: list[object] = []

            def write_then_die(*args: object) -> object:
                written.append(real_write(*args))  # type: ignore[arg-type]
                if len(written) == 2:
                    die()
                return written[-1]

            archive_blocks.write_block = write_then_die  # type: ignore[assignment]
        elif point == "blocks synced, no row yet":
            archive_blocks.sync_directory = lambda folder: (real_sync(folder), die())  # type: ignore[assignment]
        else:  # "rows committed, whole file kept"
            archive_blocks.unlink_files = lambda paths: die()  # type: ignore[assignment]
        store.convert(second.id)
    raise AssertionError("the cut finished")


@pytest.mark.parametrize(
    "point", ["between blocks", "blocks synced, no row yet", "rows committed, whole file kept"]
)
def test_sigkill_between_blocks_and_index_leaves_a_consistent_store(
    tmp_path: Path, point: str
) -> None:
    worker = multiprocessing.get_context("fork").Process(target=cut_and_die, args=(tmp_path, point))
    worker.start()
    worker.join()
    assert worker.exitcode == -signal.SIGKILL
    with open_store(tmp_path) as store:
        report = store.recover()
        first, second = sorted(store.list(), key=lambda archive: archive.n_tokens)
        assert not report.damaged_blocks and not report.damaged_files
        if point == "rows committed, whole file kept":
            assert report.leftover_files == [second.file_name] and not report.orphan_blocks
            assert second.blocks and not second.path.exists()
        else:
            # the blocks no row names are kept aside; the archive is still its whole file
            assert report.orphan_blocks and not report.leftover_files
            assert not second.blocks
            assert second.path.read_bytes() == slot_file(CRASH_TOKENS["second"])
        # the head's blocks stay while the second uses them (named as its own when it was
        # saved), whoever else leaves
        assert store.remove(first.id)
        audit(tmp_path)
        conversion = store.convert(second.id)
        if point == "rows committed, whole file kept":
            assert conversion is None  # cut already
        else:
            assert conversion is not None
            assert conversion.reused_bytes == blocks_bytes(CRASH_HEAD)
        tokens = CRASH_TOKENS["second"]
        second = store.get(second.id)  # type: ignore[assignment]
        assert restored(store, second, len(tokens)) == slot_file(tokens)
        assert restored(store, second, 100) == slot_file(tokens[:100])
    audit(tmp_path)


# with whole copies, a budget of a few archives: copies are dropped for room, archives evicted
COPIES_BUDGET = 6 * len(slot_file(random_tokens(492, 1)))


def cut_forever(root: Path, seed: int, copies: bool) -> None:
    """Save and cut conversations that share heads and grow, and drop some, without end."""
    rng = random.Random(seed)
    heads = [random_tokens(192, 100 + index) for index in range(2)]
    budget = COPIES_BUDGET if copies else 10**12
    with open_store(root, whole_copies=copies, budget_bytes=budget) as store:
        while True:
            tokens = rng.choice(heads) + [rng.randrange(32000) for _ in range(rng.randint(1, 300))]
            archive = save(store, TENANT_A, tokens, cut=rng.random() < 0.8)
            if rng.random() < 0.2:
                store.remove(archive.id)
            archives = store.list()
            if archives and rng.random() < 0.5:
                victim = rng.choice(archives)
                tokens = store.tokens(victim.id)
                with contextlib.suppress(TypeError):
                    made = store.restore_file(victim, tokens, rng.randint(1, len(tokens)))  # type: ignore[arg-type]
                    if made is not None and rng.random() < 0.7:
                        store.release(made)


@pytest.mark.parametrize("copies", [False, True], ids=["blocks", "whole copies"])
def test_sigkill_at_any_point_of_cutting_leaves_index_and_blocks_consistent(
    tmp_path: Path, copies: bool
) -> None:
    open_store(tmp_path).close()
    context = multiprocessing.get_context("fork")
    rng = random.Random(7)
    mended = 0
    for round_number in range(8):
        worker = context.Process(target=cut_forever, args=(tmp_path, round_number, copies))
        worker.start()
        time.sleep(rng.uniform(0.3, 0.9))
        os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
        worker.join()
        assert worker.exitcode == -signal.SIGKILL
        with open_store(tmp_path) as store:
            report = store.recover()
            assert not report.damaged_blocks and not report.missing_files
            mended += bool(report.orphan_blocks or report.leftover_files)
        audit(tmp_path)
    # the kills did land in the middle of cuts and restores (the loop is mostly there)
    assert mended > 0
