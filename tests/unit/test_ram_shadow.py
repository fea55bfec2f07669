"""The RAM-cache shadow makes the decisions llama-server makes, event by event.

The reference is a llama-server as the pinned source runs pinned tasks (SC:1680-1793, then
SC:2641-2657 after the launch), its RAM cache the `llama-server` plugin: slot choice, save, load,
update, idle slots copied in. The shadow sees only what the proxy sees (which slot each task went
to, what every slot held) and must predict every `cache_n` before the task runs.
"""

from __future__ import annotations

import random

import pytest
from cacheproxy_plugins.prompt_cache_llama_server import LlamaServerPromptCache

from cacheproxy.prompt_cache import PromptCacheDeps, SlotView
from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.ram_shadow import RamCacheShadow, ShadowSlot

BYTES_PER_TOKEN = 1024.0
N_SLOTS = 3


def ram_cache(limit_mib: float) -> LlamaServerPromptCache:
    options = LlamaServerPromptCache.Options(limit_bytes=int(limit_mib * (1 << 20)))
    return LlamaServerPromptCache(options, PromptCacheDeps(n_ctx=4096 * N_SLOTS))


class ReferenceServer:
    """llama-server's pinned-task path with its RAM cache, as the C++ orders it."""

    def __init__(self, limit_mib: float) -> None:
        self.cache = ram_cache(limit_mib)
        self.slots: list[list[int]] = [[] for _ in range(N_SLOTS)]

    def run(self, slot_id: int, prompt: list[int], generated: list[int]) -> int:
        views = [SlotView(i, tuple(tokens)) for i, tokens in enumerate(self.slots)]
        choice = self.cache.choose_slot(prompt, views, requested_slot_id=slot_id)
        held = self.slots[slot_id]
        if choice.save_slot and held:  # prompt_save (SC:308-332)
            self.cache.save(tuple(held), int(len(held) * BYTES_PER_TOKEN))
        if choice.try_load:  # prompt_load (SC:1782): the entry moves into the slot
            loaded = self.cache.load(tuple(held), prompt)
            if loaded.entry_id is not None:
                self.slots[slot_id] = list(loaded.tokens)
                self.cache.load_finished(loaded.entry_id, restored=True)
        if choice.save_slot or choice.try_load:
            self.cache.update()
        cache_n = min(common_prefix_length(self.slots[slot_id], prompt), len(prompt) - 1)
        for other, tokens in enumerate(self.slots):  # cache_idle_slots, after the launch
            if other != slot_id and tokens:
                if self.cache.save(tuple(tokens), int(len(tokens) * BYTES_PER_TOKEN)).stored:
                    self.cache.update()
        # the last sampled token is never decoded into the KV
        self.slots[slot_id] = prompt + generated[:-1]
        return cache_n


def proxy_view(slots: list[list[int]]) -> list[ShadowSlot]:
    return [ShadowSlot(i, tokens, busy=False) for i, tokens in enumerate(slots)]


def random_prompt(rng: random.Random, conversations: list[list[int]]) -> list[int]:
    """A new conversation, or the next turn of an earlier one (its history plus a question)."""
    if conversations and rng.random() < 0.7:
        history = rng.choice(conversations)
        return history + [rng.randrange(300, 20000) for _ in range(rng.randrange(5, 80))]
    return [rng.randrange(300, 20000) for _ in range(rng.randrange(100, 600))]


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
    assert shadow.keeps(first) and shadow.keeps(first[:300])
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
