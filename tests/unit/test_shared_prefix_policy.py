"""The `shared-prefix` policy against a model of a unified llama.cpp KV cache: cells with a
position, the token they were decoded for, and the set of sequences holding them; `seq_rm` and
`seq_cp` behave as in llama-kv-cache.cpp (seq_cp within one stream adds the destination to the
source's cells). After every step each sequence must hold exactly one cell per position of the
tokens the policy says it holds, and cells are never duplicated where the policy says shared."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from cacheproxy_plugins.prompt_cache_shared_prefix import SharedPrefixCache, SharedPrefixOptions

from cacheproxy.embedded.prompt_cache import (
    KvOp,
    PromptCacheDeps,
    PromptCachePolicy,
    SeqCopy,
    SharedKvPolicy,
    SlotView,
)

BYTES_PER_CELL = 100
N_SLOTS = 2


@dataclass
class Cell:
    pos: int
    token: int
    seqs: set[int] = field(default_factory=set)


class UnifiedKv:
    """The cell bookkeeping of one KV stream, as llama.cpp keeps it."""

    def __init__(self) -> None:
        self.cells: list[Cell] = []

    def run(self, ops: Sequence[KvOp]) -> None:
        for op in ops:
            if isinstance(op, SeqCopy):
                p0 = max(op.p0, 0)
                p1 = op.p1 if op.p1 >= 0 else 1 << 30
                for cell in self.cells:
                    if p0 <= cell.pos < p1 and op.src in cell.seqs:
                        cell.seqs.add(op.dst)
            else:
                p0 = max(op.p0, 0)
                p1 = op.p1 if op.p1 >= 0 else 1 << 30
                for cell in self.cells:
                    if p0 <= cell.pos < p1:
                        cell.seqs.discard(op.seq_id)
        self.cells = [cell for cell in self.cells if cell.seqs]

    def decode(self, seq_id: int, tokens: Sequence[int], start: int) -> None:
        assert self.held(seq_id) == [] or max(c.pos for c in self.of(seq_id)) == start - 1
        for offset, token in enumerate(tokens):
            self.cells.append(Cell(start + offset, token, {seq_id}))

    def of(self, seq_id: int) -> list[Cell]:
        return [cell for cell in self.cells if seq_id in cell.seqs]

    def held(self, seq_id: int) -> list[int]:
        cells = sorted(self.of(seq_id), key=lambda cell: cell.pos)
        assert [cell.pos for cell in cells] == list(range(len(cells))), "a gap or a duplicate"
        return [cell.token for cell in cells]


class Engine:
    """Just enough of the engine's order of calls to drive the policy."""

    def __init__(self, limit_cells: int, spares: int = 8) -> None:
        options = SharedPrefixOptions(
            limit_bytes=limit_cells * BYTES_PER_CELL, spare_sequences=spares
        )
        self.policy = SharedPrefixCache(
            options, PromptCacheDeps(n_slots=N_SLOTS, kv_bytes_per_cell=BYTES_PER_CELL)
        )
        self.kv = UnifiedKv()
        self.slots: list[list[int]] = [[] for _ in range(N_SLOTS)]
        self.decoded = 0

    def run(self, prompt: list[int], output: list[int], cache_prompt: bool = True) -> int:
        """One task on the slot the policy picks; returns the prompt tokens reused."""
        views = [SlotView(index, tuple(tokens)) for index, tokens in enumerate(self.slots)]
        choice = self.policy.choose_slot(prompt, views)
        assert choice.slot_id is not None and not choice.must_defer
        slot = choice.slot_id
        start = self.policy.attach(slot, prompt, cache_prompt)
        self.kv.run(start.ops)
        assert self.kv.held(slot) == prompt[: start.n_past]
        content = prompt + output
        self.kv.decode(slot, content[start.n_past :], start.n_past)
        self.decoded += len(prompt) - start.n_past
        self.slots[slot] = content
        self.kv.run(self.policy.publish(slot, content))
        self.check()
        return start.n_past

    def check(self) -> None:
        policy = self.policy
        policy.check_invariants()
        for slot, tokens in enumerate(self.slots):
            assert self.kv.held(slot) == tokens
        for entry in policy.entries():
            assert self.kv.held(entry.entry_id) == list(entry.tokens)
        report = policy.kv_report()
        # every live cell is in the tree, once: nothing is duplicated
        assert len(self.kv.cells) == report["cells_distinct"]
        assert report["cells_cached"] <= policy.budget_cells
        assert policy.size_bytes() == report["cells_cached"] * BYTES_PER_CELL


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(count)]


def test_it_is_both_kinds_of_policy() -> None:
    policy = Engine(100).policy
    assert isinstance(policy, PromptCachePolicy)
    assert isinstance(policy, SharedKvPolicy) and policy.shares_kv
    assert policy.kv_layout(N_SLOTS, 4096).extra_cells == 100


def test_a_shared_prefix_is_decoded_once_and_held_once() -> None:
    engine = Engine(limit_cells=1000)
    prefix = tokens(1, 200)
    for question in range(6):
        reused = engine.run(prefix + tokens(10 + question, 20), tokens(50 + question, 4))
        assert reused == (0 if question == 0 else 200)
    # the prefix's 200 cells exist once, however many slots and entries hold them
    assert engine.decoded == 200 + 6 * 20
    assert engine.policy.kv_report()["cells_distinct"] == 200 + 6 * 24
    shared = engine.policy.kv_report()["cells_shared"]
    assert shared >= 200


