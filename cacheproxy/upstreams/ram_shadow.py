"""A shadow of an upstream's own RAM prompt cache (`--cache-ram`), followed from the proxy's side.

llama-server keeps a RAM cache shared by its slots (`server_prompt_cache`): whenever a task
launches, every idle slot is copied into it, and a pinned slot about to lose more than half of
itself is saved there and replaced by the cached entry that serves the task better. The proxy
cannot read that cache, but it sees every event that changes it (which task went to which slot,
what every slot held), so it replays them through the faithful policy (the `llama-server`
prompt-cache plugin, the embedded engine's re-implementation of that cache) with the server's
budget. The shadow then tells the router what the RAM cache will serve on each slot, and the disk
tier what it need not save. Where the server's `cache_n` shows otherwise, the caller corrects the
shadow (`observed`) and counts it.

Pure: no I/O, no clock. Entries are sized `bytes_per_token` per token (the server sizes them by
the sequence's state, which is its KV: the disk tier's measured bytes per token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cacheproxy.prompt_cache import SlotView
from cacheproxy.tokens import common_prefix_length

MIB = 1 << 20
# About what a token of the small test model takes (K and V of every layer, f16), used until a
# save measures the upstream's own figure.
DEFAULT_BYTES_PER_TOKEN = 1024.0


@dataclass(frozen=True)
class RamPrediction:
    """What the server's RAM cache does when a task is pinned to a slot."""

    cache_n: int  # what the server will report
    slot_kept: bool  # what the slot held is in the RAM cache (already, or saved first)
    entry_lost: int = 0  # tokens of a loaded entry the task overwrites (gone from the cache)
    entry_id: Any = None  # the entry the server will load into the slot, if any


@dataclass(frozen=True)
class ShadowSlot:
    """One slot as the shadow needs it: its exact tokens (None: not all known) and whether busy."""

    slot_id: int
    tokens: Sequence[int] | None
    busy: bool


