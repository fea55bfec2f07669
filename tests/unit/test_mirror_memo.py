"""The token mirror's memo: bounded by the bytes its entries really take, not by their count."""

from __future__ import annotations

import hashlib
import sys
import threading

import orjson
import pytest

from cacheproxy.slots import token_memo
from cacheproxy.slots.token_memo import HASH_OFF_LOOP_BYTES, MemoKeys, MemoOfTokens

MIB = 1 << 20


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def test_memo_stays_within_its_byte_budget() -> None:
    memo = MemoOfTokens(max_bytes=4 * MIB)
    prompt = list(range(1000, 1000 + 250_000))  # ~1 MB as int32, ~10 MB as a list of ints
    for n in range(10):
        memo.put(key(n), prompt)
        assert memo.bytes <= 4 * MIB
    assert len(memo) == 4  # each entry counted at its real size: 1 MB and a little more
    assert memo.get(key(0)) is None  # the oldest went first
    assert memo.get(key(9)) == prompt


def test_memo_counts_real_sizes() -> None:
    memo = MemoOfTokens(max_bytes=64 * MIB)
    memo.put(key(1), list(range(100_000)))
    assert 400_000 <= memo.bytes <= 400_000 + 1000
    memo.put(key(1), [1, 2, 3])  # replacing an entry gives its bytes back
    assert memo.bytes < 1000
    assert memo.bytes >= sys.getsizeof(key(1))


def test_memo_keeps_every_int32_as_it_was() -> None:
    """Entries are packed to int32 and back: ids, -1 (a media chunk's), byte offsets up to the
    int32 limit come back as they went in, in order."""
    memo = MemoOfTokens(max_bytes=MIB)
    entry = [0, -1, 1, 255, 256, 65_535, 65_536, 2**31 - 1, -(2**31), 17, 17]
    memo.put(key(1), entry)
    assert memo.get(key(1)) == entry
    assert memo.get(key(1)) is not memo.get(key(1))  # a list of its own for each reader


def test_recently_used_entries_stay() -> None:
    memo = MemoOfTokens(max_bytes=3 * 450_000)
    prompt = list(range(100_000))
    memo.put(key(1), prompt)
    memo.put(key(2), prompt)
    memo.put(key(3), prompt)
    assert memo.get(key(1)) == prompt  # now the most recent
    memo.put(key(4), prompt)
    assert memo.get(key(2)) is None
    assert memo.get(key(1)) == prompt


def test_an_entry_bigger_than_the_budget_is_not_kept() -> None:
    memo = MemoOfTokens(max_bytes=MIB)
    memo.put(key(1), [1, 2, 3])
    memo.put(key(2), list(range(1_000_000)))
    assert memo.get(key(2)) is None
    assert memo.get(key(1)) == [1, 2, 3]  # and it pushed nothing out


async def test_a_big_memo_key_is_hashed_on_a_thread_of_the_mirrors_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed_on: list[str] = []

    def digest(data: bytes) -> bytes:
        hashed_on.append(threading.current_thread().name)
        return hashlib.blake2b(data).digest()

    monkeypatch.setattr(token_memo, "_digest", digest)
    keys = MemoKeys()
    small = ("t", "text", "a prompt")
    big = ("t", "text", "y" * HASH_OFF_LOOP_BYTES)
    for source in (small, big):
        expected = hashlib.blake2b(orjson.dumps(source, option=orjson.OPT_SORT_KEYS)).digest()
        assert await keys.key(source) == expected
    assert hashed_on[0] == threading.current_thread().name  # small: hashed in place
    assert hashed_on[1].startswith("memo-key-hash")
