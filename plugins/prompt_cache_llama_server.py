"""llama-server's own RAM prompt cache and slot choice, rule for rule, as a pure policy.

Mirrors `server_prompt_cache` (ST:1702-1912) and its use by slots (SC:308-341, SC:1680-1793,
SC:2641-2657) in the pinned llama.cpp; see `cacheproxy.prompt_cache` for the
abbreviations and the order in which an engine calls the methods. What it does, in short:

- a slot is picked by prompt similarity over idle non-empty slots, else the least recently used;
- a slot about to lose more than half of itself is saved first, then replaced by a cached entry
  that keeps more of the entry *and* covers more of the task than the slot does;
- a restored entry leaves the cache; entries are evicted first in, first out.

The comparisons are done in float32 like the C++, so values on a boundary (a similarity of exactly
the threshold, a kept fraction of exactly one half) fall on the same side as in llama-server.
"""

from __future__ import annotations

import copy
import math
import struct
from collections import OrderedDict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from cacheproxy.prompt_cache import (
    CacheEntry,
    EntryId,
    IdleSlotPlan,
    LoadDecision,
    PromptCacheDeps,
    SaveDecision,
    SlotChoice,
    SlotSelection,
    SlotView,
    non_empty_idle_slot_ids,
    slot_by_requested_id,
)
from cacheproxy.tokens import common_prefix_length, is_prefix

MIB = 1 << 20

# Thresholds as float32 literals, as written in the C++.
KEEP_FRACTION_TO_SKIP_SAVE = 0.5  # SC:1739 `f_keep < 0.5f` -> save the slot first
MIN_ENTRY_KEEP_FRACTION = 0.25  # ST:1824 `f_keep_cur < 0.25f` -> entry ignored by load
SHRINK_LIMIT_FACTOR_ON_ALLOC_FAILURE = 0.4  # ST:1781, a double in the C++


