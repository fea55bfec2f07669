"""Token ids as the archive index keeps them: packed, and cut into hashed blocks. Pure.

Lookups find the archive sharing the longest prefix with a request through chained hashes of
fixed 64-token blocks (`block_hashes`), so they cost a few index probes, not a scan. The pure
disk policy counts in the same blocks: a restore matches whole blocks only.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

# Tokens per hashed block. The hashes in the index depend on it: changing it needs a migration
# that re-hashes every archive.
BLOCK_TOKENS = 64
TOKEN_BYTES = 4
BLOCK_BYTES = BLOCK_TOKENS * TOKEN_BYTES
# A match shorter than one block is never looked for, so shorter states are not worth a file:
# restoring one would cost more than prefilling it.
MIN_ARCHIVE_TOKENS = BLOCK_TOKENS
HASH_BYTES = 16  # 128-bit chained hashes; a collision is also caught by the exact token check


def block_hashes(packed_tokens: bytes) -> list[bytes]:
    """h_i = blake2b(h_(i-1) || block_i) for every whole block; a partial last block has none.

    Chaining makes each hash stand for the whole prefix up to its block, so one index probe
    answers "does any archive start with these i blocks?".
    """
    view = memoryview(packed_tokens)
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(view) - BLOCK_BYTES + 1, BLOCK_BYTES):
        block_hash = hashlib.blake2b(previous, digest_size=HASH_BYTES)
        block_hash.update(view[start : start + BLOCK_BYTES])
        previous = block_hash.digest()
        hashes.append(previous)
    return hashes


def token_array(tokens: Sequence[int]) -> array:
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens
    try:
        return array("i", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be 32-bit whole numbers: {exc}") from None


def pack(tokens: array) -> bytes:
    """Token ids as stored: int32 little-endian, as in the slot file."""
    if sys.byteorder == "big":
        swapped = array("i", tokens)
        swapped.byteswap()
        return swapped.tobytes()
    return tokens.tobytes()


def unpack(packed: bytes) -> array:
    tokens = array("i", packed)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens
