"""The disk tier's pure decisions: what is worth archiving, and when a restore pays."""

from __future__ import annotations

import pytest

from cacheproxy.disk.policy import Evicted, RestoreCosts, restore_pays, worth_saving
from cacheproxy.disk.store import BLOCK_TOKENS

MIN_TOKENS = 256


@pytest.mark.parametrize(
    ("evicted", "expected"),
    [
        (Evicted(n_tokens=1000, kept=0, owner="t"), True),
        # too short to be worth a file
        (Evicted(n_tokens=MIN_TOKENS - 1, kept=0, owner="t"), False),
        (Evicted(n_tokens=MIN_TOKENS, kept=0, owner="t"), True),
        # the new request keeps all but part of a block: the slot itself still holds the rest
        (Evicted(n_tokens=1000, kept=1000 - BLOCK_TOKENS + 1, owner="t"), False),
        (Evicted(n_tokens=1000, kept=1000 - BLOCK_TOKENS, owner="t"), True),
        # whose text it is is unknown: archiving it under anyone's name could leak it
        (Evicted(n_tokens=1000, kept=0, owner=None), False),
    ],
)
def test_worth_saving(evicted: Evicted, expected: bool) -> None:
    assert worth_saving(evicted, MIN_TOKENS) is expected


COSTS = RestoreCosts(
    prefill_ms_per_token=0.05, restore_bytes_per_ms=1_000_000, restore_overhead_ms=2.0
)


def test_restore_pays_when_reading_beats_prefilling() -> None:
    # 1000 tokens: 50 ms of prefill against 2 ms + 1 ms of reading
    assert restore_pays(1000, 1_000_000, COSTS)
    # the same gain from a file 100x larger (a big model's KV): 102 ms of reading loses
    assert not restore_pays(1000, 100_000_000, COSTS)


def test_restore_never_pays_below_one_block() -> None:
    free_reading = RestoreCosts(
        prefill_ms_per_token=1000.0, restore_bytes_per_ms=1e12, restore_overhead_ms=0.0
    )
    assert not restore_pays(BLOCK_TOKENS - 1, 1, free_reading)
    assert restore_pays(BLOCK_TOKENS, 1, free_reading)


def test_restore_overhead_counts() -> None:
    # 100 tokens save 5 ms of prefill; a 4 ms round trip plus 0.1 ms of reading still pays,
    # a 5 ms one does not
    fast = RestoreCosts(0.05, 1_000_000, 4.0)
    slow = RestoreCosts(0.05, 1_000_000, 5.0)
    assert restore_pays(100, 100_000, fast)
    assert not restore_pays(100, 100_000, slow)
