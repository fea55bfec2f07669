"""Whether a prompt is computed in chunks, and where the chunks end (pure).

llama-server puts a slot's whole prompt (up to `n_batch` tokens) in one batch and cannot
preempt it: another tenant's prompt arriving meanwhile waits for that whole prompt, then is
computed. So a tenant at or beyond its share of the slots while others are active (the tenant
the one-prompt rule holds back, see slot_share.py) has its prompt computed in chunks: requests
pinned to its slot carrying growing prefixes of the prompt, nothing generated, each about
`scheduling.prefill_chunk_ms` of prefill at the rate the upstream computes prompts; between two
chunks another tenant's prompt may start, and waits for one chunk at most. The original request
then goes out unchanged and computes only the last piece.

A tenant alone, or within its share, is never chunked: chunks cost a round trip each.
"""

from __future__ import annotations

from collections.abc import Mapping

from cacheproxy.slots.slot_share import TenantSlots, fair_shares

# fewer tokens a chunk than this are not worth their round trip, whatever the rate
MIN_CHUNK_TOKENS = 16


def in_chunks(tenant: str, active: Mapping[str, TenantSlots], total: int) -> bool:
    """Whether `tenant`'s next prompt, about to take a slot (not yet counted in `holding`), is
    computed in chunks: others are active and it already holds its share or more."""
    if len(active) <= 1 or tenant not in active:
        return False
    return active[tenant].holding >= fair_shares(active, total)[tenant]


def yields_to(tenant: str, active: Mapping[str, TenantSlots], total: int) -> bool:
    """Whether a chunking `tenant` waits before its next chunk: another tenant within its
    share has a prompt being computed (the next chunk would be computed beside it)."""
    if len(active) <= 1:
        return False
    shares = fair_shares(active, total)
    return any(
        other.prefilling and other.holding <= shares[name]
        for name, other in active.items()
        if name != tenant
    )


def chunk_tokens(ms_per_token: float, chunk_ms: float) -> int | None:
    """Tokens in one chunk of about `chunk_ms` of prefill; None: no rate measured yet, or
    chunking off (`chunk_ms` 0)."""
    if chunk_ms <= 0 or ms_per_token <= 0:
        return None
    return max(MIN_CHUNK_TOKENS, int(chunk_ms / ms_per_token))


def chunk_ends(prompt_length: int, reused: int, tokens: int | None) -> list[int]:
    """The prefix lengths the chunks compute, in order; the original request computes the rest
    (at most `tokens`, at least one). Empty: the prompt left to compute fits in one chunk."""
    if tokens is None or tokens <= 0 or prompt_length - reused <= tokens:
        return []
    return list(range(reused + tokens, prompt_length, tokens))
