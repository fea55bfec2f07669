"""The LRU trie and radix prompt caches: longest-prefix lookups and LRU eviction checked against a
brute-force model on random traces, plus their slot choice and the radix tree's shape."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from cacheproxy_plugins.prompt_cache_lru_trie import LruPrefixCache, LruTriePromptCache
from cacheproxy_plugins.prompt_cache_radix import RadixPromptCache, RadixTree

from cacheproxy.prompt_cache import (
    EntryId,
    LoadDecision,
    PromptCachePolicy,
    SaveDecision,
    SlotView,
)
from cacheproxy.tokens import common_prefix_length

POLICIES = [LruTriePromptCache, RadixPromptCache]


def make_cache(policy_class: type[LruPrefixCache], **options: Any) -> LruPrefixCache:
    return policy_class(policy_class.Options(**options), None)


def slot(slot_id: int, content: Sequence[int] = (), busy: bool = False, t: int = -1) -> SlotView:
    return SlotView(id=slot_id, tokens=tuple(content), busy=busy, t_last_used=t)


def stored(cache: LruPrefixCache, content: Sequence[int], size: int = 10) -> EntryId:
    decision = cache.save(content, size)
    assert decision.stored and decision.entry_id is not None
    return decision.entry_id


def check_shape(cache: LruPrefixCache) -> None:
    index = cache._index
    if isinstance(index, RadixTree):
        index.check_invariants()
        # Compressed: every inner node but the root branches and every entry is a leaf.
        assert index.node_count() <= 2 * len(cache.entries()) + 1


@dataclass
class ModelEntry:
    tokens: tuple[int, ...]
    size: int
    last_used: int


class BruteForceModel:
    """The documented rules with lists and full scans, no index."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.entries: dict[EntryId, ModelEntry] = {}
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def size(self) -> int:
        return sum(entry.size for entry in self.entries.values())

    def least_recent(self) -> EntryId:
        return min(self.entries, key=lambda entry_id: self.entries[entry_id].last_used)

    def save(self, tokens: tuple[int, ...], size: int, new_id: EntryId | None) -> tuple[str, set]:
        if not tokens:
            return "skipped_empty", set()
        containing = [e for e in self.entries if self.entries[e].tokens[: len(tokens)] == tokens]
        if containing:
            newest = max(containing, key=lambda e: self.entries[e].last_used)
            self.entries[newest].last_used = self.tick()
            return "skipped_already_cached", set()
        if size > self.limit_bytes:
            return "skipped_too_large", set()
        evicted = {
            e
            for e in self.entries
            if tokens[: len(self.entries[e].tokens)] == self.entries[e].tokens
        }
        for entry_id in evicted:
            del self.entries[entry_id]
        while self.entries and self.size() + size > self.limit_bytes:
            victim = self.least_recent()
            del self.entries[victim]
            evicted.add(victim)
        assert new_id is not None
        self.entries[new_id] = ModelEntry(tokens, size, self.tick())
        return "stored", evicted

    def load(
        self, slot_tokens: tuple[int, ...], task: tuple[int, ...]
    ) -> tuple[EntryId | None, int]:
        if not self.entries:
            return None, 0
        best = max(
            self.entries,
            key=lambda e: (
                common_prefix_length(self.entries[e].tokens, task),
                self.entries[e].last_used,
            ),
        )
        n_common = common_prefix_length(self.entries[best].tokens, task)
        if n_common <= common_prefix_length(slot_tokens, task):
            return None, 0
        return best, n_common

    def finish(self, entry_id: EntryId, restored: bool) -> None:
        if restored and entry_id in self.entries:
            self.entries[entry_id].last_used = self.tick()

    def allocation_failed(self, entry_id: EntryId) -> set:
        self.entries.pop(entry_id, None)
        self.limit_bytes = max(1, int(0.4 * self.size()))
        evicted = set()
        while self.entries and self.size() > self.limit_bytes:
            victim = self.least_recent()
            del self.entries[victim]
            evicted.add(victim)
        return evicted


def random_tokens(rng: random.Random) -> tuple[int, ...]:
    # A tiny alphabet and short sequences so that prefixes are shared, nested and split often.
    return tuple(rng.randrange(3) for _ in range(rng.randrange(0, 9)))


