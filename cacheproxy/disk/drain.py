"""The shutdown drain: every idle slot worth keeping archived before the proxy (and maybe the
servers) stop, upstreams side by side, until a deadline; what was left is said with why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cacheproxy.disk.attached import AttachedUpstream, DiskUnavailable, SlotSaver
from cacheproxy.disk.policy import Evicted, worth_saving
from cacheproxy.upstreams.slot_table import SlotContent, SlotState, UpstreamSlots

log = logging.getLogger(__name__)


@dataclass
class DrainReport:
    """What a shutdown drain archived, and the slots worth keeping it left, each with why."""

    saved: int = 0
    left: list[str] = field(default_factory=list)
    # slots worth keeping not yet dealt with -> why, should the time run out now
    pending: dict[str, str] = field(default_factory=dict)


async def drain_slots(
    tables: list[UpstreamSlots],
    owner_of: Callable[[SlotState], str | None],
    deadline: float | None,
    upstreams: Mapping[int, AttachedUpstream],
    min_tokens: int,
    archive_slot: SlotSaver,
) -> DrainReport:
    """Archive every idle slot worth keeping (at shutdown, when no request runs) of the tables
    whose upstream is attached (`upstreams`), through `archive_slot`, until `deadline`
    (`time.monotonic()`; None: no limit). Upstreams are drained side by side, so a stuck one
    does not hold up the others; what could not be archived is in the report."""
    report = DrainReport()
    drains = [
        asyncio.create_task(
            _drain_upstream(table, owner_of, upstreams, min_tokens, archive_slot, report),
            name="disk-drain",
        )
        for table in tables
    ]
    if not drains:
        return report
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    _, late = await asyncio.wait(drains, timeout=timeout)
    for task in late:
        task.cancel()
    await asyncio.gather(*drains, return_exceptions=True)
    for task in drains:
        if not task.cancelled() and task.exception() is not None:
            log.error("drain failed", exc_info=task.exception())
    # whatever was still to do when the time ran out, or when a drain failed
    for slot_name, reason in report.pending.items():
        report.left.append(f"{slot_name} ({reason})")
    report.pending.clear()
    return report


async def _drain_upstream(
    table: UpstreamSlots,
    owner_of: Callable[[SlotState], str | None],
    upstreams: Mapping[int, AttachedUpstream],
    min_tokens: int,
    archive_slot: SlotSaver,
    report: DrainReport,
) -> None:
    attached = upstreams.get(table.index)
    if attached is None:
        return  # no disk tier on this upstream: nothing was ever to be archived
    worth: list[tuple[SlotState, SlotContent, str]] = []
    for slot in table.slots:
        content = SlotContent(slot.known, slot.unknown_tail, owner_of(slot))
        # nothing of it stays: the server may be stopped or replaced next
        if worth_saving(Evicted(content.n_tokens_at_least, 0, content.owner), min_tokens):
            name = (
                f"slot {slot.slot_id} of {table.upstream.name}: tenant {content.owner},"
                f" {content.n_tokens_at_least} tokens"
            )
            worth.append((slot, content, name))
    for slot, _, name in worth:
        report.pending[name] = "time ran out"
        if not table.healthy:
            report.pending[name] = "upstream not answering"
        elif slot.busy:
            report.pending[name] = "still busy"
    if not table.healthy:
        return
    for slot, content, name in worth:
        if slot.busy:
            continue
        report.pending[name] = "save under way when the time ran out"
        try:
            archive = await archive_slot(table, slot.slot_id, content, attached)
        except DiskUnavailable:
            report.pending[name] = "disk tier off"
            return
        del report.pending[name]
        report.saved += archive is not None
