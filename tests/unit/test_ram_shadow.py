"""The RAM-cache shadow makes the decisions llama-server makes, event by event.

The reference is a llama-server as the pinned source runs pinned tasks (SC:1680-1793, then
SC:2641-2657 after the launch), its RAM cache the `llama-server` plugin: slot choice, save, load,
update, idle slots copied in. The shadow sees only what the proxy sees (which slot each task went
to, what every slot held) and must predict every `cache_n` before the task runs.
"""

from __future__ import annotations

import random

import pytest

from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.ram_shadow import RamCacheShadow, ShadowSlot
from tests.support.ram_reference import (
    BYTES_PER_TOKEN,
    N_SLOTS,
    ReferenceServer,
    ram_cache,
    random_prompt,
)


def proxy_view(slots: list[list[int]]) -> list[ShadowSlot]:
    return [ShadowSlot(i, tokens, busy=False) for i, tokens in enumerate(slots)]


@pytest.mark.parametrize("limit_mib", [8192, 1.5])
@pytest.mark.parametrize("seed", range(4))
def test_shadow_predicts_every_cache_n_the_server_reports(limit_mib: float, seed: int) -> None:
    """Pinned tasks on random slots, conversations coming back after others took their slots;
    budgets that keep everything, and ones that evict (a save may push out the very entry the
    task would have loaded)."""
    rng = random.Random(seed)
    server = ReferenceServer(limit_mib)
    shadow = RamCacheShadow(ram_cache(limit_mib), lambda: BYTES_PER_TOKEN)
    table: list[list[int]] = [[] for _ in range(N_SLOTS)]  # what the proxy knows the slots hold
    conversations: list[list[int]] = []
    served_from_ram = 0
    for _ in range(120):
        prompt = random_prompt(rng, conversations)
        slot_id = rng.randrange(N_SLOTS)
        predicted = shadow.predict(proxy_view(table), slot_id, prompt).cache_n
        shadow.dispatched(proxy_view(table), slot_id, table[slot_id], prompt)
        generated = [rng.randrange(300, 20000) for _ in range(4)]
        cache_n = server.run(slot_id, prompt, generated)
        assert predicted == cache_n
        served_from_ram += cache_n > common_prefix_length(table[slot_id], prompt)
        table[slot_id] = prompt + generated[:-1]
        conversations.append(prompt + generated)
        assert shadow.cache.entries() == server.cache.entries()
    assert served_from_ram > 0  # the RAM cache did serve: the test saw what it is about


def test_the_disk_tier_is_told_what_the_ram_cache_keeps() -> None:
    shadow = RamCacheShadow(ram_cache(8192), lambda: BYTES_PER_TOKEN)
    first, second = list(range(1000, 1600)), list(range(5000, 5600))
    slots = [ShadowSlot(0, first, False), ShadowSlot(1, [], False)]
    # `first` is not cached yet, but pinning `second` over it saves it there first
    assert not shadow.keeps(first)
    assert shadow.will_keep(slots, 0, first, second)
    # a prompt that keeps most of the slot leaves it in place, unsaved
    assert not shadow.will_keep(slots, 0, first, [*first, 7, 8])
    shadow.dispatched(slots, 0, first, second)
    assert shadow.keeps(first) and shadow.keeps(first[:300]) and shadow.keeps(tuple(first))
    # only a prefix of an entry: the same end after another middle, or one token more, is not
    assert not shadow.keeps([*first[:299], 1, first[300]])
    assert not shadow.keeps([*first[:-1], 9, first[-1]]) and not shadow.keeps([*first, 1])
    # too large for the budget: never kept
    small = RamCacheShadow(ram_cache(0.1), lambda: BYTES_PER_TOKEN)
    assert not small.will_keep(slots, 0, first, second)


