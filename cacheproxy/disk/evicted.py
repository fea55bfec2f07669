"""What becomes of a slot's content when a request takes the slot (`policy.Evicted`): saved
first if it is worth keeping and no archive holds it yet, the request waiting for the server's
save as the cost model allows (its commit runs beside the request, `saves.py`); or, when the
server's own RAM cache keeps it, saved anyway only where a copy on disk is worth the save. A
shutdown drain saves whatever is worth keeping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from cacheproxy.disk.archive_types import Archive
from cacheproxy.disk.attached import AttachedUpstream, SaveStarter, Saving, SlotSaver
from cacheproxy.disk.policy import SAVE, Evicted, decide_save, worth_saving
from cacheproxy.disk.save_costs import SaveCosts
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.settings import DiskTierSettings
from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.slot_table import Lease, SlotContent, UpstreamSlots

# how many of the content's first tokens an archive of its owner holds (the tier's lookup)
ArchivedPrefix = Callable[[SlotContent, AttachedUpstream], Awaitable[int]]


class EvictedSaves:
    """Saves of what a slot held, through the tier's saves: on a request's path they wait for
    the file only and give back the commit under way (`Saving`), which the request's answer
    waits for; a drain's waits for the commit. Each raises DiskUnavailable when the archive
    folder or index failed."""

    def __init__(
        self,
        settings: DiskTierSettings,
        metrics: ProxyMetrics,
        costs: SaveCosts,
        archived_prefix: ArchivedPrefix,
        save: SlotSaver,
        start: SaveStarter,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.costs = costs
        self.archived_prefix = archived_prefix
        self.save = save
        self.start = start

    async def archive_if_worth(
        self,
        table: UpstreamSlots,
        slot_id: int,
        content: SlotContent,
        kept: int,
        attached: AttachedUpstream,
        evicted_by: str,
    ) -> Saving | None:
        """Save what the slot holds if it is worth keeping, not archived already and worth the
        wait to the cost model: the request of tenant `evicted_by` about to overwrite it waits
        for the file; `kept` is how much of it stays in the slot. The commit under way, or
        None when nothing is saved."""
        archived = await self._not_archived(content, kept, attached, eviction=True)
        if archived is None:
            return None
        candidate = dataclasses.replace(
            self.costs.save_candidate(content, kept, attached, ahead=False),
            # a conversation is weighed whole at eviction; a branching text only up to its
            # branch point, of which an archive may hold all
            archived_tokens=0 if content.branch is None else archived,
            timed_by_other_tenant=evicted_by != content.owner,
        )
        rates = self.costs.rates(table, attached, slot_id)
        decision = decide_save(candidate, rates, self.costs.save_model)
        if decision != SAVE and not self.costs.remeasure_save(decision, attached):
            self.metrics.saves_skipped.labels("eviction", decision).inc()
            self.metrics.evictions.labels("dropped").inc()
            return None
        saving = await self.start(table, slot_id, content, attached)
        if saving is None:
            self.metrics.evictions.labels("dropped").inc()
        else:
            saving.add_done_callback(self._count_eviction)
        return saving

    async def archive_worth_keeping(
        self, table: UpstreamSlots, slot_id: int, content: SlotContent, attached: AttachedUpstream
    ) -> Archive | None:
        """Save what the slot holds if it is worth keeping and not archived already, whatever
        the cost model says (a shutdown drain: nothing of it stays, the server may be stopped
        or replaced next), and wait for its commit."""
        if await self._not_archived(content, 0, attached, eviction=False) is None:
            return None
        return await self.save(table, slot_id, content, attached)

    async def archive_beside_ram_cache(
        self,
        table: UpstreamSlots,
        slot_id: int,
        content: SlotContent,
        kept: int,
        attached: AttachedUpstream,
    ) -> Saving | None:
        """The server's RAM cache keeps what the slot held, so the request need not wait for a
        save to keep it; but that copy dies with a restart of the server (and under others'
        load), the disk's does not. Save it anyway when the part no archive holds yet, at
        `disk.ram_cache_loss_chance`, is worth the save to the cost model: a conversation's
        first eviction usually is, each later turn's few tokens seldom, so the saves of a
        growing conversation stay few. The commit under way, or None when nothing is saved."""
        evicted = Evicted(content.n_tokens_at_least, kept, content.owner)
        loss_chance = self.settings.ram_cache_loss_chance
        if (
            loss_chance > 0
            and content.owner is not None
            and worth_saving(evicted, self.settings.min_tokens)
        ):
            archived = await self.archived_prefix(content, attached)
            if content.held_whole_by(archived):
                self.metrics.archive_saves.labels("covered").inc()
                self.metrics.evictions.labels("covered").inc()
                return None
            candidate = dataclasses.replace(
                self.costs.save_candidate(content, kept, attached, ahead=False),
                archived_tokens=archived,
                loss_chance=loss_chance,
            )
            decision = decide_save(
                candidate, self.costs.rates(table, attached, slot_id), self.costs.save_model
            )
            if decision == SAVE:
                saving = await self.start(table, slot_id, content, attached)
                if saving is not None:
                    saving.add_done_callback(self._count_beside_ram_cache)
                    return saving
            else:
                self.metrics.saves_skipped.labels("ram_cache", decision).inc()
        self._count_ram_cache()
        return None

    async def _not_archived(
        self, content: SlotContent, kept: int, attached: AttachedUpstream, eviction: bool
    ) -> int | None:
        """How much of what the slot holds an archive of its owner holds, when the content is
        worth keeping and not all of it is archived (counted as covered when it is); else
        None: nothing to save."""
        evicted = Evicted(content.n_tokens_at_least, kept, content.owner)
        if not worth_saving(evicted, self.settings.min_tokens):
            return None
        archived = await self.archived_prefix(content, attached)
        if content.held_whole_by(archived):
            self.metrics.archive_saves.labels("covered").inc()
            if eviction:
                self.metrics.evictions.labels("covered").inc()
            return None
        return archived

    def _count_eviction(self, saving: Saving) -> None:
        self.metrics.evictions.labels("saved" if _kept(saving) else "dropped").inc()

    def _count_beside_ram_cache(self, saving: Saving) -> None:
        if _kept(saving):
            self.metrics.evictions.labels("saved").inc()
        else:
            self._count_ram_cache()

    def _count_ram_cache(self) -> None:
        self.metrics.archive_saves.labels("ram_cache").inc()
        self.metrics.evictions.labels("ram_cache").inc()


def _kept(saving: Saving) -> bool:
    """The commit made an archive (not cancelled, failed or refused)."""
    return not saving.cancelled() and saving.exception() is None and saving.result() is not None


def kept_in_slot(lease: Lease) -> int:
    """How much of what the slot held before this request stays in it: the prefix it shares
    with the prompt. Reuse the server's RAM cache brings in replaces the slot's content rather
    than keeping it, so the predicted reuse counts only as far as that prefix goes (an opaque
    prompt's ids are unknown: its prediction is all there is)."""
    if lease.isolate:
        return 0
    if lease.opaque:
        return lease.predicted.low
    return min(lease.predicted.low, common_prefix_length(lease.previous.known, lease.prompt))


def ram_cache_holds(lease: Lease) -> bool:
    """The server's RAM cache holds all of what the slot held already (its shadow says so)."""
    shadow = lease.table.ram_shadow
    return shadow is not None and shadow.keeps(lease.previous.known)


def ram_cache_keeps(lease: Lease, min_tokens: int) -> bool:
    """The server's own RAM cache will hold all of what the slot held (its shadow says so):
    saving it to disk too would cost the request a save of a state the server keeps itself."""
    shadow, previous, slot = lease.table.ram_shadow, lease.previous, lease.slot
    if shadow is None or previous.unknown_tail != 0 or len(previous.known) < min_tokens:
        return False
    return shadow.will_keep(lease.table.shadow_slots(), slot.slot_id, previous.known, lease.prompt)
