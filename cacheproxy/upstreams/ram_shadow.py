"""A shadow of an upstream's own RAM prompt cache (`--cache-ram`), followed from the proxy's side.

llama-server keeps a RAM cache shared by its slots (`server_prompt_cache`): whenever a task
launches, every idle slot is copied into it (and, with a unified KV cache, emptied), and a slot
about to lose more than half of itself is saved there and replaced by the cached entry that
serves the task better. The proxy cannot read that cache, but it sees every event that changes it
(which task went to which slot, what every slot held), so it replays them through the faithful
policy (the `llama-server` prompt-cache plugin, the embedded engine's re-implementation of that
cache) with the server's budget. The shadow then tells the router what the RAM cache will serve
on each slot (and, for a task the server places itself, which slot it takes), and the disk tier
what it need not save. Where the server's `cache_n` shows otherwise, the caller corrects the
shadow (`observed`), counts it, and the budget is learnt anew (ram_budget.py). A learnt budget
is counted on only as far as the server has shown it (`RamPrediction.proven`, `will_keep`): past
that, a load the shadow predicts may not happen, and the proxy must not pay a prefill for it.

The cache's rules the predictions rest on, as the pinned tree has them (ST = server-task.cpp,
SC = server-context.cpp), all applied by the plugin:
- an entry is moved out of the cache when it is loaded (ST:1873-1875): no other slot, and no
  later task, can load it again;
- the size limit is strict: room is made before an entry is allocated (ST:1762-1768), and
  `update` evicts, oldest first, while over it (ST:1882-1888);
- an entry over the limit is never kept, and evicts nothing (ST:1741-1746);
- an entry keeping less than a quarter of itself is never loaded (ST:1823-1826);
- a slot is saved and the best entry loaded when it is about to lose more than half of itself
  (SC:1730-1742, 1769-1790); a pinned *empty* slot never consults the cache (f_keep = 0/0);
- after every launch each idle slot is copied in, and with a unified KV cache emptied
  (SC:2641-2657).

Pure: no I/O, no clock. Entries are sized `bytes_per_token` per token (the server sizes them by
the sequence's state, which is its KV: the disk tier's measured bytes per token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cacheproxy.prompt_cache import CacheEntry, EntryId, SlotView
from cacheproxy.tokens import common_prefix_length, is_prefix
from cacheproxy.upstreams.ram_budget import BudgetLearner, LoadSeen, entry_ids_by_tokens

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
    # the load is one the server has shown it makes (its budget proven that far); else the
    # `cache_n` is a chance, not to be counted on (no load: nothing to prove)
    proven: bool = True


@dataclass(frozen=True)
class ShadowSlot:
    """One slot as the shadow needs it: its exact tokens (None: not all known), whether busy,
    and when it last finished a task (any increasing clock; -1: never), which decides the
    least recently used slot the server takes for a task it places itself."""

    slot_id: int
    tokens: Sequence[int] | None
    busy: bool
    last_used: int = -1


class RamCacheShadow:
    """The upstream's RAM cache, replayed. `cache` is a `LlamaServerPromptCache` (the plugin)
    built with the server's budget, similarity threshold and total context; `resized(limit)`
    builds an empty one at another byte limit, so the budget can be learnt (None: the budget
    given is taken as a fact)."""

    def __init__(
        self,
        cache: Any,
        bytes_per_token: Callable[[], float] | None = None,
        resized: Callable[[int], Any] | None = None,
    ) -> None:
        self.cache = cache
        self._bytes_per_token = bytes_per_token or (lambda: DEFAULT_BYTES_PER_TOKEN)
        # entries that tasks placed on a slot, not yet sent, will load there (by slot id): the
        # server moves an entry out as it loads it, so no other slot may count on it meanwhile
        self._claimed: dict[int, Any] = {}
        self._learner = BudgetLearner(resized) if resized is not None else None
        # by slot id, the load the last task sent there was replayed with (None: none)
        self._loads: dict[int, LoadSeen | None] = {}

    @property
    def budget_bytes(self) -> int:
        """The byte limit the shadow follows now (0: none), learnt or as configured."""
        return self.cache.limit_bytes

    @property
    def proven_bytes(self) -> int:
        """How much the server has been seen to keep, counted on up to there (-1: all, the
        budget being taken as a fact)."""
        return self._learner.proven_bytes if self._learner is not None else -1

    @property
    def budget_changes(self) -> int:
        """How many times the budget was learnt anew from the server's answers."""
        return self._learner.changes if self._learner is not None else 0

    def _size(self, n_tokens: int) -> int:
        return max(int(n_tokens * self._bytes_per_token()), 1)

    @staticmethod
    def _views(slots: Sequence[ShadowSlot]) -> list[SlotView]:
        # a slot whose tokens are not all known is shown as holding what is known: the server
        # compares with the whole, so a prediction there may be off (and is then corrected)
        return [SlotView(s.slot_id, tuple(s.tokens or ()), s.busy, s.last_used) for s in slots]

    # -- what the server will do ---------------------------------------------------------------

    def predict(
        self, slots: Sequence[ShadowSlot], slot_id: int, prompt: Sequence[int]
    ) -> RamPrediction:
        """What the server will do for `prompt` pinned to idle `slot_id`: the `cache_n` it will
        report (what the slot keeps, or what the RAM cache entry it loads there shares with the
        prompt), whether the slot's content stays in the RAM cache, and what a loaded entry
        loses (it leaves the cache, and the prompt overwrites it past their common prefix)."""
        return self._predict(slots, slot_id, prompt, slot_id)

    def pick(
        self, slots: Sequence[ShadowSlot], prompt: Sequence[int]
    ) -> tuple[int, RamPrediction] | None:
        """The slot the server takes for `prompt` sent without `id_slot` (the idle non-empty
        slot most similar to it, else the least recently used idle one: SC:1694-1767), and
        what it does there, as `predict` says it; None when no slot is idle."""
        choice = self.cache.choose_slot(prompt, self._views(slots), requested_slot_id=None)
        if choice.slot_id is None or choice.must_defer:
            return None
        return choice.slot_id, self._predict(slots, choice.slot_id, prompt, None)

    def _predict(
        self,
        slots: Sequence[ShadowSlot],
        slot_id: int,
        prompt: Sequence[int],
        requested: int | None,
    ) -> RamPrediction:
        cap = max(len(prompt) - 1, 0)
        held = next(s for s in slots if s.slot_id == slot_id).tokens or ()
        kept = common_prefix_length(held, prompt)
        in_cache = self.keeps(held)
        choice = self.cache.choose_slot(prompt, self._views(slots), requested_slot_id=requested)
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
        proven = True
        if self._learner is not None:
            seen = self._learner.load_seen(cache.entries(), loaded.entry_id, loaded.n_common)
            proven = self._learner.proves(seen.bound_bytes)
        return RamPrediction(
            min(loaded.n_common, cap),
            in_cache,
            len(loaded.tokens) - loaded.n_common,
            loaded.entry_id,
            proven,
        )

    def claim(
        self,
        slots: Sequence[ShadowSlot],
        slot_id: int,
        prompt: Sequence[int],
        predicted: RamPrediction | None = None,
        pinned: bool = True,
    ) -> None:
        """A task with `prompt` is placed on idle `slot_id` (as `slots` are now) and will be
        sent shortly: the entry it will load there is no other slot's to count on.
        `predicted`: `predict`'s (or `pick`'s) answer for it, when the placement asked already;
        `pinned`: sent with `id_slot` (else the server picks the slot, as `pick` says)."""
        if predicted is None:
            predicted = self._predict(slots, slot_id, prompt, slot_id if pinned else None)
        entry_id = predicted.entry_id
        if entry_id is None:
            self._claimed.pop(slot_id, None)
        else:
            self._claimed[slot_id] = entry_id

    def relabelled(self, first: int, second: int) -> None:
        """The table's records of slots `first` and `second` swapped ids (the server took
        another slot than predicted): what was kept by slot follows them."""
        for by_slot in (self._claimed, self._loads):
            one, two = by_slot.pop(first, None), by_slot.pop(second, None)
            if two is not None:
                by_slot[first] = two
            if one is not None:
                by_slot[second] = one

    def unclaim(self, slot_id: int) -> None:
        """The task placed on `slot_id` was sent (`dispatched` replays it) or never will be."""
        self._claimed.pop(slot_id, None)

    def keeps(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds all of `tokens` (as its prefix, or equal): a disk save of them
        is then redundant while the server runs."""
        if not tokens:
            return False
        wanted = tuple(tokens)
        # asked for every slot weighed: newest first, where an idle slot's copy is (the server
        # copies idle slots in at every launch)
        return any(is_prefix(wanted, entry.tokens) for entry in reversed(self.cache.entries()))

    def will_keep(
        self,
        slots: Sequence[ShadowSlot],
        slot_id: int,
        held: Sequence[int],
        prompt: Sequence[int],
    ) -> bool:
        """Whether, once `prompt` goes to `slot_id` (holding `held`), the RAM cache holds all of
        `held`: it does already, or the server saves the slot there before overwriting it; and,
        the budget being learnt, whether the server has shown it keeps as much as the shadow
        would then hold (else `held` may be gone when it is wanted back, a prefill)."""
        if not self._proves_room(self._size(len(held))):
            return False
        if self.keeps(held):
            return True
        views = self._views(_with_held(slots, slot_id, held))
        choice = self.cache.choose_slot(prompt, views, requested_slot_id=slot_id)
        limit = self.cache.limit_bytes
        return bool(held) and choice.save_slot and (limit <= 0 or self._size(len(held)) <= limit)

    def _proves_room(self, added_bytes: int) -> bool:
        """Whether the server has shown it keeps all the shadow holds with `added_bytes` more
        (a budget taken as a fact needs no showing)."""
        if self._learner is None:
            return True
        return self._learner.proves(self.cache.size_bytes() + added_bytes)

    # -- what happened ---------------------------------------------------------------------------

    def dispatched(
        self,
        slots: Sequence[ShadowSlot],
        slot_id: int,
        held: Sequence[int] | None,
        prompt: Sequence[int],
        pinned: bool = True,
    ) -> None:
        """A task with `prompt` went to idle `slot_id`, which held `held` (None: not known);
        `slots` are the others as they are now; `pinned`: sent with `id_slot` (else the server
        picked the slot, `slot_id` as `pick` said). Replays `get_available_slot` (save the
        slot, load a better entry) and then `cache_idle_slots` (every idle slot copied in)."""
        self._claimed.pop(slot_id, None)
        self._loads[slot_id] = None
        if held is None and not pinned:
            # an archive was restored there for it: the server takes that slot by similarity
            # and keeps it (a prompt-cache load would only replace it with less)
            self._copy_idle(slots, slot_id)
            return
        views = _with_held(slots, slot_id, held)
        requested = slot_id if pinned else None
        choice = self.cache.choose_slot(prompt, self._views(views), requested_slot_id=requested)
        if choice.save_slot and held:
            self._save(held, then_update=False)  # update() comes after the load (SC:1786)
        if choice.try_load:
            loaded = self.cache.load(tuple(held or ()), prompt)
            if loaded.entry_id is not None:
                if self._learner is not None and (pinned or not _others_busy(slots, slot_id)):
                    # (a task the server places beside others may find the entry taken by one
                    # whose launch came first there: its failure says nothing of the budget)
                    entries = self.cache.entries()
                    self._loads[slot_id] = self._learner.load_seen(
                        entries, loaded.entry_id, loaded.n_common
                    )
                self.cache.load_finished(loaded.entry_id, restored=True)
        if choice.save_slot or choice.try_load:
            self._update()
        self._copy_idle(slots, slot_id)

    def _copy_idle(self, slots: Sequence[ShadowSlot], launched: int) -> None:
        """SC:2641-2657: after the launch, every idle slot is copied into the cache."""
        for slot in slots:
            if slot.slot_id == launched or slot.busy or not slot.tokens:
                continue
            self._save(slot.tokens)

    def _save(self, tokens: Sequence[int], then_update: bool = True) -> None:
        """`prompt_save` of a slot holding `tokens`, then `update` if it was stored (as the
        idle-slot copy does, SC:2645-2649); what leaves for the budget is remembered."""
        before = self.cache.entries() if self._learner is not None else ()
        size = self._size(len(tokens))
        saved = self.cache.save(tuple(tokens), size)
        evicted = set(saved.evicted)
        if saved.stored and then_update:
            evicted.update(self.cache.update())
        self._remember_evicted(before, evicted, tuple(tokens))
        if saved.outcome == "skipped_too_large" and self._learner is not None:
            # over the shadow's budget: a server with a larger one keeps it (ST:1741-1746)
            self._learner.evicted([CacheEntry(EntryId(-1), tuple(tokens), size)])

    def _update(self) -> None:
        before = self.cache.entries() if self._learner is not None else ()
        self._remember_evicted(before, set(self.cache.update()), ())

    def _remember_evicted(
        self, before: Sequence[CacheEntry], evicted: set[Any], saved: tuple[int, ...]
    ) -> None:
        # an entry the new one holds whole left as obsolete, not for the budget (ST:1749-1759)
        if self._learner is not None and evicted:
            self._learner.evicted(
                entry
                for entry in before
                if entry.entry_id in evicted and not is_prefix(entry.tokens, saved)
            )

    def observed(
        self, prompt: Sequence[int], predicted: int, cache_n: int, slot_id: int | None = None
    ) -> bool:
        """The server reported `cache_n` for the task last sent to `slot_id` (None: not known)
        where the shadow predicted `predicted`; whether a load it replayed was not made, or an
        unforeseen one was. Less: the entry the shadow replayed loading had been evicted, so
        the server's budget is smaller than the shadow's. More: an entry served it; the shadow
        drops it (it was moved into the slot), or, if it was one the shadow had evicted for the
        budget, the server's budget is larger. As predicted, with a load: the server kept that
        much (the budget proven)."""
        seen = self._loads.pop(slot_id, None) if slot_id is not None else None
        if cache_n < predicted:
            missed = seen is not None and cache_n < seen.n_common
            if missed and self._learner is not None:
                self._learn(self._learner.shrunk(self.cache, seen))
            return missed
        if cache_n == predicted:
            # (a reuse the slot itself gave, short of the load's, shows nothing of the cache)
            cap = max(len(prompt) - 1, 0)
            if (
                seen is not None
                and self._learner is not None
                and cache_n >= min(seen.n_common, cap)
            ):
                self._learner.confirmed(seen)
            return False
        asked = tuple(prompt)  # as the entries' are: compared without a copy each
        for entry in self.cache.entries():
            if common_prefix_length(entry.tokens, asked) >= cache_n:
                self.cache.load_finished(entry.entry_id, restored=True)
                return True
        if self._learner is not None:
            self._learn(self._learner.grown(self.cache, prompt, cache_n))
        return True

    def _learn(self, rebuilt: Any | None) -> None:
        """Follow the cache rebuilt at a learnt budget (None: no change); claims follow their
        entries to their new ids, and go where an entry did not stay."""
        if rebuilt is None:
            return
        old = {entry.entry_id: entry.tokens for entry in self.cache.entries()}
        new = entry_ids_by_tokens(rebuilt.entries())
        self.cache = rebuilt
        for slot_id, entry_id in list(self._claimed.items()):
            moved = new.get(old.get(entry_id, ()))
            if moved is None:
                del self._claimed[slot_id]
            else:
                self._claimed[slot_id] = moved

    def reset(self) -> None:
        """The server restarted: its RAM cache is empty (the budget learnt stays as the best
        guess, the same server being likely started with the same flags; what was proven of it
        goes, the new process has shown nothing yet)."""
        self._claimed.clear()
        self._loads.clear()
        if self._learner is not None:
            self._learner.forget()
        for entry in self.cache.entries():
            self.cache.load_finished(entry.entry_id, restored=True)


def _with_held(
    slots: Sequence[ShadowSlot], slot_id: int, held: Sequence[int] | None
) -> list[ShadowSlot]:
    """`slots`, with `slot_id` idle and holding `held`, as the server finds it for the task."""
    return [s if s.slot_id != slot_id else ShadowSlot(slot_id, held, False) for s in slots]


def _others_busy(slots: Sequence[ShadowSlot], slot_id: int) -> bool:
    for slot in slots:
        if slot.busy and slot.slot_id != slot_id:
            return True
    return False
