"""llama-server's prompt cache, rule by rule: each test pins one comparison of the C++ so that
changing it (strict to non-strict, FIFO to LRU, a threshold, consuming entries...) fails here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cacheproxy_plugins.prompt_cache_llama_server import LlamaServerPromptCache

from cacheproxy.prompt_cache import EntryId, PromptCacheDeps, PromptCachePolicy, SlotView

UNRELATED = 10_000  # token ids from here on are shared by no other sequence in a test


def make_cache(deps: PromptCacheDeps | None = None, **options: Any) -> LlamaServerPromptCache:
    options.setdefault("limit_tokens", 0)  # most tests look at bytes alone
    return LlamaServerPromptCache(LlamaServerPromptCache.Options(**options), deps)


def tokens(prefix_length: int, total: int, salt: int = 0) -> list[int]:
    """`total` tokens whose first `prefix_length` are 0, 1, 2... and the rest unique to `salt`."""
    return list(range(prefix_length)) + [
        UNRELATED + 1000 * salt + i for i in range(total - prefix_length)
    ]


def slot(slot_id: int, content: Sequence[int] = (), busy: bool = False, t: int = -1) -> SlotView:
    return SlotView(id=slot_id, tokens=tuple(content), busy=busy, t_last_used=t)


def stored(cache: LlamaServerPromptCache, content: Sequence[int], size: int = 10) -> EntryId:
    decision = cache.save(content, size)
    assert decision.stored and decision.entry_id is not None
    return decision.entry_id


def cached_ids(cache: LlamaServerPromptCache) -> list[EntryId]:
    return [entry.entry_id for entry in cache.entries()]


def test_it_is_a_prompt_cache_policy() -> None:
    assert isinstance(make_cache(), PromptCachePolicy)


# ------------------------------------------------------------------------------ choose_slot


def test_similarity_must_exceed_the_threshold_strictly() -> None:
    cache = make_cache()
    task = tokens(10, 10)
    # 1 of 10 tokens is f_sim 0.1, not above 0.1: LRU takes the never-used slot instead.
    at_threshold = cache.choose_slot(task, [slot(0, tokens(1, 5, 1), t=5), slot(1)])
    assert (at_threshold.slot_id, at_threshold.selected_by) == (1, "lru")
    above = cache.choose_slot(task, [slot(0, tokens(2, 5, 1), t=5), slot(1)])
    assert (above.slot_id, above.selected_by) == (0, "similarity")


def test_similarity_threshold_is_compared_in_float32() -> None:
    # 0.1f is 0.10000000149: 1/10 in float32 equals it, so it is not above it.
    cache = make_cache(slot_prompt_similarity=0.1)
    choice = cache.choose_slot(tokens(10, 10), [slot(0, tokens(1, 3, 1), t=5), slot(1)])
    assert choice.selected_by == "lru"


def test_similarity_picks_the_best_slot_and_ties_go_to_the_lowest_id() -> None:
    cache = make_cache()
    task = tokens(8, 8)
    best = cache.choose_slot(task, [slot(0, tokens(3, 6, 1)), slot(1, tokens(5, 6, 2))])
    assert best.slot_id == 1
    tie = cache.choose_slot(
        task, [slot(0, tokens(4, 6, 1)), slot(1, tokens(4, 6, 2)), slot(2, tokens(4, 6, 3))]
    )
    assert tie.slot_id == 0


def test_similarity_skips_busy_slots() -> None:
    cache = make_cache()
    task = tokens(8, 8)
    choice = cache.choose_slot(task, [slot(0, task, busy=True), slot(1, tokens(3, 9, 1))])
    assert (choice.slot_id, choice.selected_by, choice.must_defer) == (1, "similarity", False)


def test_similarity_zero_turns_the_scan_off() -> None:
    cache = make_cache(slot_prompt_similarity=0.0)
    task = tokens(8, 8)
    # Slot 0 holds the whole task, but with no scan the older slot 1 is taken.
    choice = cache.choose_slot(task, [slot(0, task, t=7), slot(1, tokens(0, 3, 1), t=1)])
    assert (choice.slot_id, choice.selected_by) == (1, "lru")
    # With the scan off an explicit slot never touches the cache.
    explicit = cache.choose_slot(task, [slot(0, tokens(0, 5, 1))], requested_slot_id=0)
    assert (explicit.save_slot, explicit.try_load) == (False, False)


def test_kept_fraction_below_one_half_saves_the_slot_first() -> None:
    cache = make_cache()
    task = tokens(5, 16)  # a power of two keeps the float32 arithmetic exact here
    # The task keeps 5 of the slot's 10 tokens: f_keep 0.5 is not below 0.5, nothing saved.
    half = cache.choose_slot(task, [slot(0, tokens(5, 10, 1))])
    assert (half.selected_by, half.f_keep, half.save_slot, half.try_load) == (
        "similarity",
        0.5,
        False,
        False,
    )
    # 5 of 11: f_keep 0.45, the slot is saved and the cache consulted before it is overwritten.
    under = cache.choose_slot(task, [slot(0, tokens(5, 11, 1))])
    assert (under.save_slot, under.try_load, under.update_cache) == (True, True, True)


def test_kept_fraction_is_recomputed_in_float32() -> None:
    # 13 of a 22-token task from a 26-token slot keeps exactly half, but llama-server computes
    # (f_sim * 22) / 26 in float32, gets 0.49999997, and saves the slot.
    cache = make_cache()
    choice = cache.choose_slot(tokens(13, 22), [slot(0, tokens(13, 26, 1))])
    assert choice.f_keep < 0.5
    assert choice.save_slot


def test_lru_takes_never_used_slots_first_and_the_highest_id_on_ties() -> None:
    cache = make_cache()
    task = tokens(0, 4, 9)
    never_used = cache.choose_slot(task, [slot(0, t=-1), slot(1, t=-1), slot(2, t=3)])
    assert (never_used.slot_id, never_used.selected_by) == (1, "lru")
    tie = cache.choose_slot(task, [slot(0, t=5), slot(1, t=2), slot(2, t=2), slot(3, t=4)])
    assert tie.slot_id == 2


def test_lru_skips_busy_slots_and_defers_when_all_are_busy() -> None:
    cache = make_cache()
    task = tokens(0, 4, 9)
    choice = cache.choose_slot(task, [slot(0, busy=True), slot(1, t=8)])
    assert choice.slot_id == 1
    none = cache.choose_slot(task, [slot(0, busy=True), slot(1, busy=True)])
    assert (none.slot_id, none.must_defer, none.save_slot) == (None, True, False)


def test_lru_path_always_updates_the_cache() -> None:
    cache = make_cache()
    # No similarity match: the LRU slot is saved and the cache consulted (SC:1765).
    choice = cache.choose_slot(tokens(0, 4, 9), [slot(0, tokens(0, 40, 1), t=1)])
    assert (choice.selected_by, choice.save_slot, choice.try_load) == ("lru", True, True)


def test_no_ram_cache_means_no_cache_update() -> None:
    cache = make_cache(limit_bytes=0)
    choice = cache.choose_slot(tokens(0, 4, 9), [slot(0, tokens(0, 40, 1))])
    assert (choice.selected_by, choice.update_cache) == ("lru", False)
    assert cache.save(tokens(0, 4), 10).outcome == "cache_disabled"


def test_explicit_slot_is_honoured_even_when_busy() -> None:
    cache = make_cache()
    task = tokens(6, 6)
    choice = cache.choose_slot(
        task, [slot(0, task), slot(1, tokens(0, 5, 1), busy=True)], requested_slot_id=1
    )
    assert (choice.slot_id, choice.selected_by, choice.must_defer) == (1, "requested", True)
    # As llama-server does, the cache is still updated on the busy slot (f_keep 0).
    assert choice.save_slot


def test_explicit_slot_with_low_similarity_is_saved_first() -> None:
    cache = make_cache()
    task = tokens(16, 16)
    # Shares 1 of 16 tokens (0 < f_sim <= 0.1): not matched by the scan, so f_keep is 0.
    below = cache.choose_slot(task, [slot(0, tokens(1, 4, 1)), slot(1)], requested_slot_id=0)
    assert (below.slot_id, below.f_keep, below.save_slot) == (0, 0.0, True)
    above = cache.choose_slot(task, [slot(0, tokens(8, 8)), slot(1)], requested_slot_id=0)
    assert (above.slot_id, above.f_keep, above.save_slot) == (0, 1.0, False)


def test_explicit_empty_slot_never_consults_the_cache() -> None:
    cache = make_cache()
    task = tokens(6, 6)
    stored(cache, task)
    # f_keep = 0/0 = NaN and NaN < 0.5 is false: no save, no load, a full prompt recompute.
    explicit = cache.choose_slot(task, [slot(0, tokens(0, 3, 1)), slot(1)], requested_slot_id=1)
    assert (explicit.slot_id, explicit.save_slot, explicit.try_load) == (1, False, False)
    assert math.isnan(explicit.f_keep)
    # The same empty slot reached through LRU does consult the cache.
    by_lru = cache.choose_slot(task, [slot(0, tokens(0, 3, 1), t=4), slot(1)])
    assert (by_lru.slot_id, by_lru.try_load) == (1, True)


def test_explicit_id_wraps_but_the_scan_compares_the_raw_id() -> None:
    cache = make_cache()
    task = tokens(6, 6)
    slots = [slot(0), slot(1, task), slot(2), slot(3)]
    raw = cache.choose_slot(task, slots, requested_slot_id=1)
    assert (raw.slot_id, raw.save_slot) == (1, False)  # matched by the scan: f_keep 1
    # 5 names slot 1 (5 % 4), but the scan looks for id 5, finds nothing: f_keep 0, saved.
    wrapped = cache.choose_slot(task, slots, requested_slot_id=5)
    assert (wrapped.slot_id, wrapped.save_slot) == (1, True)
    negative = cache.choose_slot(task, slots, requested_slot_id=-2)  # (2**64 - 2) % 4 == 2
    assert negative.slot_id == 2


# ------------------------------------------------------------------------------------- save


def test_save_skips_an_empty_slot() -> None:
    assert make_cache().save([], 10).outcome == "skipped_empty"


def test_save_skips_a_prompt_an_entry_already_contains() -> None:
    cache = make_cache()
    stored(cache, tokens(4, 4))
    assert cache.save(tokens(3, 3), 10).outcome == "skipped_already_cached"
    assert cache.save(tokens(4, 4), 10).outcome == "skipped_already_cached"
    assert cache.save(tokens(3, 4, 1), 10).stored  # diverges: not contained


def test_containment_is_checked_before_the_size_limit() -> None:
    cache = make_cache(limit_bytes=100)
    stored(cache, tokens(4, 4), size=10)
    assert cache.save(tokens(2, 2), 500).outcome == "skipped_already_cached"


def test_an_over_limit_state_is_skipped_without_evicting() -> None:
    cache = make_cache(limit_bytes=100)
    kept = stored(cache, tokens(0, 4, 1), size=60)
    too_large = cache.save(tokens(0, 4, 2), 101)
    assert (too_large.outcome, too_large.evicted) == ("skipped_too_large", ())
    assert cached_ids(cache) == [kept]
    # Exactly the limit is not over it (strict >): stored after evicting the rest.
    exact = cache.save(tokens(0, 4, 3), 100)
    assert exact.stored and exact.evicted == (kept,)


def test_save_removes_entries_the_new_prompt_contains() -> None:
    cache = make_cache()
    prefix = stored(cache, tokens(2, 2))  # [0, 1]
    diverging = stored(cache, tokens(1, 3, 1))  # [0, x, y]: shares a token, is no prefix
    decision = cache.save(tokens(4, 4), 10)  # [0, 1, 2, 3]
    assert decision.evicted == (prefix,)
    assert cached_ids(cache) == [diverging, decision.entry_id]


def test_save_evicts_oldest_first_until_the_state_fits() -> None:
    cache = make_cache(limit_bytes=100)
    first = stored(cache, tokens(0, 4, 1), size=40)
    second = stored(cache, tokens(0, 4, 2), size=40)
    # A skipped save of the first entry's prefix is no use in llama-server's eyes: FIFO, not LRU.
    assert cache.save(tokens(0, 2, 1), 40).outcome == "skipped_already_cached"
    exact_fit = cache.save(tokens(0, 4, 3), 20)  # 40 + 40 + 20 == 100: fits, no eviction
    assert exact_fit.evicted == ()
    decision = cache.save(tokens(0, 4, 4), 30)
    assert decision.evicted == (first,)
    assert cached_ids(cache) == [second, exact_fit.entry_id, decision.entry_id]
    assert cache.size_bytes() == 90


def test_allocation_failure_shrinks_the_limit_to_40_percent() -> None:
    cache = make_cache(limit_bytes=1000)
    first = stored(cache, tokens(0, 4, 1), size=25)
    second = stored(cache, tokens(0, 4, 2), size=15)
    third = stored(cache, tokens(0, 4, 3), size=10)
    failed = stored(cache, tokens(0, 4, 4), size=500)
    evicted = cache.allocation_failed(failed)
    # 40% of the 50 bytes cached without the failed entry: 20; FIFO down to it.
    assert cache.limit_bytes == 20
    assert evicted == (first, second)
    assert cached_ids(cache) == [third]


def test_allocation_failure_sets_a_limit_where_there_was_none() -> None:
    cache = make_cache(limit_bytes=-1)
    stored(cache, tokens(0, 4, 1), size=7)
    failed = stored(cache, tokens(0, 4, 2), size=10**12)  # no limit: accepted
    cache.allocation_failed(failed)
    assert cache.limit_bytes == 2  # int(0.4 * 7)
    assert cache.entries() == ()
    assert cache.allocation_failed(stored(cache, tokens(0, 1, 3), size=1)) == ()
    assert cache.limit_bytes == 1  # never 0, which would mean "no limit"


# ------------------------------------------------------------------------------------- load


def test_load_ignores_entries_keeping_under_a_quarter() -> None:
    cache = make_cache()
    task = tokens(2, 10)
    ignored = stored(cache, tokens(2, 9, 1))  # keeps 2 of 9: 0.22
    assert cache.load([], task).entry_id is None
    quarter = stored(cache, tokens(2, 8, 2))  # keeps 2 of 8: exactly 0.25, not below
    found = cache.load([], task)
    assert (found.entry_id, found.n_common, found.tokens) == (quarter, 2, tuple(tokens(2, 8, 2)))
    assert ignored in cached_ids(cache)


def test_an_empty_slot_is_beaten_by_any_eligible_entry() -> None:
    cache = make_cache()
    entry = stored(cache, tokens(1, 4, 1))  # keeps 1 of 4, covers 1 of 20 tokens
    assert cache.load([], tokens(1, 20)).entry_id == entry


def test_load_needs_both_fractions_strictly_better() -> None:
    task = tokens(8, 8)
    # Slot keeps 0.75 and covers 0.375; an entry with the same numbers is no better.
    cache = make_cache()
    stored(cache, tokens(3, 4, 1))
    assert cache.load(tokens(3, 4, 2), task).entry_id is None
    # Better coverage (0.75) but worse keep (0.75 < 1): the slot, a full prefix, stays.
    cache = make_cache()
    stored(cache, tokens(6, 8, 1))
    assert cache.load(tokens(4, 4), task).entry_id is None
    # Better keep (1 > 0.75) but worse coverage (0.25 < 0.75): the slot stays.
    cache = make_cache()
    stored(cache, tokens(2, 2))
    assert cache.load(tokens(6, 8, 2), task).entry_id is None
    # Same keep (0.5), better coverage (0.375 > 0.25): not strictly better on both.
    cache = make_cache()
    stored(cache, tokens(3, 6, 1))
    assert cache.load(tokens(2, 4, 2), task).entry_id is None
    # Same coverage (0.375), better keep (1 > 0.75): not strictly better on both.
    cache = make_cache()
    stored(cache, tokens(3, 3))
    assert cache.load(tokens(3, 4, 2), task).entry_id is None
    # Better on both: taken.
    cache = make_cache()
    better = stored(cache, tokens(6, 7, 1))
    assert cache.load(tokens(3, 4, 2), task).entry_id == better


def test_load_scans_oldest_first_and_keeps_the_first_of_equals() -> None:
    cache = make_cache()
    # The first entry (keeps 8/9, covers 0.5) sets a keep the second (keeps 0.875, covers
    # 0.875) cannot beat: the scan is greedy in insertion order, not a search for the best cover.
    first = stored(cache, tokens(8, 9, 1))
    stored(cache, tokens(14, 16, 2))
    assert cache.load([], tokens(16, 16)).entry_id == first
    task = tokens(8, 8)
    cache = make_cache()
    older = stored(cache, tokens(4, 6, 1))
    stored(cache, tokens(4, 6, 2))
    assert cache.load([], task).entry_id == older


def test_a_restored_entry_leaves_the_cache_a_failed_one_stays() -> None:
    cache = make_cache()
    entry = stored(cache, tokens(4, 6, 1))
    found = cache.load([], tokens(6, 6))
    assert found.entry_id == entry and cached_ids(cache) == [entry]  # not gone before the report
    cache.load_finished(entry, restored=False)
    assert cached_ids(cache) == [entry]
    cache.load_finished(entry, restored=True)
    assert cached_ids(cache) == []


# ----------------------------------------------------------------------------------- update


def test_update_enforces_the_token_limit_fifo_without_a_byte_limit() -> None:
    # `--cache-ram -1` still caps the cache at n_ctx tokens: the token limit is then not raised.
    cache = make_cache(deps=PromptCacheDeps(n_ctx=10), limit_bytes=-1, limit_tokens=None)
    assert cache.limit_tokens == 10
    first = stored(cache, tokens(0, 6, 1))
    second = stored(cache, tokens(0, 6, 2))
    assert cache.save(tokens(0, 3, 1), 10).outcome == "skipped_already_cached"  # not a use
    assert cache.update() == (first,)
    assert cached_ids(cache) == [second]


def test_token_limit_is_raised_to_what_the_byte_limit_holds() -> None:
    cache = make_cache(limit_bytes=1000, limit_tokens=10)
    entry = stored(cache, tokens(0, 16, 1), size=400)  # 25 bytes/token: 1000 bytes hold 40
    assert cache.update() == ()
    assert cached_ids(cache) == [entry]


def test_bytes_per_token_is_at_least_one() -> None:
    # 1200 tokens in 750 bytes: 0.625 bytes/token counts as 1, so the 1000-byte limit holds
    # 1000 tokens, not 1600, and the entry goes.
    cache = make_cache(limit_bytes=1000, limit_tokens=10)
    stored(cache, tokens(0, 1200, 1), size=750)
    assert len(cache.update()) == 1
    assert cache.entries() == ()


def test_no_token_limit_when_it_is_zero() -> None:
    cache = make_cache(limit_bytes=-1, limit_tokens=0)
    stored(cache, tokens(0, 5000, 1))
    assert cache.update() == ()


# ------------------------------------------------------------------------------- idle slots


def test_idle_slots_are_saved_and_cleared_only_with_unified_kv() -> None:
    slots = [slot(0, tokens(0, 3, 1)), slot(1, tokens(0, 3, 2), busy=True), slot(2), slot(3, [7])]
    split = make_cache().idle_slots_to_cache(slots)
    assert (split.slot_ids, split.clear_after_save) == ((0, 3), False)
    unified = make_cache(kv_unified=True).idle_slots_to_cache(slots)
    assert (unified.slot_ids, unified.clear_after_save) == ((0, 3), True)
    assert make_cache(cache_idle_slots=False).idle_slots_to_cache(slots).slot_ids == ()
    assert make_cache(limit_bytes=0).idle_slots_to_cache(slots).slot_ids == ()


# ------------------------------------------------------------------------------ a whole turn


def test_a_pinned_slot_overwritten_then_restored_by_lru() -> None:
    """Two slots: A runs in slot 0, B is pinned to slot 0 (A goes to RAM), and a follow-up of A
    without `id_slot` gets A back from RAM into the LRU slot; A leaves the cache."""
    cache = make_cache()
    prompt_a, prompt_b = tokens(0, 40, 1), tokens(0, 40, 2)
    slots = [slot(0, prompt_a, t=1), slot(1)]

    pinned = cache.choose_slot(prompt_b, slots, requested_slot_id=0)
    assert (pinned.slot_id, pinned.save_slot) == (0, True)
    saved_a = cache.save(prompt_a, 400)
    assert saved_a.stored and cache.load(prompt_a, prompt_b).entry_id is None
    assert cache.update() == ()

    slots = [slot(0, prompt_b, t=2), slot(1)]
    follow_up = [*prompt_a, 1, 2]
    choice = cache.choose_slot(follow_up, slots)
    assert (choice.slot_id, choice.selected_by, choice.try_load) == (1, "lru", True)
    assert cache.save([], 0).outcome == "skipped_empty"
    found = cache.load([], follow_up)
    assert (found.entry_id, found.n_common) == (saved_a.entry_id, 40)
    cache.load_finished(saved_a.entry_id, restored=True)
    assert cache.entries() == ()
