"""Hints of what a slot holds: hashes of its token ids, which its holder records (never the ids)
so that whoever holds the upstream next can name them from a prompt that starts with them. Pure.

A hint is the hash of all of the ids and the chained hashes of each whole block of them (the
archive index's 64-token blocks and hashes, `disk.blocks`): a prompt whose first `n_tokens`
ids hash to the whole names all of them; else the whole blocks it shares, found by their chained
hashes, name that many.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from cacheproxy.disk.blocks import BLOCK_TOKENS, HASH_BYTES, block_hashes, pack, token_array
from cacheproxy.upstreams.slot_table import SlotHint, SlotState, UpstreamSlots

# a hint's hash of all its ids is told apart from the archive's block hashes
WHOLE_PERSON = b"slot-hint"


def hint_of(tokens: Sequence[int]) -> SlotHint:
    packed = pack(token_array(tokens))
    return SlotHint(len(tokens), _whole(packed), tuple(block_hashes(packed)))


def named_prefix(hint: SlotHint, prompt: Sequence[int]) -> int:
    """How many of the hinted ids `prompt` starts with, as far as the hashes tell: all of them
    when its first `n_tokens` hash to the whole, else a whole number of blocks."""
    n_tokens = hint.n_tokens
    try:
        if len(prompt) >= n_tokens and _whole(pack(token_array(prompt[:n_tokens]))) == hint.whole:
            return n_tokens
        blocks = min(len(prompt), n_tokens) // BLOCK_TOKENS
        if blocks == 0:
            return 0
        ours = block_hashes(pack(token_array(prompt[: blocks * BLOCK_TOKENS])))
    except ValueError:  # ids that are no int32: they name nothing
        return 0
    shared = 0
    for mine, theirs in zip(ours, hint.blocks, strict=False):
        if mine != theirs:
            break
        shared += 1
    return shared * BLOCK_TOKENS


def named_by(
    tables: Sequence[UpstreamSlots], prompt: list[int], tenant: str, open_tenant: str
) -> list[tuple[SlotState, int]]:
    """The idle slots of `tenant`'s own whose ids only a hint tells, each with how many of them
    `prompt` names. A plain loop: asked at every placement, and almost always finds no hint."""
    named = []
    for table in tables:
        for slot in table.slots:
            if slot.hint is None or slot.busy:
                continue
            owner = open_tenant if slot.tenant is None and tenant == open_tenant else slot.tenant
            if owner != tenant:
                continue
            count = named_prefix(slot.hint, prompt)
            if count > len(slot.known):  # names more than the table knows already
                named.append((slot, count))
    return named


def encode_hint(hint: SlotHint) -> bytes:
    """The hint's hashes as one byte string (the whole's first, then the blocks')."""
    return hint.whole + b"".join(hint.blocks)


def decode_hint(n_tokens: int, hashes: bytes) -> SlotHint | None:
    """The hint `encode_hint` wrote; None for none (no tokens), or one that does not add up."""
    blocks = n_tokens // BLOCK_TOKENS
    if n_tokens <= 0 or len(hashes) != HASH_BYTES * (1 + blocks):
        return None
    return SlotHint(
        n_tokens,
        hashes[:HASH_BYTES],
        tuple(
            hashes[start : start + HASH_BYTES]
            for start in range(HASH_BYTES, len(hashes), HASH_BYTES)
        ),
    )


def _whole(packed: bytes) -> bytes:
    return hashlib.blake2b(packed, digest_size=HASH_BYTES, person=WHOLE_PERSON).digest()
