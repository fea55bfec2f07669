"""A RAM prompt cache that keeps entries when they are used, evicts the least recently used one,
and finds the longest cached prefix of a prompt through a token trie.

Unlike llama-server's cache (`prompt_cache_llama_server`), an entry stays cached after a restore,
so several slots and later turns can reuse the same prefix, and eviction follows use rather than
insertion. `LruPrefixCache` holds the policy; the index that answers "longest cached prefix" is
pluggable: here a plain trie with one node per cached token (simple, memory grows with the
tokens cached), in `prompt_cache_radix` a compressed one.

Rules shared by both:

- No entry is a prefix of another: a prompt some entry already extends is not stored again (that
  entry is touched instead), and storing a prompt drops the entry it extends. Every entry thus
  ends at a leaf of the index, and a restored longer entry serves any of its prefixes (the engine
  truncates the slot to the common prefix, as it does for any slot).
- load() returns the entry with the longest common prefix with the task, if that is longer than
  what the slot itself shares with the task; among equally long matches, the most recently used.
- Eviction: least recently used first, until the new state fits in the byte budget. A save, a
  skipped save of an already cached prompt, and a successful restore count as a use.
- Slot choice: the idle slot sharing the longest prefix with the task, if that prefix covers more
  than `slot_prompt_similarity` of the task (ties: fewer tokens lost, then least recently used,
  then lowest id); otherwise the least recently used idle slot (never used first, ties lowest id).
  The slot is saved first whenever the task would drop some of its tokens, and load() is always
  consulted, an explicitly requested empty slot included. A requested busy slot is deferred with
  no cache action, unlike llama-server.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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
from cacheproxy.tokens import common_prefix_length

MIB = 1 << 20
SHRINK_LIMIT_FACTOR_ON_ALLOC_FAILURE = 0.4  # as llama-server reacts to std::bad_alloc (ST:1781)

# (last use, entry): tuples compare by last use first, so max() finds the most recent entry.
Stamped = tuple[int, EntryId]


class LruPrefixCacheOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    limit_bytes: int = Field(
        8192 * MIB, ge=-1, description="byte budget: -1 no limit, 0 no RAM cache at all"
    )
    slot_prompt_similarity: float = Field(
        0.10,
        ge=0.0,
        le=1.0,
        description="reuse a slot for its prefix only if that covers more of the task than this",
    )
    cache_idle_slots: bool = Field(True, description="save idle slots whenever a task launches")
    kv_unified: bool = Field(False, description="clear idle slots after saving them")


@dataclass(frozen=True)
class PrefixMatch:
    depth: int  # the longest prefix of the tokens that some entry shares
    entry_id: EntryId | None  # the most recently used entry sharing it; None if the index is empty


class PrefixIndex(Protocol):
    """Token sequences with no one a prefix of another, each carrying an entry and its last use."""

    def insert(self, tokens: Sequence[int], entry: Stamped) -> None:
        """Add an entry; its last use is newer than any other entry's."""
        ...

    def remove(self, tokens: Sequence[int]) -> None: ...

    def touch(self, tokens: Sequence[int], entry: Stamped) -> None:
        """Record a last use of the entry at `tokens`, newer than any other entry's."""
        ...

    def match(self, tokens: Sequence[int]) -> PrefixMatch: ...

    def node_count(self) -> int: ...


@dataclass
class _Entry:
    entry_id: EntryId
    tokens: tuple[int, ...]
    size_bytes: int
    last_used: int