def _f32(value: float) -> float:
    """Round to the nearest float32, as a C++ `float` holds it."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _f32_div(numerator: float, denominator: float) -> float:
    """`float(numerator) / denominator` in C++: float32 operands and result, x/0 is inf or NaN.

    A double quotient of two float32 values rounds to the same float32 as a float32 division.
    """
    num, den = _f32(numerator), _f32(denominator)
    if den == 0.0:
        if num == 0.0 or math.isnan(num):
            return math.nan
        return math.copysign(math.inf, num)
    return _f32(num / den)


def _f32_mul(left: float, right: float) -> float:
    return _f32(_f32(left) * _f32(right))


class LlamaServerPromptCache:
    """The `--cache-ram` prompt cache of llama-server, with its slot choice and idle-slot saving."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        limit_bytes: int = Field(
            8192 * MIB,
            ge=-1,
            description="like --cache-ram but in bytes: -1 no byte limit, 0 no RAM cache at all",
        )
        limit_tokens: int | None = Field(
            None,
            ge=0,
            description="soft token limit; None: the engine's total n_ctx as llama-server derives "
            "it (SC:1492); 0: none",
        )
        slot_prompt_similarity: float = Field(
            0.10, ge=0.0, le=1.0, description="-sps; 0 turns the similarity scan off"
        )
        cache_idle_slots: bool = Field(
            True, description="--cache-idle-slots: save idle slots whenever a task launches"
        )
        kv_unified: bool = Field(
            False, description="-kvu: idle slots are also cleared after they are saved"
        )

    def __init__(self, options: Options, deps: PromptCacheDeps | None = None) -> None:
        self.options = options
        # `--cache-ram 0` creates no cache at all (SC:1484); -1 creates one without a byte limit,
        # which the C++ stores as limit_size 0 (server-task.h:654).
        self._enabled = options.limit_bytes != 0
        self._limit_bytes = max(options.limit_bytes, 0)
        if options.limit_tokens is not None:
            self._limit_tokens = options.limit_tokens
        else:
            self._limit_tokens = deps.n_ctx if deps is not None else 0
        self._similarity_threshold = _f32(options.slot_prompt_similarity)  # a float in the C++
        # Insertion order is eviction order: a std::list, push_back / pop_front (server-task.h:658).
        # the entries as the interface shows them: frozen, so `entries()` hands them out as they
        # are (the RAM-cache shadow asks for them for every slot it weighs)
        self._entries: OrderedDict[EntryId, CacheEntry] = OrderedDict()
        self._next_entry_id = 0

    # ----------------------------------------------------------------------------- introspection

    @property
    def limit_bytes(self) -> int:
        """The current byte limit, 0 for none; an allocation failure lowers it (ST:1781)."""
        return self._limit_bytes

    @property
    def limit_tokens(self) -> int:
        return self._limit_tokens

    def entries(self) -> tuple[CacheEntry, ...]:
        return tuple(self._entries.values())

    def size_bytes(self) -> int:
        return sum(entry.size_bytes for entry in self._entries.values())  # ST:1702-1710

    def n_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self._entries.values())  # ST:1712-1720

    def copy(self) -> LlamaServerPromptCache:
        """An independent copy (entries are immutable and shared): to try an event ahead."""
        twin = copy.copy(self)
        twin._entries = OrderedDict(self._entries)
        return twin

    # ------------------------------------------------------------------------------ slot choice

    def choose_slot(
        self,
        task_tokens: Sequence[int],
        slots: Sequence[SlotView],
        *,
        requested_slot_id: int | None = None,
    ) -> SlotChoice:
        """`get_available_slot` (SC:1680-1793).

        llama-server runs the save and load even when an explicitly requested slot is busy and
        the task is about to be deferred (nothing guards SC:1769-1790), overwriting a running
        slot. The flags below say what llama-server does; an engine should not act on them while
        `must_defer` is set.
        """
        task_tokens = _as_tuple(task_tokens)  # the slots' tokens are: compared without a copy
        slots_by_id = sorted(slots, key=lambda slot: slot.id)  # the C++ scans slots in id order
        requested = None if requested_slot_id in (None, -1) else requested_slot_id  # -1 = none
        chosen: SlotView | None = None
        selected_by: SlotSelection = "none"
        update_cache = False
        f_sim_best = 0.0
        f_keep = math.nan

        if requested is not None and slots_by_id:
            # Honoured even when busy (SC:1686-1691), by llama-server's wrapping rule
            chosen = slot_by_requested_id(slots_by_id, requested)
            selected_by = "requested"

        if self._similarity_threshold != 0.0:  # SC:1694: -sps 0 turns the scan off
            for slot in slots_by_id:
                # The raw requested id, not the wrapped one (SC:1698): out of range matches none.
                if requested is not None and slot.id != requested:
                    continue
                if slot.busy or slot.empty:  # SC:1703-1714
                    continue
                n_common = common_prefix_length(slot.tokens, task_tokens)
                f_sim = _f32_div(n_common, len(task_tokens))  # SC:1717-1718
                # Both strict (SC:1723): on a tie the lowest id keeps the place.
                if f_sim > f_sim_best and f_sim > self._similarity_threshold:
                    f_sim_best = f_sim
                    chosen = slot
                    selected_by = "requested" if requested is not None else "similarity"

            if chosen is not None:
                # Kept fraction of the slot, recomputed from f_sim in float32 (SC:1731). With an
                # explicitly requested slot the scan may not have matched: f_sim_best is 0, so
                # f_keep is 0 (save), or 0/0 = NaN for an empty slot, and `NaN < 0.5` is false:
                # the cache is not consulted at all for an explicit empty slot.
                f_keep = _f32_div(_f32_mul(f_sim_best, len(task_tokens)), len(chosen.tokens))
                if f_keep < KEEP_FRACTION_TO_SKIP_SAVE:  # SC:1739-1741
                    update_cache = True

        if chosen is None:
            # LRU fallback, reached only without an explicit id (SC:1746-1767). `<=` lets a
            # later slot with the same t_last_used win, so on ties the highest id is taken and
            # never-used slots (-1) come first.
            t_last = -1
            for slot in slots_by_id:
                if slot.busy:
                    continue
                if chosen is None or slot.t_last_used <= t_last:
                    t_last = slot.t_last_used
                    chosen = slot
            if chosen is not None:
                selected_by = "lru"
                update_cache = True  # SC:1765

        # No cache, no cache update (SC:1770). Only completion tasks reach an engine's cache
        # (SC:1773); embeddings and reranking should not ask this policy.
        update_cache = update_cache and self._enabled
        return SlotChoice(
            slot_id=chosen.id if chosen is not None else None,
            selected_by=selected_by,
            must_defer=chosen is None or chosen.busy,  # SC:2609-2620
            save_slot=update_cache,
            try_load=update_cache,
            f_sim=f_sim_best,
            f_keep=f_keep,
        )

    # ------------------------------------------------------------------------------------ save

    def save(self, slot_tokens: Sequence[int], state_size_bytes: int) -> SaveDecision:
        """`prompt_save` + `server_prompt_cache::alloc` (SC:308-332, ST:1722-1802).

        `state_size_bytes` is the whole state the entry will hold: target model, draft model and
        context checkpoints (ST:1733-1739).
        """
        if not self._enabled:
            return SaveDecision("cache_disabled")
        tokens = tuple(slot_tokens)
        if not tokens:  # SC:309-311
            return SaveDecision("skipped_empty")

        # An entry that holds the whole prompt as its prefix (or equal) makes a copy pointless.
        # It is checked before the size, so it wins even for an over-limit state (ST:1724-1731).
        for entry in self._entries.values():
            if is_prefix(tokens, entry.tokens):
                return SaveDecision("skipped_already_cached")

        # Strict `>`: a state of exactly the limit is stored, after emptying the cache
        # (ST:1742-1746). An over-limit state evicts nothing: it would only flush the cache.
        if self._limit_bytes > 0 and state_size_bytes > self._limit_bytes:
            return SaveDecision("skipped_too_large")

        evicted: list[EntryId] = []
        # Entries the new prompt fully contains are obsolete (ST:1749-1759).
        for entry in list(self._entries.values()):
            if is_prefix(entry.tokens, tokens):
                evicted.append(self._remove(entry.entry_id))

        # Oldest first until the new state fits, before allocating it (ST:1761-1768).
        if self._limit_bytes > 0:
            while self._entries and self.size_bytes() + state_size_bytes > self._limit_bytes:
                evicted.append(self._pop_oldest())

        entry_id = EntryId(self._next_entry_id)
        self._next_entry_id += 1
        self._entries[entry_id] = CacheEntry(entry_id, tokens, state_size_bytes)  # ST:1790-1800
        return SaveDecision("stored", entry_id, tuple(evicted))

    def allocation_failed(self, entry_id: EntryId) -> tuple[EntryId, ...]:
        """The engine could not allocate the entry save() just stored (ST:1772-1788).

        llama-server catches std::bad_alloc before pushing the entry, so the entry never existed;
        the limit drops to 40% of what the cache holds (at least 1 byte, even when there was no
        limit before), and update() runs under the new limit.
        """
        self._entries.pop(entry_id, None)
        self._limit_bytes = max(1, int(SHRINK_LIMIT_FACTOR_ON_ALLOC_FAILURE * self.size_bytes()))
        return self.update()

    # ------------------------------------------------------------------------------------ load

    def load(self, slot_tokens: Sequence[int], task_tokens: Sequence[int]) -> LoadDecision:
        """`server_prompt_cache::load` (ST:1804-1879): which entry to restore into the slot."""
        if not self._enabled:
            return LoadDecision()
        task_tokens = _as_tuple(task_tokens)  # as the entries' are: compared without a copy
        n_common_slot = common_prefix_length(slot_tokens, task_tokens)
        # The slot's own content is the entry to beat; an empty slot starts at -1 so that any
        # entry's kept fraction wins (ST:1807).
        f_keep_best = _f32_div(n_common_slot, len(slot_tokens)) if slot_tokens else -1.0
        f_sim_best = _f32_div(n_common_slot, len(task_tokens))

        best: CacheEntry | None = None
        best_common = 0
        for entry in self._entries.values():  # oldest first: on a tie the oldest wins
            n_common = common_prefix_length(entry.tokens, task_tokens)
            f_keep = _f32_div(n_common, len(entry.tokens))  # ST:1816-1819
            f_sim = _f32_div(n_common, len(task_tokens))
            # "don't trash large prompts": an entry keeping under a quarter of itself is never
            # taken, since it would leave the cache for little gain (ST:1823-1826).
            if f_keep < MIN_ENTRY_KEEP_FRACTION:
                continue
            # Both strictly better (ST:1828). A slot that is a full prefix of the task has
            # f_keep 1 and can never be beaten, however much longer a cached entry matches.
            if f_keep_best < f_keep and f_sim_best < f_sim:
                f_keep_best, f_sim_best = f_keep, f_sim
                best, best_common = entry, n_common

        if best is None:
            return LoadDecision()
        return LoadDecision(best.entry_id, best.tokens, best_common)

    def load_finished(self, entry_id: EntryId, restored: bool) -> None:
        """A restored entry is moved out of the cache (ST:1873-1875); a failed restore returns
        early and leaves it in place (ST:1843-1848), and the slot is then cleared (SC:1782-1784).
        An id no longer cached is ignored."""
        if restored:
            self._entries.pop(entry_id, None)

    # ---------------------------------------------------------------------------------- limits

    def update(self) -> tuple[EntryId, ...]:
        """`server_prompt_cache::update` (ST:1881-1903): bytes are a hard limit, tokens soft."""
        evicted: list[EntryId] = []
        if self._limit_bytes > 0:  # ST:1882-1888
            while self._entries and self.size_bytes() > self._limit_bytes:
                evicted.append(self._pop_oldest())

        # Measured bytes per token, at least 1 (ST:1891), all in float32.
        bytes_per_token = max(1.0, _f32_div(self.size_bytes(), max(1, self.n_tokens())))
        # The token limit is raised to whatever the byte limit holds at that rate (ST:1894),
        # truncated to an integer as the float -> size_t conversion does. Without a byte limit
        # it stays as configured: `--cache-ram -1` still caps the cache at n_ctx tokens.
        if self._limit_bytes > 0:
            limit_tokens_now = max(
                self._limit_tokens, int(_f32_div(self._limit_bytes, bytes_per_token))
            )
        else:
            limit_tokens_now = self._limit_tokens
        if self._limit_tokens > 0:  # ST:1896-1902
            while self._entries and self.n_tokens() > limit_tokens_now:
                evicted.append(self._pop_oldest())
        return tuple(evicted)

    # ------------------------------------------------------------------------------ idle slots

    def idle_slots_to_cache(self, slots: Sequence[SlotView]) -> IdleSlotPlan:
        """`cache_idle_slots` after a task launched (SC:2641-2657); `slots` as after the launch.

        Every idle slot is saved, and with a unified KV cache cleared too, even when its save was
        skipped (too large for the cache: its tokens are then simply lost). Without unified KV a
        clear frees no room usable by other slots, so the slots keep their KV (SC:1558-1565).
        Needs a RAM cache: without one the option is turned off (SC:1553-1557).
        """
        if not (self._enabled and self.options.cache_idle_slots):
            return IdleSlotPlan()
        return IdleSlotPlan(non_empty_idle_slot_ids(slots), self.options.kv_unified)

    # --------------------------------------------------------------------------------- helpers

    def _remove(self, entry_id: EntryId) -> EntryId:
        del self._entries[entry_id]
        return entry_id

    def _pop_oldest(self) -> EntryId:
        entry_id, _ = self._entries.popitem(last=False)
        return entry_id


def _as_tuple(tokens: Sequence[int]) -> tuple[int, ...]:
    return tokens if isinstance(tokens, tuple) else tuple(tokens)