def test_a_repeated_prompt_decodes_its_last_token_and_keeps_one_copy() -> None:
    engine = Engine(limit_cells=1000)
    prompt = tokens(2, 50)
    assert engine.run(prompt, []) == 0
    assert engine.run(prompt, []) == 49
    assert len(engine.kv.cells) == 50  # the last token's second cell was deduplicated


def test_an_overwritten_slot_is_kept_by_a_spare_and_resumed() -> None:
    engine = Engine(limit_cells=1000)
    first, second, third = tokens(3, 100), tokens(4, 100), tokens(5, 100)
    engine.run(first, tokens(6, 3))
    engine.run(second, tokens(7, 3))
    engine.run(third, tokens(8, 3))  # two slots: one of the first two leaves its slot
    # the whole conversation, its answer included, is still there for its next turn
    assert engine.run(first + tokens(6, 3) + tokens(9, 10), []) == 103
    assert engine.run(second + tokens(7, 3) + tokens(10, 10), []) == 103


def test_the_budget_bounds_cells_no_slot_uses_least_recent_first() -> None:
    engine = Engine(limit_cells=250)
    conversations = [tokens(20 + index, 100) for index in range(6)]
    for conversation in conversations:
        engine.run(conversation, [])
    assert engine.policy.kv_report()["cells_cached"] <= 250
    # the most recent ones are cached or in slots; the oldest was evicted
    assert engine.run(conversations[-1] + [1], []) == 100
    assert engine.run(conversations[0] + [1], []) == 0


def test_no_cache_prompt_starts_from_nothing_and_no_budget_still_shares_live_slots() -> None:
    engine = Engine(limit_cells=0)
    prefix = tokens(30, 100)
    engine.run([*prefix, 1], [])
    assert engine.run([*prefix, 2], [], cache_prompt=False) == 0
    assert engine.run([*prefix, 3], []) == 100  # from a live slot's cells
    assert engine.policy.kv_report()["cells_cached"] == 0


def test_spare_ids_run_out_and_are_recycled() -> None:
    engine = Engine(limit_cells=10_000, spares=2)
    for index in range(8):
        engine.run(tokens(40 + index, 30), [])
    assert engine.policy.kv_report()["spares_used"] <= 2


def test_random_traces_keep_the_model_and_the_policy_in_step() -> None:
    rng = random.Random(7)
    prefixes = [tokens(100 + index, rng.randrange(5, 60)) for index in range(4)]
    engine = Engine(limit_cells=300, spares=4)
    for step in range(300):
        prompt = list(rng.choice(prefixes)) + tokens(1000 + rng.randrange(40), rng.randrange(1, 30))
        if rng.random() < 0.3:
            prompt = prompt[: rng.randrange(1, len(prompt) + 1)]
        engine.run(prompt, tokens(5000 + step, rng.randrange(0, 5)), rng.random() > 0.1)


# --- probation: cached cells no task has reused are few, and evicted first --------------------


def test_one_shot_tails_stay_on_probation_while_the_shared_prefix_is_kept() -> None:
    """Every cached cell costs every decode (attention spans the whole unified cache), so tails
    never asked for again must not fill the byte budget; the prefix they hang off stays."""
    engine = Engine(limit_cells=2000, spares=16)
    policy = engine.policy
    prefix = tokens(60, 100)
    for question in range(40):
        reused = engine.run(prefix + tokens(200 + question, 20), tokens(400 + question, 5))
        assert reused == (0 if question == 0 else 100)
    report = policy.kv_report()
    # without probation the tails (25 cells each) would fill the spares up to the budget
    assert report["cells_cached"] <= 100 + policy.options.probation_share * 2000
    assert policy.probation_cap < int(policy.options.probation_share * 2000)  # and it shrank
    assert report["cells_probation"] <= policy.probation_cap


def test_a_reused_entry_outlives_newer_entries_never_reused() -> None:
    engine = Engine(limit_cells=400, spares=16)
    kept = tokens(70, 100)
    engine.run(kept, [])
    engine.run([*kept, 1], [])  # reused once: off probation
    for index in range(12):  # newer entries, each used once, pass through both slots
        engine.run(tokens(80 + index, 60), [])
    assert engine.run([*kept, 2], []) == 100


def test_probation_grows_when_prompts_want_what_it_evicted() -> None:
    """Conversations coming back after more than probation holds: the first round misses,
    the segment grows by what was missed, and later rounds find their history."""
    engine = Engine(limit_cells=1600, spares=16)  # room for all six, not on probation
    policy = engine.policy
    start_cap = policy.probation_cap
    assert start_cap < 6 * 150
    histories = [tokens(90 + user, 150) for user in range(6)]
    reused_per_round = []
    for round_ in range(4):
        reused = 0
        for user, history in enumerate(histories):
            question = tokens(1000 + 10 * user + round_, 5)
            reused += engine.run(history + question, [])
            histories[user] = history + question
        reused_per_round.append(reused)
    assert policy.probation_cap > start_cap
    assert reused_per_round[-1] > reused_per_round[1]
    assert reused_per_round[-1] >= sum(len(history) - 6 for history in histories) - 2 * 160


def test_probation_off_still_keeps_reused_prefixes() -> None:
    engine = Engine(limit_cells=1000)
    engine.policy = SharedPrefixCache(
        SharedPrefixOptions(limit_bytes=1000 * BYTES_PER_CELL, probation_share=0.0),
        PromptCacheDeps(n_slots=N_SLOTS, kv_bytes_per_cell=BYTES_PER_CELL),
    )
    prefix = tokens(110, 80)
    for question in range(8):
        reused = engine.run(prefix + tokens(120 + question, 10), tokens(130 + question, 2))
        assert reused == (0 if question == 0 else 80)
    assert engine.policy.kv_report()["cells_cached"] <= 80 + 12
