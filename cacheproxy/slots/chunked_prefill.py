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

Whether a prompt was chunked shows nowhere in its answer: chunks happen only while other tenants
are active, so the reuse the answer reports is the reuse before the chunks, and their time is in
its prompt timings (`Chunks.shown`), as if llama-server had computed the prompt whole; the
server's own figures (the chunks' prefix reused) serve the proxy's checks and counts only.

`Chunks` adds up what the chunks of one prompt computed; prefill_chunks.py sends them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from cacheproxy.apis.observe import ShownReuse
from cacheproxy.slots.slot_share import TenantSlots, fair_shares
from cacheproxy.upstreams.slot_table import TaskOutcome

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


@dataclass
class Chunks:
    """What the chunks of one prompt computed so far (see prefill_chunks.py)."""

    end: int  # the slot holds the prompt's first `end` tokens
    count: int = 0
    cache_n: int | None = None  # what the first chunk reused
    prompt_n: int = 0
    prompt_ms: float = 0.0
    running: bool = False  # a chunk is under way: what the slot holds is not known
    running_to: int = 0  # the prefix the chunk under way computes
    failed: bool = False

    def add(self, end: int, outcome: TaskOutcome) -> None:
        if self.count == 0:
            self.cache_n = outcome.cache_n
        self.count += 1
        self.end = end
        self.prompt_n += outcome.prompt_n or 0
        self.prompt_ms += outcome.prompt_ms or 0.0

    def shown(self) -> ShownReuse | None:
        """How the request's answer shows its cache signals: what llama-server would have
        reported without the chunks, the reuse before them and their time (None: no chunk)."""
        if self.count == 0:
            return None
        return ShownReuse(self.cache_n or 0, self.prompt_ms)

    def end_known(self) -> bool:
        return self.count > 0 and not self.failed

    def between(self) -> bool:
        """Stopped between two chunks (or after the last): the slot holds exactly `end`."""
        return self.count > 0 and not self.running and not self.failed

    def outcome(self) -> TaskOutcome:
        """The chunks as one task that computed the prompt's first `end` tokens."""
        return TaskOutcome(
            ok=True,
            cache_n=self.cache_n,
            prompt_n=self.prompt_n,
            prompt_ms=self.prompt_ms,
            tokens_cached=self.end,
            generated=[],
            predicted_n=0,
        )

    def merged(self, final: TaskOutcome) -> TaskOutcome:
        """The request's outcome with its chunks: each prompt token computed counted once, as
        computed; reused only what the first chunk reused (when the request reused no more
        than the chunks left, else its own figure, which the prediction check then reports)."""
        if self.count == 0:
            return final
        computed_here = final.cache_n is not None and final.cache_n <= self.end
        reused = self.cache_n if computed_here else final.cache_n
        return replace(
            final,
            cache_n=reused,
            prompt_n=self.prompt_n + (final.prompt_n or 0) if final.prompt_n is not None else None,
            prompt_ms=self.prompt_ms + (final.prompt_ms or 0.0),
        )