def test_an_entry_the_server_had_and_the_shadow_not_is_dropped_when_seen() -> None:
    shadow = RamCacheShadow(ram_cache(8192), lambda: BYTES_PER_TOKEN)
    first = list(range(1000, 1600))
    slots = [ShadowSlot(0, first, False), ShadowSlot(1, [], False)]
    shadow.dispatched(slots, 0, first, list(range(5000, 5600)))
    assert shadow.keeps(first)
    # the server served `first` from somewhere the shadow did not expect: it left the cache
    shadow.observed([*first, 1, 2], predicted=0, cache_n=600)
    assert not shadow.keeps(first)
    shadow.dispatched(slots, 0, first, list(range(6000, 6600)))
    shadow.reset()
    assert shadow.cache.entries() == ()


def test_a_slot_whose_restore_would_consume_another_conversation_costs_that_conversation() -> None:
    """llama-server restores the cached entry that shares most with the task, even one that
    shares only a tenant's common prefix: the entry leaves the cache and the task overwrites
    its history. The shadow says so, so the router can prefer a slot that loses nothing."""
    rng = random.Random(7)
    prefix = [rng.randrange(300, 20000) for _ in range(512)]

    def user() -> list[int]:
        return prefix + [rng.randrange(300, 20000) for _ in range(1200)]

    cached_user, other_user, new_user = user(), user(), user()
    foreign = [rng.randrange(300, 20000) for _ in range(800)]
    shadow = RamCacheShadow(ram_cache(8192), lambda: BYTES_PER_TOKEN)
    shadow.dispatched([ShadowSlot(0, cached_user, False)], 0, cached_user, foreign)
    slots = [ShadowSlot(0, foreign, False), ShadowSlot(1, other_user, False)]
    on_foreign = shadow.predict(slots, 0, new_user)
    assert on_foreign.cache_n == 512 and on_foreign.entry_lost == len(cached_user) - 512
    on_other = shadow.predict(slots, 1, new_user)  # the slot is saved, nothing is restored
    assert on_other.cache_n == 512 and on_other.slot_kept and on_other.entry_lost == 0


class OneGroupCached:
    """A group's 256-token prefix in the RAM cache (one entry), two idle slots holding other
    texts, and two more prompts of the group to place."""

    def __init__(self) -> None:
        group = list(range(1000, 1256))
        cached, self.first, self.second = (
            group + list(range(q, q + 32)) for q in (20000, 30000, 40000)
        )
        self.other = list(range(5000, 5300))
        self.shadow = RamCacheShadow(ram_cache(8192), lambda: BYTES_PER_TOKEN)
        self.shadow.dispatched([ShadowSlot(0, cached, False)], 0, cached, self.other)
        self.slots = [
            ShadowSlot(0, self.other, False),
            ShadowSlot(1, list(range(7000, 7300)), False),
        ]


def test_an_entry_a_placed_task_will_load_is_no_other_slots_to_count_on() -> None:
    """Two prompts of one group placed at once on two slots: the server moves the group's one
    cached entry into the first slot to launch, and the second finds it gone. The first one's
    placement claims it until its task is sent (replayed) or given up."""
    bed = OneGroupCached()
    shadow, slots, first, second, other = bed.shadow, bed.slots, bed.first, bed.second, bed.other
    assert shadow.predict(slots, 1, second).cache_n == 256
    shadow.claim(slots, 0, first)
    assert shadow.predict(slots, 0, first).cache_n == 256  # its own claim does not count
    assert shadow.predict(slots, 1, second).cache_n == 0
    shadow.unclaim(0)  # given up before it was sent: the entry is there for anyone again
    assert shadow.predict(slots, 1, second).cache_n == 256
    shadow.claim(slots, 0, first)
    shadow.dispatched(slots, 0, other, first)  # sent: the entry left the cache with it
    assert shadow.predict(slots, 1, second).cache_n == 0


