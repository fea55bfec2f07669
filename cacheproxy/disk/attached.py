"""What the disk tier's modules share: each attached upstream's fingerprint and measured costs,
how a slot is saved and a store call guarded, what a server reports it spent, and the error
that says the tier turned itself off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from cacheproxy.disk.archive_types import Archive
from cacheproxy.disk.policy import RestoreYield
from cacheproxy.upstreams.adapters import Scales, scales_key
from cacheproxy.upstreams.rates import MeasuredRate
from cacheproxy.upstreams.slot_table import SlotContent, Smoothed, UpstreamSlots

# Starting guesses, replaced by measurements after the first restores (llama-server on one core
# reads a 2 MB slot file in about a millisecond; the HTTP round trip costs about as much).
INITIAL_RESTORE_BYTES_PER_MS = 500_000.0
INITIAL_SAVE_BYTES_PER_MS = 250_000.0
INITIAL_RESTORE_OVERHEAD_MS = 2.0
INITIAL_BYTES_PER_TOKEN = 1024.0
INITIAL_SAVE_OVERHEAD_MS = 2.0
# putting a restore together from blocks: read, checked and written by the proxy (memory speed)
INITIAL_ASSEMBLE_BYTES_PER_MS = 500_000.0

T = TypeVar("T")


class DiskUnavailable(Exception):
    """The archive folder or index failed; the tier has turned itself off for a while."""


class StoreCall(Protocol):
    """The tier's off-on switch around one awaited store call: an I/O or database error turns
    the tier off and comes out as DiskUnavailable."""

    def __call__(self, call: Awaitable[T], /) -> Awaitable[T]: ...


@dataclass
class AttachedUpstream:
    """An upstream that saves into the archive folder, and what restores cost there."""

    fingerprint: str
    restore_bytes_per_ms: MeasuredRate = field(
        default_factory=lambda: MeasuredRate(INITIAL_RESTORE_BYTES_PER_MS)
    )
    save_bytes_per_ms: MeasuredRate = field(
        default_factory=lambda: MeasuredRate(INITIAL_SAVE_BYTES_PER_MS)
    )
    restore_overhead_ms: Smoothed = field(
        default_factory=lambda: Smoothed(INITIAL_RESTORE_OVERHEAD_MS)
    )
    bytes_per_token: Smoothed = field(default_factory=lambda: Smoothed(INITIAL_BYTES_PER_TOKEN))
    save_overhead_ms: Smoothed = field(default_factory=lambda: Smoothed(INITIAL_SAVE_OVERHEAD_MS))
    # beside busy slots, what a save or restore waited for the batch under way (none known
    # until one did: the first sample replaces the guess)
    batch_wait_ms: Smoothed = field(default_factory=lambda: Smoothed(0.0, prior=True))
    # how fast a restore is put together from blocks (the folder's, measured per upstream)
    assemble_bytes_per_ms: MeasuredRate = field(
        default_factory=lambda: MeasuredRate(INITIAL_ASSEMBLE_BYTES_PER_MS)
    )
    # other slots busy when a request is placed: they wait for its prefill or its restore
    busy_when_placed: Smoothed = field(default_factory=lambda: Smoothed(0.0))
    remeasured_at: float = float("-inf")  # the last save made only to measure the disk
    # its slot files hold state after the KV cache (`SlotKvLayout.state_after_kv`): restored
    # whole or not at all (`policy.restore_is_whole`)
    state_after_kv: bool = False
    # what the requests on restored slots reused of the restores (`DiskTier.restore_answered`)
    restore_yield: RestoreYield = field(default_factory=RestoreYield)


def filed_under(
    attached: AttachedUpstream, table: UpstreamSlots, scales: Scales | None
) -> str | None:
    """The fingerprint archives of text computed on `table` under the LoRA scales `scales` are
    filed under: the model's, and on a server with adapters their files and the scales
    (upstreams/adapters.py: the same tokens under other adapters or scales are another state);
    None: the scales are not known, and nothing is filed or looked up."""
    if not table.adapters:
        return attached.fingerprint
    if scales is None:
        return None
    return f"{attached.fingerprint}+lora:{scales_key(table.adapter_files, scales)}"


# Save what a slot of an attached upstream holds into a new archive of its owner (the tier's
# `save`, or its save of what is worth keeping); None: not archived. Raises DiskUnavailable.
SlotSaver = Callable[[UpstreamSlots, int, SlotContent, AttachedUpstream], Awaitable[Archive | None]]
# A save's commit under way, its file written: the archive, or None when it was not kept
Saving = asyncio.Task[Archive | None]
# Have the server write what a slot holds and queue its commit if the fifth argument, told how
# much of it an archive holds, says it is worth it (`saves.Saves.start_if`; the last: the server
# writes it beside the lookup); None: no file written. Raises DiskUnavailable.
SaveStarter = Callable[
    [UpstreamSlots, int, SlotContent, AttachedUpstream, Callable[[int], bool], bool],
    Awaitable[Saving | None],
]


def reported_ms(answer: dict, timing: str) -> float:
    """A time llama-server reports in an answer's `timings` (0 when it reports none)."""
    try:
        return max(float((answer.get("timings") or {}).get(timing) or 0.0), 0.0)
    except (TypeError, ValueError):
        return 0.0
