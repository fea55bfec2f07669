"""llama-server's RAM prompt cache and slot choice as the pinned source runs them, to test the
shadow against: the `llama-server` plugin driven in the C++'s order (SC = server-context.cpp)."""

from __future__ import annotations

import random

from cacheproxy_plugins.prompt_cache_llama_server import LlamaServerPromptCache

from cacheproxy.prompt_cache import PromptCacheDeps, SlotView
from cacheproxy.tokens import common_prefix_length

BYTES_PER_TOKEN = 1024.0
N_SLOTS = 3


def ram_cache(limit_mib: float) -> LlamaServerPromptCache:
    options = LlamaServerPromptCache.Options(limit_bytes=int(limit_mib * (1 << 20)))
    return LlamaServerPromptCache(options, PromptCacheDeps(n_ctx=4096 * N_SLOTS))


class ReferenceServer:
    """llama-server's task launch with its RAM cache, as the C++ orders it: pinned tasks (`run`)
    or, with `unified` (the default topology), tasks it places itself (`run_unpinned`), every
    idle slot then emptied after its copy into the cache (SC:2641-2657)."""

    def __init__(self, limit_mib: float, unified: bool = False) -> None:
        self.cache = ram_cache(limit_mib)
        self.slots: list[list[int]] = [[] for _ in range(N_SLOTS)]
        self.unified = unified
        self.last_used = [-1] * N_SLOTS
        self.clock = 0

    def run(self, slot_id: int, prompt: list[int], generated: list[int]) -> int:
        """A task pinned to `slot_id`: the `cache_n` it reports."""
        return self._launch(slot_id, prompt, generated)[1]

    def run_unpinned(self, prompt: list[int], generated: list[int]) -> tuple[int, int]:
        """A task without `id_slot`: the slot it takes, and the `cache_n` it reports."""
        return self._launch(None, prompt, generated)

    def _launch(
        self, requested: int | None, prompt: list[int], generated: list[int]
    ) -> tuple[int, int]:
        views = [
            SlotView(i, tuple(tokens), False, self.last_used[i])
            for i, tokens in enumerate(self.slots)
        ]
        choice = self.cache.choose_slot(prompt, views, requested_slot_id=requested)
        slot_id = choice.slot_id
        assert slot_id is not None
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
                if self.unified:
                    self.slots[other] = []  # emptied after the save (TAG_IDLE_SLOT_CLEAR)
        # the last sampled token is never decoded into the KV
        self.slots[slot_id] = prompt + generated[:-1]
        self.clock += 1
        self.last_used[slot_id] = self.clock
        return slot_id, cache_n


def random_prompt(rng: random.Random, conversations: list[list[int]]) -> list[int]:
    """A new conversation, or the next turn of an earlier one (its history plus a question)."""
    if conversations and rng.random() < 0.7:
        history = rng.choice(conversations)
        return history + [rng.randrange(300, 20000) for _ in range(rng.randrange(5, 80))]
    return [rng.randrange(300, 20000) for _ in range(rng.randrange(100, 600))]