def test_a_claim_given_the_placements_prediction_claims_it_without_predicting_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler's placement has just asked what the task will load: the claim takes that
    answer (the shadow is asked once a slot per grant, not once more for the chosen one)."""
    bed = OneGroupCached()
    shadow, slots, first, second = bed.shadow, bed.slots, bed.first, bed.second
    predicted = shadow.predict(slots, 0, first)
    with monkeypatch.context() as patched:
        patched.setattr(shadow, "predict", lambda *_: pytest.fail("predicted again"))
        shadow.claim(slots, 0, first, predicted)
    assert shadow.predict(slots, 1, second).cache_n == 0  # claimed all the same


@pytest.mark.parametrize("limit_mib", [8192, 1.5])
@pytest.mark.parametrize("seed", range(4))
def test_the_slot_a_server_picks_itself_and_its_cache_n_are_predicted(
    limit_mib: float, seed: int
) -> None:
    """Tasks without `id_slot` on a server that empties its idle slots at every launch: the
    shadow names the slot the server takes and the `cache_n` it reports there, every time."""
    rng = random.Random(seed)
    server = ReferenceServer(limit_mib, unified=True)
    shadow = RamCacheShadow(ram_cache(limit_mib), lambda: BYTES_PER_TOKEN)
    table: list[list[int]] = [[] for _ in range(N_SLOTS)]
    last_used = [-1] * N_SLOTS
    conversations: list[list[int]] = []
    from_ram = 0
    for step in range(120):
        prompt = random_prompt(rng, conversations)
        view = [ShadowSlot(i, tokens, False, last_used[i]) for i, tokens in enumerate(table)]
        picked = shadow.pick(view, prompt)
        assert picked is not None
        slot_id, predicted = picked
        shadow.dispatched(view, slot_id, table[slot_id], prompt, pinned=False)
        generated = [rng.randrange(300, 20000) for _ in range(4)]
        ran_on, cache_n = server.run_unpinned(prompt, generated)
        assert (ran_on, predicted.cache_n) == (slot_id, cache_n)
        from_ram += cache_n > common_prefix_length(table[slot_id], prompt)
        table = [[] for _ in range(N_SLOTS)]  # the others emptied, as the table does
        table[slot_id] = prompt + generated[:-1]
        last_used[slot_id] = step + 1
        conversations.append(prompt + generated)
        assert shadow.cache.entries() == server.cache.entries()
    assert from_ram > 0


def test_the_ram_caches_rules_of_the_pinned_tree_are_the_shadows() -> None:
    """Each rule the shadow's predictions rest on (ram_shadow.py names its source lines)."""
    first, second, third = (list(range(base, base + 500)) for base in (1000, 3000, 5000))
    entry = 500 * BYTES_PER_TOKEN
    shadow = RamCacheShadow(ram_cache(2 * entry / (1 << 20)), lambda: BYTES_PER_TOKEN)
    empty = [ShadowSlot(0, [], False), ShadowSlot(1, [], False)]
    for held, other in ((first, second), (second, third)):  # saved when pinned over
        shadow.dispatched([ShadowSlot(0, held, False), empty[1]], 0, held, other)
    assert shadow.keeps(first) and shadow.keeps(second)
    # the size limit is strict (ST:1762-1768, 1882-1888): a third entry evicts the oldest
    shadow.dispatched([ShadowSlot(0, third, False), empty[1]], 0, third, [7] * 10)
    assert not shadow.keeps(first) and shadow.keeps(second) and shadow.keeps(third)
    # an entry over the limit is never kept, and evicts nothing (ST:1741-1746)
    huge = list(range(9000, 10200))
    shadow.dispatched([ShadowSlot(0, huge, False), empty[1]], 0, huge, [8] * 10)
    assert not shadow.keeps(huge) and shadow.keeps(second) and shadow.keeps(third)
    # an entry keeping less than a quarter of itself is never loaded (ST:1823-1826)
    roomy = RamCacheShadow(ram_cache(8192), lambda: BYTES_PER_TOKEN)
    roomy.dispatched([ShadowSlot(0, second, False), empty[1]], 0, second, third)
    slots = [ShadowSlot(0, [9] * 50, False), empty[1]]
    assert roomy.predict(slots, 0, [*second[:120], 4, 5]).cache_n == 0
    assert roomy.predict(slots, 0, [*second[:130], 4, 5]).cache_n == 130
    # an entry loaded into a slot leaves the cache (ST:1873-1875): no other slot loads it
    roomy.dispatched(slots, 0, [9] * 50, [*second, 4, 5])
    assert not roomy.keeps(second)
    others = [empty[0], ShadowSlot(1, [6] * 50, False)]
    assert roomy.predict(others, 1, [*second, 4, 5]).cache_n == 0