@pytest.mark.parametrize("policy_class", POLICIES)
@pytest.mark.parametrize("seed", range(12))
def test_random_traces_match_the_brute_force_model(
    policy_class: type[LruPrefixCache], seed: int
) -> None:
    rng = random.Random(seed)
    cache = make_cache(policy_class, limit_bytes=100)
    model = BruteForceModel(limit_bytes=100)
    for _ in range(400):
        operation = rng.random()
        if operation < 0.45:
            content, size = random_tokens(rng), rng.randrange(1, 45)
            decision: SaveDecision = cache.save(content, size)
            outcome, evicted = model.save(content, size, decision.entry_id)
            assert (decision.outcome, set(decision.evicted)) == (outcome, evicted)
            if decision.stored and decision.entry_id is not None and rng.random() < 0.05:
                assert set(cache.allocation_failed(decision.entry_id)) == (
                    model.allocation_failed(decision.entry_id)
                )
        else:
            slot_tokens, task = random_tokens(rng), random_tokens(rng)
            found: LoadDecision = cache.load(slot_tokens, task)
            expected_id, expected_common = model.load(slot_tokens, task)
            assert (found.entry_id, found.n_common) == (expected_id, expected_common)
            if found.entry_id is not None:
                assert common_prefix_length(found.tokens, task) == found.n_common
                restored = rng.random() < 0.8
                cache.load_finished(found.entry_id, restored)
                model.finish(found.entry_id, restored)

        # Same entries, same least-recent-first order, never over budget.
        expected_order = sorted(model.entries, key=lambda e: model.entries[e].last_used)
        assert [entry.entry_id for entry in cache.entries()] == expected_order
        assert cache.size_bytes() == model.size() <= cache.limit_bytes
        check_shape(cache)


@pytest.mark.parametrize("policy_class", POLICIES)
def test_it_is_a_prompt_cache_policy(policy_class: type[LruPrefixCache]) -> None:
    assert isinstance(make_cache(policy_class), PromptCachePolicy)


@pytest.mark.parametrize("policy_class", POLICIES)
def test_longest_prefix_wins_whatever_the_insertion_order(
    policy_class: type[LruPrefixCache],
) -> None:
    cache = make_cache(policy_class)
    short = stored(cache, [1, 2, 9])
    longest = stored(cache, [1, 2, 3, 4, 8])
    stored(cache, [1, 2, 3, 7])
    stored(cache, [5, 6])
    found = cache.load([], [1, 2, 3, 4, 5, 6])
    assert (found.entry_id, found.n_common, found.tokens) == (longest, 4, (1, 2, 3, 4, 8))
    assert cache.load([], [1, 2, 9, 9]).entry_id == short
    # A slot already sharing as much as the best entry gets nothing.
    assert cache.load([1, 2, 3, 4], [1, 2, 3, 4, 5, 6]).entry_id is None
    assert cache.load([], [7, 7]).entry_id is None


@pytest.mark.parametrize("policy_class", POLICIES)
def test_entries_are_not_consumed_by_a_restore(policy_class: type[LruPrefixCache]) -> None:
    cache = make_cache(policy_class)
    entry = stored(cache, [1, 2, 3])
    for _ in range(3):
        found = cache.load([], [1, 2, 3, 4])
        assert found.entry_id == entry
        cache.load_finished(entry, restored=True)
    assert [cached.entry_id for cached in cache.entries()] == [entry]


@pytest.mark.parametrize("policy_class", POLICIES)
def test_eviction_is_least_recently_used(policy_class: type[LruPrefixCache]) -> None:
    cache = make_cache(policy_class, limit_bytes=100)
    first = stored(cache, [1, 1], size=40)
    second = stored(cache, [2, 2], size=40)
    assert cache.load([], [1, 1, 5]).entry_id == first
    cache.load_finished(first, restored=True)  # used: the second entry is now the oldest
    assert cache.save([3], 40).evicted == (second,)
    # A skipped save of a cached prompt counts as a use too.
    assert cache.save([1], 40).outcome == "skipped_already_cached"
    fourth = cache.save([4], 40)
    assert fourth.evicted == (EntryId(2),)  # the [3] entry, not the refreshed first one
    assert [entry.entry_id for entry in cache.entries()] == [first, fourth.entry_id]


@pytest.mark.parametrize("policy_class", POLICIES)
def test_a_failed_restore_is_not_a_use(policy_class: type[LruPrefixCache]) -> None:
    cache = make_cache(policy_class, limit_bytes=100)
    first = stored(cache, [1, 1], size=40)
    second = stored(cache, [2, 2], size=40)
    cache.load_finished(first, restored=False)
    assert cache.save([3], 40).evicted == (first,)
    assert second in [entry.entry_id for entry in cache.entries()]


