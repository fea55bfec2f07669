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
from cacheproxy.upstreams.ram_budget import BudgetLearner
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


def test_a_load_that_did_not_happen_halves_what_was_cached_after_the_entry() -> None:
    """The entry was evicted, so the server kept less than it and all cached after it: the
    budget comes down to half of what came after (a server may keep none of those either),
    and what does not fit leaves oldest first, remembered for a later load to raise it."""
    cache = sized(8192 * MIB)
    for base, size in ((1000, MIB), (3000, 2 * MIB), (5000, 2 * MIB)):
        cache.save(tuple(range(base, base + 100)), size)
    first = cache.entries()[0]
    learner = BudgetLearner(sized)
    seen = learner.load_seen(cache.entries(), first.entry_id, 100)
    assert (seen.entry_bytes, seen.newer_bytes) == (MIB, 4 * MIB)
    cache.load_finished(first.entry_id, restored=True)  # the shadow replayed the load
    rebuilt = learner.shrunk(cache, seen)
    assert rebuilt is not None and rebuilt.limit_bytes == 2 * MIB
    assert [entry.tokens[0] for entry in rebuilt.entries()] == [5000]
    assert [ghost.tokens[0] for ghost in learner.ghosts] == [3000]
    # nothing after it: the entry alone was over the budget, and the budget is halved at most
    alone = learner.load_seen(rebuilt.entries(), rebuilt.entries()[0].entry_id, 100)
    assert learner.shrunk(rebuilt, alone).limit_bytes == MIB
    assert learner.shrunk(sized(8192 * MIB), alone).limit_bytes == 2 * MIB - 1
    # a budget at or under the bound already is left as it is
    assert learner.shrunk(sized(MIB), seen) is not None  # halved: 0.5 MiB
    assert learner.shrunk(sized(1), seen) is None


def shadow_after_a_miss(others_busy: bool) -> RamCacheShadow:
    """A conversation cached, its next turn sent without `id_slot` (the server picks) while
    another slot is busy or not, and the server's answer showing no load at all."""
    rng = random.Random(5)
    cached, other = ([rng.randrange(300, 20000) for _ in range(600)] for _ in range(2))
    shadow = shadow_at(8192)
    empty = [ShadowSlot(1, [], False), ShadowSlot(2, [], False)]
    shadow.dispatched([ShadowSlot(0, cached, False), *empty], 0, cached, other)  # saved
    slots = [ShadowSlot(0, other, others_busy), *empty]
    follow_up = [*cached, 1, 2, 3]
    picked = shadow.pick(slots, follow_up)
    assert picked is not None and picked[1].cache_n == len(cached)
    slot_id = picked[0]
    held = next(slot.tokens for slot in slots if slot.slot_id == slot_id)
    shadow.dispatched(slots, slot_id, held, follow_up, pinned=False)
    shadow.observed(follow_up, picked[1].cache_n, 0, slot_id)
    return shadow


def test_a_load_missed_beside_a_running_task_says_nothing_of_the_budget() -> None:
    """A task the server places beside a running one may find its entry taken by a task
    whose launch came first there: only a load missed with no other task running (or pinned)
    lowers the budget."""
    assert shadow_after_a_miss(others_busy=True).budget_bytes == 8192 * MIB
    assert shadow_after_a_miss(others_busy=False).budget_bytes < 8192 * MIB


# --- how far a learnt budget is counted on ---------------------------------------------------