class RamCacheShadow:
    """The upstream's RAM cache, replayed. `cache` is a `LlamaServerPromptCache` (the plugin)
    built with the server's budget, similarity threshold and total context."""

    def __init__(self, cache: Any, bytes_per_token: Callable[[], float] | None = None) -> None:
        self.cache = cache
        self._bytes_per_token = bytes_per_token or (lambda: DEFAULT_BYTES_PER_TOKEN)
        # entries that tasks placed on a slot, not yet sent, will load there (by slot id): the
        # server moves an entry out as it loads it, so no other slot may count on it meanwhile
        self._claimed: dict[int, Any] = {}

    def _size(self, n_tokens: int) -> int:
        return max(int(n_tokens * self._bytes_per_token()), 1)

    @staticmethod
    def _views(slots: Sequence[ShadowSlot]) -> list[SlotView]:
        # a slot whose tokens are not all known is shown as holding what is known: the server
        # compares with the whole, so a prediction there may be off (and is then corrected)
        return [SlotView(s.slot_id, tuple(s.tokens or ()), s.busy) for s in slots]

    # -- what the server will do ---------------------------------------------------------------

    def predict(
        self, slots: Sequence[ShadowSlot], slot_id: int, prompt: Sequence[int]
    ) -> RamPrediction:
        """What the server will do for `prompt` pinned to idle `slot_id`: the `cache_n` it will
        report (what the slot keeps, or what the RAM cache entry it loads there shares with the
        prompt), whether the slot's content stays in the RAM cache, and what a loaded entry
        loses (it leaves the cache, and the prompt overwrites it past their common prefix)."""
        cap = max(len(prompt) - 1, 0)
        held = next(s for s in slots if s.slot_id == slot_id).tokens or ()
        kept = common_prefix_length(held, prompt)
        in_cache = self.keeps(held)
        choice = self.cache.choose_slot(prompt, self._views(slots), requested_slot_id=slot_id)
        if not choice.try_load:
            return RamPrediction(min(kept, cap), in_cache)
        claimed = [entry for slot, entry in self._claimed.items() if slot != slot_id]
        cache = self.cache
        if claimed or (choice.save_slot and held):  # changes to try on a copy
            cache = cache.copy()
            for entry_id in claimed:
                cache.load_finished(entry_id, restored=True)
        if choice.save_slot and held:  # the save may evict entries
            in_cache = cache.save(tuple(held), self._size(len(held))).stored or in_cache
        loaded = cache.load(tuple(held), prompt)
        if loaded.entry_id is None:
            return RamPrediction(min(kept, cap) if held else 0, in_cache)
        return RamPrediction(
            min(loaded.n_common, cap),
            in_cache,
            len(loaded.tokens) - loaded.n_common,
            loaded.entry_id,
        )

    def claim(
        self,
        slots: Sequence[ShadowSlot],
        slot_id: int,
        prompt: Sequence[int],
        predicted: RamPrediction | None = None,
    ) -> None:
        """A task with `prompt` is placed on idle `slot_id` (as `slots` are now) and will be
        sent shortly: the entry it will load there is no other slot's to count on.
        `predicted`: `predict`'s answer for it, when the placement asked already."""
        if predicted is None:
            predicted = self.predict(slots, slot_id, prompt)
        entry_id = predicted.entry_id
        if entry_id is None:
            self._claimed.pop(slot_id, None)
        else:
            self._claimed[slot_id] = entry_id

    def unclaim(self, slot_id: int) -> None:
        """The task placed on `slot_id` was sent (`dispatched` replays it) or never will be."""
        self._claimed.pop(slot_id, None)

    def keeps(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds all of `tokens` (as its prefix, or equal): a disk save of them
        is then redundant while the server runs."""
        if not tokens:
            return False
        return any(
            common_prefix_length(entry.tokens, tokens) == len(tokens)
            for entry in self.cache.entries()
        )

    def will_keep(
        self,
        slots: Sequence[ShadowSlot],
        slot_id: int,
        held: Sequence[int],
        prompt: Sequence[int],
    ) -> bool:
        """Whether, once `prompt` goes to `slot_id` (holding `held`), the RAM cache holds all of
        `held`: it does already, or the server saves the slot there before overwriting it."""
        if self.keeps(held):
            return True
        views = self._views(_with_held(slots, slot_id, held))
        choice = self.cache.choose_slot(prompt, views, requested_slot_id=slot_id)
        limit = self.cache.limit_bytes
        return bool(held) and choice.save_slot and (limit <= 0 or self._size(len(held)) <= limit)

    # -- what happened ---------------------------------------------------------------------------

    def dispatched(
        self,
        slots: Sequence[ShadowSlot],
        slot_id: int,
        held: Sequence[int] | None,
        prompt: Sequence[int],
    ) -> None:
        """A task with `prompt` went to idle `slot_id`, which held `held` (None: not known);
        `slots` are the others as they are now. Replays `get_available_slot` (save the slot,
        load a better entry) and then `cache_idle_slots` (every idle slot copied in)."""
        self._claimed.pop(slot_id, None)
        views = _with_held(slots, slot_id, held)
        choice = self.cache.choose_slot(prompt, self._views(views), requested_slot_id=slot_id)
        if choice.save_slot and held:
            self.cache.save(tuple(held), self._size(len(held)))
        if choice.try_load:
            loaded = self.cache.load(tuple(held or ()), prompt)
            if loaded.entry_id is not None:
                self.cache.load_finished(loaded.entry_id, restored=True)
        if choice.save_slot or choice.try_load:
            self.cache.update()
        for slot in slots:  # SC:2641-2657: every idle slot, after the launch
            if slot.slot_id == slot_id or slot.busy or not slot.tokens:
                continue
            if self.cache.save(tuple(slot.tokens), self._size(len(slot.tokens))).stored:
                self.cache.update()

    def observed(self, prompt: Sequence[int], predicted: int, cache_n: int) -> None:
        """The server reported `cache_n` where the shadow predicted `predicted`: an entry that
        served more than predicted has left the server's cache (it was moved into the slot)."""
        if cache_n <= predicted:
            return  # the entry the shadow expected was not there: it has already dropped it
        for entry in self.cache.entries():
            if common_prefix_length(entry.tokens, prompt) >= cache_n:
                self.cache.load_finished(entry.entry_id, restored=True)
                return

    def reset(self) -> None:
        """The server restarted: its RAM cache is empty."""
        self._claimed.clear()
        for entry in self.cache.entries():
            self.cache.load_finished(entry.entry_id, restored=True)


def _with_held(
    slots: Sequence[ShadowSlot], slot_id: int, held: Sequence[int] | None
) -> list[ShadowSlot]:
    """`slots`, with `slot_id` idle and holding `held`, as the server finds it for the task."""
    return [s if s.slot_id != slot_id else ShadowSlot(slot_id, held, False) for s in slots]
