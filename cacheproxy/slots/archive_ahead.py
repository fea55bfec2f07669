"""Archive ahead of need: save idle slots in the background, so evictions find them covered.

An eviction saves the slot it overwrites before the evicting request goes out, and that request
(often another tenant's, who can time it) waits for the save. This loop saves idle slots earlier,
within a disk bandwidth budget (`disk.ahead_mib_s`, a token bucket), newest turn first, and
only what no archive covers yet; at eviction the disk tier then finds an archive that holds the
whole slot and saves nothing.

A background save holds its slot through the scheduler (`take_for_save`), so no request is
pinned to it while llama-server writes it, and one starts only while no request waits for a
slot: llama-server's loop runs nothing else while it saves, so a request that arrives meanwhile
waits at most for the one save under way. Whether a save pays is the cost model's
(`cacheproxy.disk.policy.decide_save`) to say, on measured rates and the slots busy now, each
of which waits for the write: a save worth it only with fewer of them busy (`BUSY`) is looked
at again next round, so background saves go where the server is quiet. A save rate not
measured for `disk.remeasure_s` is measured again by saving anyway, off every request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

from cacheproxy.disk.policy import BUSY, SAVE, decide_save
from cacheproxy.disk.tier import DiskTier, DiskUnavailable
from cacheproxy.ops.supervise import repeat
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.upstreams.slot_table import SlotContent, SlotState, UpstreamSlots

log = logging.getLogger(__name__)

MIB = 1 << 20
BURST_S = 1.0  # unspent budget saved up for at most this many seconds of bandwidth


class ArchiveAhead:
    def __init__(
        self,
        disk: DiskTier | None,  # None: no disk tier, nothing to do
        scheduler: SlotScheduler,
        tables: list[UpstreamSlots],
        owner_of: Callable[[SlotState], str | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.disk = disk
        self.scheduler = scheduler
        self.tables = tables  # the monitor's list: rebuilt in place when upstreams change
        self.owner_of = owner_of
        self.clock = clock
        self.budget_bytes_per_s = 0.0 if disk is None else disk.settings.ahead_mib_s * MIB
        self._credit = 0.0  # bytes that may be written now; negative: a debt to wait out
        self._refilled = clock()
        # (upstream, slot) -> slot version already covered or declined: not looked at again
        self._settled: dict[tuple[int, int], int] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.disk is None or self.budget_bytes_per_s <= 0 or self._task is not None:
            return
        self._refilled = self.clock()
        self._task = asyncio.create_task(
            repeat(
                "archive ahead",
                self.one_round,
                pause_s=self.disk.settings.ahead_interval_s,
                log=log,
            ),
            name="archive-ahead",
        )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _refill(self) -> None:
        now = self.clock()
        rate = self.budget_bytes_per_s
        self._credit = min(self._credit + (now - self._refilled) * rate, rate * BURST_S)
        self._refilled = now

    def _candidates(self) -> list[tuple[UpstreamSlots, SlotState, SlotContent]]:
        """Idle slots holding exactly known text of somebody's, idle long enough, not settled
        at their current version: the most recently used first."""
        now = self.clock()
        found = []
        for table in self.tables:
            if not table.healthy or table.index not in self.disk.attached:
                continue
            for slot in table.slots:
                if slot.busy or slot.empty or slot.unknown_tail != 0:
                    continue  # only exactly known tokens can be found covered at eviction
                if len(slot.known) < self.disk.settings.min_tokens:
                    continue
                if now - slot.last_used < self.disk.settings.ahead_idle_s:
                    continue
                if self._settled.get((table.index, slot.slot_id)) == slot.version:
                    continue
                owner = self.owner_of(slot)
                if owner is None:
                    continue
                chances = (
                    self.scheduler.continue_chance(owner),
                    self.scheduler.exact_continue_chance(owner),
                )
                found.append((table, slot, slot.content(owner, *chances)))
        found.sort(key=lambda item: item[1].last_used, reverse=True)
        return found

    async def one_round(self) -> None:
        """Save what the budget allows now, one slot at a time."""
        self._refill()
        if self._credit < 0 or self.scheduler.queued:
            return
        candidates = self._candidates()
        if not candidates or not await self.disk.ready():
            return
        try:
            usage = await self.disk.usage_bytes()
            for table, slot, content in candidates:
                if self._credit < 0 or self.scheduler.queued:
                    return
                await self._consider(table, slot, content, usage)
        except DiskUnavailable:
            return  # the tier turned itself off; it checks again on its own

    async def _consider(
        self,
        table: UpstreamSlots,
        slot: SlotState,
        content: SlotContent,
        usage: dict[str, int],
    ) -> None:
        attached = self.disk.attached.get(table.index)
        if attached is None or content.owner is None:
            return
        key, version = (table.index, slot.slot_id), slot.version
        archived = await self.disk.archived_prefix(table, content, attached)
        if content.held_whole_by(archived):
            self._settled[key] = version
            return
        if slot.version != version:
            return  # a request took it while the index was read
        quota_bytes, _ = self.disk.quotas(content.owner)
        headroom = None if quota_bytes is None else quota_bytes - usage.get(content.owner, 0)
        candidate = dataclasses.replace(
            self.disk.costs.save_candidate(
                content, 0, attached, ahead=True, quota_headroom_bytes=headroom
            ),
            archived_tokens=archived,  # only the rest is at stake
        )
        rates = self.disk.costs.rates(table, attached, slot.slot_id)
        decision = decide_save(candidate, rates, self.disk.costs.save_model)
        if decision == BUSY:
            return  # worth it once fewer slots wait for it: looked at again next round
        if decision != SAVE:
            if not self.disk.costs.remeasure_due(attached)(decision):
                self.disk.metrics.saves_skipped.labels("ahead", decision).inc()
                self._settled[key] = version
                return
            self.disk.costs.remeasured(attached)
        if not self.scheduler.take_for_save(table, slot, version):
            return
        try:
            archive = await self.disk.save(table, slot.slot_id, content, attached)
        finally:
            self.scheduler.return_from_save(slot)
        self._settled[key] = version
        if archive is None:
            return
        self._credit -= archive.bytes
        usage[content.owner] = usage.get(content.owner, 0) + archive.bytes
        self.disk.metrics.archive_ahead_bytes.inc(archive.bytes)
        log.debug(
            "archived slot %d of %s ahead: %d tokens, %d bytes",
            slot.slot_id,
            table.upstream.base_url,
            archive.n_tokens,
            archive.bytes,
        )