def counted_on(server: ReferenceServer, shadow: RamCacheShadow, seed: int = 1) -> list[bool]:
    """`surprises`' users and turns, every answer shown to the shadow (as the proxy does): for
    each load the shadow predicted as proven, whether the server made it."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(300, 20000) for _ in range(600)] for _ in range(USERS)]
    table: list[list[int]] = [[] for _ in range(N_SLOTS)]
    made = []
    for step in range(USERS * TURNS):
        user, slot_id = step % USERS, step % N_SLOTS
        prompt = prompts[user]
        view = [ShadowSlot(i, tokens, False) for i, tokens in enumerate(table)]
        predicted = shadow.predict(view, slot_id, prompt)
        shadow.dispatched(view, slot_id, table[slot_id], prompt)
        generated = [rng.randrange(300, 20000) for _ in range(4)]
        cache_n = server.run(slot_id, prompt, generated)
        shadow.observed(prompt, predicted.cache_n, cache_n, slot_id)
        if predicted.entry_id is not None and predicted.proven:
            made.append(cache_n == predicted.cache_n)
        table[slot_id] = prompt + generated[:-1]
        prompts[user] = prompt + generated + [rng.randrange(300, 20000) for _ in range(40)]
    return made


def test_a_learnt_budget_is_counted_on_only_as_far_as_the_server_has_shown_it() -> None:
    """The server keeps about two conversations, the shadow believes 8 GiB: a user's return
    is a load that does not happen, and none is counted on; every load counted on, once the
    server has made some, happens."""
    made = counted_on(ReferenceServer(2), shadow_at(8192))
    assert all(made), made


def test_a_server_keeping_everything_proves_the_budget_as_it_serves() -> None:
    """The server keeps everything: the first returns are chances (nothing shown yet), the
    loads it makes prove the budget as far as they reach, and a return within that is counted
    on, and made (conversations that grow every turn stay a little past it)."""
    learning = shadow_at(8192)
    made = counted_on(ReferenceServer(8192), learning)
    assert made and all(made), made
    assert learning.proven_bytes > (USERS - 1) * 600 * BYTES_PER_TOKEN  # about all of them
    assert learning.budget_bytes == 8192 * MIB  # never contradicted


def test_a_budget_taken_as_a_fact_is_counted_on_from_the_start() -> None:
    made = counted_on(ReferenceServer(8192), shadow_at(8192, learn=False))
    assert len(made) == USERS * (TURNS - 1) and all(made)


def test_what_the_server_was_seen_to_keep_is_the_proven_budget() -> None:
    """A load made proves its entry and all cached after it; a load missed caps what was
    proven at the budget it leaves; a restart proves nothing any more; a ghost loaded proves
    it, the ghosts cached after it and the live entries."""
    cache = sized(8192 * MIB)
    for base, size in ((1000, MIB), (3000, 2 * MIB), (5000, 2 * MIB)):
        cache.save(tuple(range(base, base + 100)), size)
    learner = BudgetLearner(sized)
    assert not learner.proves(1)
    second = learner.load_seen(cache.entries(), cache.entries()[1].entry_id, 100)
    learner.confirmed(second)
    assert learner.proven_bytes == 4 * MIB
    assert learner.proves(4 * MIB) and not learner.proves(4 * MIB + 1)
    first = learner.load_seen(cache.entries(), cache.entries()[0].entry_id, 100)
    cache.load_finished(cache.entries()[0].entry_id, restored=True)
    rebuilt = learner.shrunk(cache, first)  # down to 2 MiB, the entry at 3000 a ghost
    assert rebuilt is not None and learner.proven_bytes == 2 * MIB
    learner.forget()
    assert learner.proven_bytes == 0
    learner.evicted(cache.entries()[:1])  # the entry at 3000, dropped again
    grown = learner.grown(rebuilt, [*range(3000, 3100), 7], 100)
    assert grown is not None and learner.proven_bytes == 4 * MIB


def test_the_disk_tier_is_not_told_to_skip_a_save_on_an_unproven_budget() -> None:
    """A save is skipped on the RAM cache's word only when all the shadow would then hold is
    within what the server has shown it keeps."""
    first, second = list(range(1000, 1600)), list(range(5000, 5600))
    slots = [ShadowSlot(0, first, False), ShadowSlot(1, [], False)]
    learning = shadow_at(8192)
    assert not learning.will_keep(slots, 0, first, second)
    assert shadow_at(8192, learn=False).will_keep(slots, 0, first, second)
    # the server loads `first` back with `second` cached after it: that much is proven
    learning.dispatched(slots, 0, first, second)  # `first` saved
    back = [*first, 7, 8]
    after = [ShadowSlot(0, second, False), ShadowSlot(1, [], False)]
    predicted = learning.predict(after, 0, back)
    assert predicted.entry_id is not None and not predicted.proven
    learning.dispatched(after, 0, second, back)  # `second` saved, `first` loaded
    assert not learning.observed(back, predicted.cache_n, predicted.cache_n, 0)
    now = [ShadowSlot(0, back, False), ShadowSlot(1, [], False)]
    assert learning.will_keep(now, 0, back[:400], second)  # less than was shown: within it
