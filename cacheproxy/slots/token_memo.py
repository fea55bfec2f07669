"""The token mirror's memo: token lists by key, bounded by the bytes they take, and the keys,
digests of what determines a prompt's tokens (each key carries the tenant and the model: one
tenant never finds, nor can time, another's)."""

from __future__ import annotations

import asyncio
import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

MIB = 1 << 20
DEFAULT_MEMO_BYTES = 64 * MIB
MEMO_ENTRY_OVERHEAD = 120  # the OrderedDict's link and slot, the (array, size) tuple
HASH_OFF_LOOP_BYTES = MIB


class MemoOfTokens:
    """Token lists by key, least recently used first out, bounded by the bytes they take.

    Entries are kept as int32 arrays (4 bytes a token, not a list's 8-byte pointer plus a
    32-byte int object), and counted at their real size, key and bookkeeping included.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, tuple[array, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> list[int] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0].tolist()

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def put(self, key: bytes, tokens: list[int]) -> None:
        # packed by struct, then copied in whole: `array("i", tokens)` converts each item
        # through a parsing of its format (some 220 instructions an id, 210 k a chat request
        # by callgrind); the slice copies it into an array of its exact size (one filled from
        # bytes keeps a sixteenth more room for growth)
        stored = array("i", struct.pack(f"{len(tokens)}i", *tokens))[:]
        size = sys.getsizeof(stored) + sys.getsizeof(key) + MEMO_ENTRY_OVERHEAD
        if size > self.max_bytes:
            return  # it would push out everything else, to be used once
        previous = self._entries.pop(key, None)
        if previous is not None:
            self.bytes -= previous[1]
        self._entries[key] = (stored, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted


class MemoKeys:
    """Memo keys: a blake2b digest of what determines a prompt's tokens.

    A key source of `HASH_OFF_LOOP_BYTES` or more is hashed on a thread of the mirror's own
    (hashlib lets go of the GIL on big inputs, so the loop serves on meanwhile): a burst of big
    prompts is hashed one at a time there, and never holds up the worker threads the stores
    hop to. The thread starts with the first big key; it ends when its executor is collected
    with the mirror, as any idle `ThreadPoolExecutor` worker does.
    """

    def __init__(self) -> None:
        self._hashing: ThreadPoolExecutor | None = None

    async def key(self, key_source: Any) -> bytes:
        data = orjson.dumps(key_source, option=orjson.OPT_SORT_KEYS)
        if len(data) < HASH_OFF_LOOP_BYTES:
            return _digest(data)
        if self._hashing is None:
            self._hashing = ThreadPoolExecutor(1, thread_name_prefix="memo-key-hash")
        return await asyncio.get_running_loop().run_in_executor(self._hashing, _digest, data)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data).digest()