class LruPrefixCache:
    """The policy shared by the trie and radix caches; see the module docstring for its rules."""

    Options = LruPrefixCacheOptions

    def __init__(self, options: LruPrefixCacheOptions, index: PrefixIndex) -> None:
        self.options = options
        self._enabled = options.limit_bytes != 0
        self._limit_bytes = max(options.limit_bytes, 0)  # 0: no limit
        self._index = index
        # Least recently used first: the next entry to evict is at the front.
        self._entries: OrderedDict[EntryId, _Entry] = OrderedDict()
        self._size_bytes = 0
        self._clock = 0  # a logical clock: decisions must not depend on wall time
        self._next_entry_id = 0

    # ----------------------------------------------------------------------------- introspection

    @property
    def limit_bytes(self) -> int:
        return self._limit_bytes

    def entries(self) -> tuple[CacheEntry, ...]:
        return tuple(
            CacheEntry(entry.entry_id, entry.tokens, entry.size_bytes)
            for entry in self._entries.values()
        )

    def size_bytes(self) -> int:
        return self._size_bytes

    def node_count(self) -> int:
        return self._index.node_count()

    # ------------------------------------------------------------------------------ slot choice

    def choose_slot(
        self,
        task_tokens: Sequence[int],
        slots: Sequence[SlotView],
        *,
        requested_slot_id: int | None = None,
    ) -> SlotChoice:
        slots_by_id = sorted(slots, key=lambda slot: slot.id)
        chosen: SlotView | None = None
        selected_by: SlotSelection = "none"
        if requested_slot_id not in (None, -1) and slots_by_id:
            # Wraps like llama-server (SC:1655), so the same id names the same slot in both.
            chosen = slot_by_requested_id(slots_by_id, requested_slot_id)
            selected_by = "requested"
        else:
            chosen, selected_by = self._slot_by_longest_prefix(task_tokens, slots_by_id)
            if chosen is None:
                chosen, selected_by = self._least_recently_used(slots_by_id)

        if chosen is None:
            return SlotChoice(None, "none", must_defer=True, save_slot=False, try_load=False)
        n_common = common_prefix_length(chosen.tokens, task_tokens)
        # Never touch a busy slot's KV: its task is running.
        usable = self._enabled and not chosen.busy
        return SlotChoice(
            slot_id=chosen.id,
            selected_by=selected_by,
            must_defer=chosen.busy,
            # Saving is needed only when the task would cut the slot short; a copy of a slot the
            # task merely extends would be redundant.
            save_slot=usable and n_common < len(chosen.tokens),
            try_load=usable,
            f_sim=n_common / len(task_tokens) if task_tokens else 0.0,
            f_keep=n_common / len(chosen.tokens) if chosen.tokens else float("nan"),
        )

    def _slot_by_longest_prefix(
        self, task_tokens: Sequence[int], slots_by_id: Sequence[SlotView]
    ) -> tuple[SlotView | None, SlotSelection]:
        best: SlotView | None = None
        best_key: tuple[int, int, int, int] | None = None
        for slot in slots_by_id:
            if slot.busy or slot.empty:
                continue
            n_common = common_prefix_length(slot.tokens, task_tokens)
            # Longest prefix; then the fewest tokens lost; then least recently used; then
            # lowest id. Larger keys win, hence the negations.
            key = (n_common, -(len(slot.tokens) - n_common), -slot.t_last_used, -slot.id)
            if best_key is None or key > best_key:
                best, best_key = slot, key
        if best is None or best_key is None or not task_tokens:
            return None, "none"
        # Strict, like llama-server's -sps: a shared BOS alone should not decide.
        if best_key[0] / len(task_tokens) > self.options.slot_prompt_similarity:
            return best, "longest_prefix"
        return None, "none"

    @staticmethod
    def _least_recently_used(
        slots_by_id: Sequence[SlotView],
    ) -> tuple[SlotView | None, SlotSelection]:
        idle = [slot for slot in slots_by_id if not slot.busy]
        if not idle:
            return None, "none"
        # Never-used slots (-1) first; ties go to the lowest id.
        return min(idle, key=lambda slot: (slot.t_last_used, slot.id)), "lru"

    # ------------------------------------------------------------------------------------ save

    def save(self, slot_tokens: Sequence[int], state_size_bytes: int) -> SaveDecision:
        if not self._enabled:
            return SaveDecision("cache_disabled")
        tokens = tuple(slot_tokens)
        if not tokens:
            return SaveDecision("skipped_empty")

        found = self._index.match(tokens)
        if found.depth == len(tokens) and found.entry_id is not None:
            # Some entry extends (or equals) the prompt and already serves it: refresh it.
            self._touch(self._entries[found.entry_id])
            return SaveDecision("skipped_already_cached")
        if self._limit_bytes > 0 and state_size_bytes > self._limit_bytes:
            return SaveDecision("skipped_too_large")  # would only flush the cache for nothing

        evicted: list[EntryId] = []
        # The one entry that may be a prefix of the prompt ends at the match point: the new entry
        # extends it and replaces it (entries never nest, so there is at most one).
        if found.entry_id is not None and len(self._entries[found.entry_id].tokens) == found.depth:
            evicted.append(self._remove(found.entry_id))
        if self._limit_bytes > 0:
            # Make room first so the budget holds even while the engine copies the state.
            while self._entries and self._size_bytes + state_size_bytes > self._limit_bytes:
                evicted.append(self._remove(next(iter(self._entries))))

        entry_id = EntryId(self._next_entry_id)
        self._next_entry_id += 1
        entry = _Entry(entry_id, tokens, state_size_bytes, self._tick())
        self._entries[entry_id] = entry
        self._size_bytes += state_size_bytes
        self._index.insert(tokens, (entry.last_used, entry_id))
        return SaveDecision("stored", entry_id, tuple(evicted))

    def allocation_failed(self, entry_id: EntryId) -> tuple[EntryId, ...]:
        """Forget the entry; RAM is tighter than configured, so shrink the budget to 40% of what
        is cached (at least 1 byte), as llama-server does (ST:1781), and evict down to it."""
        if entry_id in self._entries:
            self._remove(entry_id)
        self._limit_bytes = max(1, int(SHRINK_LIMIT_FACTOR_ON_ALLOC_FAILURE * self._size_bytes))
        return self.update()

    # ------------------------------------------------------------------------------------ load

    def load(self, slot_tokens: Sequence[int], task_tokens: Sequence[int]) -> LoadDecision:
        if not self._enabled or not task_tokens:
            return LoadDecision()
        found = self._index.match(task_tokens)
        if found.entry_id is None:
            return LoadDecision()
        # Restore only if the entry gives the task more than the slot already does.
        if found.depth <= common_prefix_length(slot_tokens, task_tokens):
            return LoadDecision()
        entry = self._entries[found.entry_id]
        return LoadDecision(entry.entry_id, entry.tokens, found.depth)

    def load_finished(self, entry_id: EntryId, restored: bool) -> None:
        """Entries stay cached either way; a successful restore counts as a use."""
        entry = self._entries.get(entry_id)
        if restored and entry is not None:
            self._touch(entry)

    # ---------------------------------------------------------------------------------- limits

    def update(self) -> tuple[EntryId, ...]:
        """Evict least recently used entries while over the byte budget (there is no token
        limit: bytes are what runs out)."""
        evicted: list[EntryId] = []
        if self._limit_bytes > 0:
            while self._entries and self._size_bytes > self._limit_bytes:
                evicted.append(self._remove(next(iter(self._entries))))
        return tuple(evicted)

    def idle_slots_to_cache(self, slots: Sequence[SlotView]) -> IdleSlotPlan:
        """As llama-server's cache_idle_slots (SC:2641-2657): idle slots are saved after a launch,
        and cleared as well when the KV pool is unified and their room helps other slots."""
        if not (self._enabled and self.options.cache_idle_slots):
            return IdleSlotPlan()
        return IdleSlotPlan(non_empty_idle_slot_ids(slots), self.options.kv_unified)

    # --------------------------------------------------------------------------------- helpers

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, entry: _Entry) -> None:
        entry.last_used = self._tick()
        self._entries.move_to_end(entry.entry_id)
        self._index.touch(entry.tokens, (entry.last_used, entry.entry_id))

    def _remove(self, entry_id: EntryId) -> EntryId:
        entry = self._entries.pop(entry_id)
        self._size_bytes -= entry.size_bytes
        self._index.remove(entry.tokens)
        return entry_id


