"""`cacheproxy bench index`: what a save and a lookup cost the archive index as archives grow.

Archives behind one system prompt of `--system` tokens, each with a conversation of its own
(up to `--tail` tokens), are saved one after the other into a real index (a SQLite file, or
the PostgreSQL database `--database-url` names) over a folder of slot files, as the disk tier
saves them: room reserved, the file written, the archive committed (the archives it contains
replaced). At each count of `--at` archives, the median of `--samples` of:

- a save: a conversation's next turn, which contains (and replaces) its archive;
- a lookup of a conversation's next turn: its own archive, exactly;
- a lookup of a new conversation: only the system prompt shared, with every archive (the
  lookup's worst case: every archive shares the request's deepest block).

The index's calls run on this thread, as in the store's worker thread; nothing else runs.
Slot files hold a few bytes of KV data: the figures are the index's, not the disk's. On
PostgreSQL the planner's statistics are refreshed (`ANALYZE`) before each count is measured,
as autovacuum keeps them where an index grows at a server's pace, and the benchmark's
archives (tenant `t_bench`) are removed at the end.

`cacheproxy bench index [--at N ...] [--system N] [--tail N] [--samples N]
[--database-url URL] [--json]`
"""

from __future__ import annotations

import json
import random
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from cacheproxy.bench.harness import BenchmarkError, progress, table_row
from cacheproxy.db.connection import connect
from cacheproxy.disk.archive_types import unlink_files
from cacheproxy.disk.blocks import BLOCK_TOKENS
from cacheproxy.disk.fingerprint import compatibility_fingerprint
from cacheproxy.disk.slot_file import encode_slot_file
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.plugins import load_plugin

TENANT = "t_bench"
FINGERPRINT = compatibility_fingerprint({"bench": "index"})
BUDGET_BYTES = 1 << 40  # nothing is evicted: every archive saved stays
VOCAB = 32000
T = TypeVar("T")
EMPTY_STATE = struct.pack("<II", 1, 0)  # one stream, no cells: the index reads the tokens only


@dataclass(frozen=True)
class IndexBenchConfig:
    at: tuple[int, ...] = (100, 1000, 3000)
    system: int = 450
    tail: int = 600
    samples: int = 25
    seed: int = 1
    database_url: str | None = None


@dataclass(frozen=True)
class IndexFigures:
    archives: int
    save_ms: float
    lookup_next_turn_ms: float
    lookup_new_conversation_ms: float


def run_index_bench(config: IndexBenchConfig, as_json: bool) -> int:
    try:
        figures = measure(config)
    except BenchmarkError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"config": asdict(config), "figures": [asdict(f) for f in figures]}))
        return 0
    print(
        f"# Archive index: {config.system}-token system prompt, conversations of up to"
        f" {config.tail} tokens, median of {config.samples}"
    )
    print()
    print(table_row(["archives", "save ms", "lookup, next turn ms", "lookup, new conversation ms"]))
    print(table_row(["---:"] * 4))
    for row in figures:
        print(
            table_row(
                [
                    str(row.archives),
                    f"{row.save_ms:.2f}",
                    f"{row.lookup_next_turn_ms:.2f}",
                    f"{row.lookup_new_conversation_ms:.2f}",
                ]
            )
        )
    return 0


def measure(config: IndexBenchConfig) -> list[IndexFigures]:
    if not config.at or min(config.at) < 1:
        raise BenchmarkError("--at takes counts of archives of at least 1")
    if config.system < BLOCK_TOKENS or config.tail < BLOCK_TOKENS:
        raise BenchmarkError(f"--system and --tail take at least {BLOCK_TOKENS} tokens")
    rng = random.Random(config.seed)
    system = tokens_of(rng, config.system)
    figures = []
    with tempfile.TemporaryDirectory(prefix="cacheproxy-index-bench-") as folder:
        root = Path(folder)
        database = config.database_url or root / "archive.db"
        with ArchiveIndex(
            root / "archives", database, load_plugin("eviction", "lru"), BUDGET_BYTES
        ) as index:
            conversations: list[list[int]] = []
            try:
                for count in sorted(set(config.at)):
                    while len(conversations) < count:
                        conversation = [*system, *tokens_of(rng, rng.randint(64, config.tail))]
                        save(index, conversation)
                        conversations.append(conversation)
                    progress(f"index bench: {count} archives")
                    if config.database_url:
                        analyze(config.database_url)
                    figures.append(sample(index, config, rng, system, conversations, count))
            finally:
                # a database named by URL outlives the run: its archives leave with their files
                for archive in index.list(TENANT) if config.database_url else ():
                    index.remove(archive.id)
    return figures


def sample(
    index: ArchiveIndex,
    config: IndexBenchConfig,
    rng: random.Random,
    system: list[int],
    conversations: list[list[int]],
    count: int,
) -> IndexFigures:
    saves, next_turns, new_conversations = [], [], []
    for _ in range(config.samples):
        place = rng.randrange(len(conversations))
        turn = [*conversations[place], *tokens_of(rng, 40)]
        elapsed, match = timed(index.find, TENANT, FINGERPRINT, turn)
        next_turns.append(elapsed)
        if match is None or match.tokens != conversations[place]:
            raise BenchmarkError("a conversation's next turn did not find its own archive")
        fresh = [*system, *tokens_of(rng, 100)]
        elapsed, match = timed(index.find, TENANT, FINGERPRINT, fresh)
        new_conversations.append(elapsed)
        if match is None or match.n_common < len(system) // BLOCK_TOKENS * BLOCK_TOKENS:
            raise BenchmarkError("a new conversation did not find the system prompt archived")
        saves.append(timed(save, index, turn)[0])  # replaces its archive: as many stay
        conversations[place] = turn
    if len(index.list(TENANT)) != count:
        raise BenchmarkError(f"the index holds {len(index.list(TENANT))} archives, not {count}")
    return IndexFigures(
        archives=count,
        save_ms=statistics.median(saves),
        lookup_next_turn_ms=statistics.median(next_turns),
        lookup_new_conversation_ms=statistics.median(new_conversations),
    )


def analyze(database_url: str) -> None:
    """PostgreSQL's planner statistics brought up to date, as autovacuum keeps them on an index
    that grows at a server's pace: this one grows by thousands of archives in seconds, and a
    plan made for an empty table reads every row of a full one."""
    db = connect(database_url, busy_timeout_s=10.0, lock_name="archive")
    try:
        db.execute("ANALYZE")
    finally:
        db.close()


def save(index: ArchiveIndex, tokens: Sequence[int]) -> None:
    """What the disk tier does for a save, the server's write made here."""
    data = encode_slot_file(tokens, EMPTY_STATE)
    reservation = index.reserve(TENANT, len(data), None, None)
    unlink_files(reservation.paths_to_unlink)
    reservation.path.write_bytes(data)
    committed = index.commit(reservation, tokens, len(data), FINGERPRINT)
    unlink_files(committed.paths_to_unlink)


def timed(call: Callable[..., T], *args: Any) -> tuple[float, T]:
    """The call's time in ms, and its answer."""
    started = time.perf_counter()
    answer = call(*args)
    return (time.perf_counter() - started) * 1000, answer


def tokens_of(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]
