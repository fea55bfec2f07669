"""What becomes of a slot's content when a request takes the slot (`policy.Evicted`): saved
first if it is worth keeping and no archive holds it yet, the request waiting for the server's
save as the cost model allows (its commit runs beside the request, `saves.py`); or, when the
server's own RAM cache keeps it, saved anyway only where a copy on disk is worth the save. A
shutdown drain saves whatever is worth keeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from cacheproxy.disk.archive_types import Archive
from cacheproxy.disk.attached import AttachedUpstream, SaveStarter, Saving
from cacheproxy.disk.policy import (
    SAVE,
    DiskRates,
    Evicted,
    SaveCandidate,
    SaveModel,
    decide_save,
    worth_saving,
    write_beside_lookup,
)
from cacheproxy.disk.save_costs import SaveCosts
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.settings import DiskTierSettings
from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.slot_table import Lease, SlotContent, UpstreamSlots


class EvictedSaves:
    """Saves of what a slot held, through the tier's saves (`saves.Saves.start_if`: the lookup
    of what an archive holds of it, the cost model's choice and the room, in one turn of the
    store's worker). On a request's path they wait for the file only and give back the commit
    under way (`Saving`), which the request's answer waits for; a drain's waits for the commit.
    Each raises DiskUnavailable when the archive folder or index failed."""

    def __init__(
        self,
        settings: DiskTierSettings,
        metrics: ProxyMetrics,
        costs: SaveCosts,
        start_if: SaveStarter,
        beside_room: Callable[[], tuple[float, int | None]],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.costs = costs
        self.start_if = start_if
        # a save's turn of the store's worker, and the folder's room to spare (`Saves`)
        self.beside_room = beside_room

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
        if not worth_saving(
            Evicted(content.n_tokens_at_least, kept, content.owner), self.min_tokens
        ):
            return None
        base = dataclasses.replace(
            self.costs.save_candidate(content, kept, attached, ahead=False),
            timed_by_other_tenant=evicted_by != content.owner,
        )
        rates = self.costs.rates(table, attached, slot_id)
        choice = _Choice(content, rates, self.costs.save_model, self.costs.remeasure_due(attached))

        def worth(archived: int) -> bool:
            # a conversation is weighed whole at eviction; a branching text only up to its
            # branch point, of which an archive may hold all
            held = 0 if content.branch is None else archived
            return choice.made(archived, dataclasses.replace(base, archived_tokens=held))

        # the server may write it while the store looks up what an archive holds of it
        decision = decide_save(base, rates, self.costs.save_model)
        beside = write_beside_lookup(decision, base.bytes, rates, *self.beside_room())
        saving = await self.start_if(table, slot_id, content, attached, worth, beside)
        if choice.covered:
            self._count_covered(eviction=True)
            return None
        if choice.declined:
            self.metrics.child(self.metrics.saves_skipped, "eviction", choice.decision).inc()
        if saving is None:
            self.metrics.child(self.metrics.evictions, "dropped").inc()
            return None
        if choice.remeasure:
            self.costs.remeasured(attached)
        saving.add_done_callback(self._count_eviction)
        return saving

    async def archive_worth_keeping(
        self, table: UpstreamSlots, slot_id: int, content: SlotContent, attached: AttachedUpstream
    ) -> Archive | None:
        """Save what the slot holds if it is worth keeping and not archived already, whatever
        the cost model says (a shutdown drain: nothing of it stays, the server may be stopped
        or replaced next), and wait for its commit."""
        if not worth_saving(Evicted(content.n_tokens_at_least, 0, content.owner), self.min_tokens):
            return None
        covered = False

        def worth(archived: int) -> bool:
            nonlocal covered
            covered = content.held_whole_by(archived)
            return not covered

        saving = await self.start_if(table, slot_id, content, attached, worth, False)
        if covered:
            self._count_covered(eviction=False)
        return None if saving is None else await asyncio.shield(saving)

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
        if loss_chance > 0 and content.owner is not None and worth_saving(evicted, self.min_tokens):
            base = dataclasses.replace(
                self.costs.save_candidate(content, kept, attached, ahead=False),
                loss_chance=loss_chance,
            )
            rates = self.costs.rates(table, attached, slot_id)
            choice = _Choice(content, rates, self.costs.save_model, remeasure_due=None)

            def worth(archived: int) -> bool:
                return choice.made(archived, dataclasses.replace(base, archived_tokens=archived))

            saving = await self.start_if(table, slot_id, content, attached, worth, False)
            if choice.covered:
                self._count_covered(eviction=True)
                return None
            if saving is not None:
                saving.add_done_callback(self._count_beside_ram_cache)
                return saving
            if choice.declined:
                self.metrics.child(self.metrics.saves_skipped, "ram_cache", choice.decision).inc()
        self._count_ram_cache()
        return None

    @property
    def min_tokens(self) -> int:
        return self.settings.min_tokens

    def _count_covered(self, eviction: bool) -> None:
        self.metrics.child(self.metrics.archive_saves, "covered").inc()
        if eviction:
            self.metrics.child(self.metrics.evictions, "covered").inc()

    def _count_eviction(self, saving: Saving) -> None:
        self.metrics.child(self.metrics.evictions, "saved" if _kept(saving) else "dropped").inc()

    def _count_beside_ram_cache(self, saving: Saving) -> None:
        if _kept(saving):
            self.metrics.child(self.metrics.evictions, "saved").inc()
        else:
            self._count_ram_cache()

    def _count_ram_cache(self) -> None:
        self.metrics.child(self.metrics.archive_saves, "ram_cache").inc()
        self.metrics.child(self.metrics.evictions, "ram_cache").inc()


class _Choice:
    """The cost model's choice for one save, made in the store's worker thread between the
    lookup and the reservation (`made` only reads and records); counted on the loop after."""

    def __init__(
        self,
        content: SlotContent,
        rates: DiskRates,
        model: SaveModel,
        remeasure_due: Callable[[str], bool] | None,
    ) -> None:
        self.content = content
        self.rates = rates
        self.model = model
        self.remeasure_due = remeasure_due  # a no the disk's measure may overrule
        self.covered = False  # an archive holds all of it: nothing to save
        self.decision = ""  # the model's answer, once asked
        self.remeasure = False  # saved despite the model's no, to measure the disk

    def made(self, archived: int, candidate: SaveCandidate) -> bool:
        self.covered = self.content.held_whole_by(archived)
        if self.covered:
            return False
        self.decision = decide_save(candidate, self.rates, self.model)
        self.remeasure = (
            self.decision != SAVE
            and self.remeasure_due is not None
            and self.remeasure_due(self.decision)
        )
        return self.decision == SAVE or self.remeasure

    @property
    def declined(self) -> bool:
        """The model said no and no measure overruled it."""
        return self.decision not in ("", SAVE) and not self.remeasure


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