class _TrieNode:
    __slots__ = ("children", "entry", "newest")

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}
        self.entry: Stamped | None = None  # the entry whose tokens end here
        self.newest: Stamped | None = None  # the most recently used entry in this subtree

    def recompute_newest(self) -> None:
        self.newest = newest_below(self.entry, self.children.values())


def newest_below(entry: Stamped | None, children: Iterable[Any]) -> Stamped | None:
    """The most recently used entry at a node or in its children's subtrees (trie or radix)."""
    candidates = [child.newest for child in children if child.newest]
    if entry is not None:
        candidates.append(entry)
    return max(candidates) if candidates else None


class TokenTrie:
    """One node per token. Each node knows the most recently used entry below it, so a lookup
    walks the prompt once and never visits other entries."""

    def __init__(self) -> None:
        self._root = _TrieNode()
        self._node_count = 1

    def node_count(self) -> int:
        return self._node_count

    def insert(self, tokens: Sequence[int], entry: Stamped) -> None:
        node = self._root
        path = [node]
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _TrieNode()
                self._node_count += 1
            node = child
            path.append(node)
        node.entry = entry
        self._mark_newest(path, entry)

    def touch(self, tokens: Sequence[int], entry: Stamped) -> None:
        path = self._path(tokens)
        path[-1].entry = entry
        self._mark_newest(path, entry)

    def remove(self, tokens: Sequence[int]) -> None:
        path = self._path(tokens)
        path[-1].entry = None
        # Bottom-up: drop nodes left with nothing below them, and refresh the newest entry of the
        # rest (the removed one may have been it).
        for depth in range(len(tokens), -1, -1):
            node = path[depth]
            if depth > 0 and node.entry is None and not node.children:
                del path[depth - 1].children[tokens[depth - 1]]
                self._node_count -= 1
            else:
                node.recompute_newest()

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        node = self._root
        depth = 0
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                break
            node = child
            depth += 1
        return PrefixMatch(depth, node.newest[1] if node.newest else None)

    def _path(self, tokens: Sequence[int]) -> list[_TrieNode]:
        node = self._root
        path = [node]
        for token in tokens:
            node = node.children[token]
            path.append(node)
        return path

    @staticmethod
    def _mark_newest(path: list[_TrieNode], entry: Stamped) -> None:
        # The entry was just used, so it is the newest of every subtree on its path: O(length).
        for node in path:
            node.newest = entry


class LruTriePromptCache(LruPrefixCache):
    """Entries kept on use, least recently used evicted, longest prefix found through a trie."""

    Options = LruPrefixCacheOptions

    def __init__(self, options: LruPrefixCacheOptions, deps: PromptCacheDeps | None = None) -> None:
        super().__init__(options, TokenTrie())