@pytest.mark.parametrize("policy_class", POLICIES)
def test_budget_holds_and_allocation_failure_shrinks_it(
    policy_class: type[LruPrefixCache],
) -> None:
    cache = make_cache(policy_class, limit_bytes=100)
    assert cache.save([9], 101).outcome == "skipped_too_large"
    for token in range(10):
        stored(cache, [token], size=30)
        assert cache.size_bytes() <= 100
    failed = stored(cache, [42], size=10)
    cache.allocation_failed(failed)
    assert cache.limit_bytes == 36  # 40% of the 90 bytes left
    assert cache.size_bytes() <= 36


@pytest.mark.parametrize("policy_class", POLICIES)
def test_trees_are_pruned_when_entries_leave(policy_class: type[LruPrefixCache]) -> None:
    cache = make_cache(policy_class, limit_bytes=100)
    for content in ([1, 2, 3], [1, 2, 4], [1, 5], [6]):
        stored(cache, content, size=25)
    check_shape(cache)
    stored(cache, [7], size=100)  # evicts all four
    assert cache.node_count() == 2  # the root and [7]


# ------------------------------------------------------------------------------ slot choice


@pytest.mark.parametrize("policy_class", POLICIES)
def test_slot_with_the_longest_prefix_is_chosen(policy_class: type[LruPrefixCache]) -> None:
    cache = make_cache(policy_class)
    task = list(range(10))
    slots = [slot(0, range(3), t=1), slot(1, [*range(6), 99], t=2), slot(2, range(6), t=3)]
    choice = cache.choose_slot(task, slots)
    # Slots 1 and 2 share 6 tokens; slot 2 loses none of its own, so it is taken and not saved.
    assert (choice.slot_id, choice.selected_by, choice.save_slot, choice.try_load) == (
        2,
        "longest_prefix",
        False,
        True,
    )
    without_two = cache.choose_slot(task, slots[:2])
    assert (without_two.slot_id, without_two.save_slot) == (1, True)  # it would lose token 99


@pytest.mark.parametrize("policy_class", POLICIES)
def test_short_prefixes_fall_back_to_lru(policy_class: type[LruPrefixCache]) -> None:
    cache = make_cache(policy_class)
    task = list(range(10))
    # One shared token of ten is not above 0.10: least recently used, never-used first, lowest id.
    slots = [slot(0, [0, 50], t=5), slot(1, t=-1), slot(2, t=-1), slot(3, busy=True)]
    choice = cache.choose_slot(task, slots)
    assert (choice.slot_id, choice.selected_by, choice.save_slot) == (1, "lru", False)
    used = cache.choose_slot(task, [slot(0, [50], t=5), slot(1, [51], t=3), slot(2, [52], t=3)])
    assert (used.slot_id, used.save_slot) == (1, True)
    all_busy = cache.choose_slot(task, [slot(0, busy=True)])
    assert (all_busy.slot_id, all_busy.must_defer) == (None, True)


@pytest.mark.parametrize("policy_class", POLICIES)
def test_explicit_slots(policy_class: type[LruPrefixCache]) -> None:
    cache = make_cache(policy_class)
    task = [1, 2, 3]
    slots = [slot(0, task), slot(1), slot(2, [9], busy=True)]
    # An explicit empty slot still looks in the cache (unlike llama-server's NaN case).
    empty = cache.choose_slot(task, slots, requested_slot_id=1)
    assert (empty.slot_id, empty.selected_by, empty.save_slot, empty.try_load) == (
        1,
        "requested",
        False,
        True,
    )
    # A busy one is waited for, with no cache action on a running slot.
    busy = cache.choose_slot(task, slots, requested_slot_id=2)
    assert (busy.slot_id, busy.must_defer, busy.save_slot, busy.try_load) == (2, True, False, False)
    assert cache.choose_slot(task, slots, requested_slot_id=4).slot_id == 1  # wraps: 4 % 3


@pytest.mark.parametrize("policy_class", POLICIES)
def test_disabled_cache_is_never_consulted(policy_class: type[LruPrefixCache]) -> None:
    cache = make_cache(policy_class, limit_bytes=0)
    choice = cache.choose_slot([1, 2], [slot(0, [5, 6])])
    assert (choice.slot_id, choice.update_cache) == (0, False)
    assert cache.save([1], 1).outcome == "cache_disabled"
    assert cache.idle_slots_to_cache([slot(0, [1])]).slot_ids == ()
