"""The shadow learns the server's RAM-cache budget from what its answers show it keeps.

The reference is a llama-server with its own `--cache-ram` (tests/support/ram_reference.py);
the shadow starts from another figure, as the proxy starts from `routing.server_ram_cache_mib`.
A load it replays that the server does not make lowers its budget, a load the server makes of
an entry the shadow dropped raises it; either way its predictions soon hold again.
"""

from __future__ import annotations

import random

from cacheproxy_plugins.prompt_cache_llama_server import LlamaServerPromptCache

from cacheproxy.prompt_cache import PromptCacheDeps
from cacheproxy.upstreams.ram_shadow import RamCacheShadow, ShadowSlot
from tests.support.ram_reference import BYTES_PER_TOKEN, N_SLOTS, ReferenceServer, ram_cache

MIB = 1 << 20
USERS, TURNS = 8, 6


def sized(limit_bytes: int) -> LlamaServerPromptCache:
    options = LlamaServerPromptCache.Options(limit_bytes=limit_bytes)
    return LlamaServerPromptCache(options, PromptCacheDeps(n_ctx=4096 * N_SLOTS))


def shadow_at(limit_mib: float, learn: bool = True) -> RamCacheShadow:
    return RamCacheShadow(ram_cache(limit_mib), lambda: BYTES_PER_TOKEN, sized if learn else None)


def surprises(server: ReferenceServer, shadow: RamCacheShadow, seed: int = 1) -> list[int]:
    """More users than slots taking turns, each turn pinned to the next slot: the steps at
    which the server's `cache_n` was not the shadow's (each one told to the shadow)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(300, 20000) for _ in range(600)] for _ in range(USERS)]
    table: list[list[int]] = [[] for _ in range(N_SLOTS)]
    missed = []
    for step in range(USERS * TURNS):
        user, slot_id = step % USERS, step % N_SLOTS
        prompt = prompts[user]
        view = [ShadowSlot(i, tokens, False) for i, tokens in enumerate(table)]
        predicted = shadow.predict(view, slot_id, prompt).cache_n
        shadow.dispatched(view, slot_id, table[slot_id], prompt)
        generated = [rng.randrange(300, 20000) for _ in range(4)]
        cache_n = server.run(slot_id, prompt, generated)
        if cache_n != predicted:
            shadow.observed(prompt, predicted, cache_n, slot_id)
            missed.append(step)
        table[slot_id] = prompt + generated[:-1]
        prompts[user] = prompt + generated + [rng.randrange(300, 20000) for _ in range(40)]
    return missed


def test_a_budget_smaller_than_believed_is_learnt_from_loads_that_do_not_happen() -> None:
    """The server keeps about two conversations (2 MiB), the shadow believes 8 GiB: each user's
    return is a predicted load that does not happen, until the budget comes down."""
    fixed = surprises(ReferenceServer(2), shadow_at(8192, learn=False))
    learning = shadow_at(8192)
    learnt = surprises(ReferenceServer(2), learning)
    assert len(fixed) > USERS * (TURNS - 2)  # every return, every turn
    assert len(learnt) <= 3 and max(learnt) < USERS * 2  # within the first rounds
    # no more than every conversation: what the answers showed (not tighter than they tell)
    assert 0 < learning.budget_bytes < USERS * MIB
    assert learning.budget_changes >= 1


def test_a_budget_larger_than_believed_is_learnt_from_loads_of_dropped_entries() -> None:
    """The server keeps everything; the shadow believes 0.5 MiB, less than one conversation
    (over the limit, never kept): the server's loads of what the shadow dropped raise it."""
    fixed = surprises(ReferenceServer(8192), shadow_at(0.5, learn=False))
    learning = shadow_at(0.5)
    learnt = surprises(ReferenceServer(8192), learning)
    assert len(fixed) > USERS * (TURNS - 2)
    assert len(learnt) <= 3
    assert learning.budget_bytes > 4 * MIB  # every user's conversation fits


def test_a_server_that_restarted_does_not_lower_the_budget_for_good() -> None:
    """A restart empties the server's cache (the proxy resets the shadow when it sees it); a
    load the shadow replayed before it saw the restart lowers the budget once, and the loads
    that follow raise it again."""
    learning = shadow_at(8192)
    server = ReferenceServer(8192)
    surprises(server, learning, seed=1)
    server.cache = ram_cache(8192)  # restarted: its RAM cache is empty, the slots too
    server.slots = [[] for _ in range(N_SLOTS)]
    surprises(server, learning, seed=2)
    assert learning.budget_bytes > 4 * MIB
