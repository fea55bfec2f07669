"""The `shared-prefix` policy against a model of a unified llama.cpp KV cache: cells with a
position, the token they were decoded for, and the set of sequences holding them; `seq_rm` and
`seq_cp` behave as in llama-kv-cache.cpp (seq_cp within one stream adds the destination to the
source's cells). After every step each sequence must hold exactly one cell per position of the
tokens the policy says it holds, and cells are never duplicated where the policy says shared.
Spilled cells go to a host-RAM store keyed by entry id, and come back as fresh cells."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from cacheproxy_plugins.prompt_cache_shared_prefix import SharedPrefixCache, SharedPrefixOptions

from cacheproxy.prompt_cache import (
    EntryId,
    KvCosts,
    KvOp,
    PromptCacheDeps,
    PromptCachePolicy,
    RestoreCells,
    SeqCopy,
    SharedKvPolicy,
    SlotView,
    SpillCells,
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
        self.host: dict[EntryId, list[tuple[int, int]]] = {}  # spilled (position, token)s
        self.restores = 0

    def run(self, ops: Sequence[KvOp]) -> bool:
        restored = True
        for op in ops:
            if isinstance(op, SpillCells):
                assert not self.of(op.via), "the transfer sequence is left empty"
                self.host[op.entry_id] = sorted(
                    (cell.pos, cell.token) for cell in self.of(op.src) if op.p0 <= cell.pos < op.p1
                )
            elif isinstance(op, RestoreCells):
                saved = self.host.pop(op.entry_id, None)
                if saved is None:
                    restored = False
                    continue
                self.cells += [Cell(pos, token, {op.dst}) for pos, token in saved]
                self.restores += 1
            elif isinstance(op, SeqCopy):
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
        return restored

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

    def __init__(
        self, limit_cells: int, spares: int = 8, spill_after_tokens: float | None = None
    ) -> None:
        options = SharedPrefixOptions(
            limit_bytes=limit_cells * BYTES_PER_CELL,
            spare_sequences=spares,
            spill_after_tokens=spill_after_tokens,
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
        back = self.policy.bring_back(prompt, cache_prompt)
        restored = self.kv.run(back.ops)
        if back.seq_id is not None:
            self.kv.run(self.policy.bring_back_finished(back.seq_id, restored))
        start = self.policy.attach(slot, prompt, cache_prompt)
        self.kv.run(start.ops)
        self.sync_idle_slots(busy=slot)
        assert self.kv.held(slot) == prompt[: start.n_past]
        content = prompt + output
        self.kv.decode(slot, content[start.n_past :], start.n_past)
        self.decoded += len(prompt) - start.n_past
        self.slots[slot] = content
        self.kv.run(self.policy.publish(slot, content))
        self.sync_idle_slots(busy=None)
        self.check()
        return start.n_past

    def sync_idle_slots(self, busy: int | None) -> None:
        """As the engine does: an idle slot the policy emptied holds nothing any more, and
        host copies of entries the policy dropped are freed."""
        spilled = self.policy.spilled_ids()
        self.kv.host = {entry: cells for entry, cells in self.kv.host.items() if entry in spilled}
        for slot, held in enumerate(self.slots):
            if slot != busy:
                self.slots[slot] = held[: self.policy.held_by(slot)]

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
        # every spilled entry has its host copy, counted in the budget once
        assert set(self.kv.host) == set(policy.spilled_ids())
        assert sum(len(cells) for cells in self.kv.host.values()) == report["cells_spilled"]


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


# --- spilling: cold cells leave the KV cache (attention spans all of it) for host RAM ----------


def test_cold_cells_leave_the_kv_cache_and_come_back_without_a_decode() -> None:
    """With cells spilled as soon as a token passes them by, the KV cache holds only the last
    slot's content; a prompt that runs into spilled cells gets them back, not decoded again."""
    engine = Engine(limit_cells=2000, spares=8, spill_after_tokens=1)
    kept = Engine(limit_cells=2000, spares=8)  # the same trace, never spilling
    prefixes = [tokens(300 + group, 100) for group in range(4)]
    for step in range(16):
        prompt = prefixes[step % 4] + tokens(400 + step, 10)
        reused = engine.run(prompt, tokens(500 + step, 3))
        assert reused == kept.run(prompt, tokens(500 + step, 3))
        assert reused == (0 if step < 4 else 100)
        report = engine.policy.kv_report()
        # resident: only what the last task ran on (its slot, nothing cached beside it)
        assert len(engine.kv.cells) == len(prompt) + 3
        assert report["cells_spilled"] > 0 or step == 0
    assert engine.decoded == kept.decoded
    assert engine.kv.restores >= 12


def test_a_prefix_stays_resident_while_it_is_in_use() -> None:
    """Below the threshold nothing moves: a prefix reused before it goes cold is shared in
    the KV cache as without spilling, and what nobody used for longer leaves it."""
    engine = Engine(limit_cells=2000, spares=8, spill_after_tokens=60)
    prefix = tokens(600, 100)
    engine.run(prefix + tokens(601, 10), [])
    engine.run(prefix + tokens(602, 10), [])  # 10 tokens later: still resident, shared
    assert engine.kv.restores == 0 and engine.policy.kv_report()["cells_spilled"] == 0
    for index in range(4):  # other work: the first conversation's cells go cold
        engine.run(tokens(700 + index, 40), [])
    assert engine.policy.kv_report()["cells_spilled"] > 0
    assert engine.run(prefix + tokens(603, 10), []) == 100
    assert engine.kv.restores >= 1


def test_an_idle_slot_hands_its_cells_on_and_its_conversation_resumes() -> None:
    engine = Engine(limit_cells=2000, spares=8, spill_after_tokens=30)
    first = tokens(800, 50)
    engine.run(first, tokens(801, 2))
    for index in range(3):
        engine.run(tokens(810 + index, 40), [])
    # no slot holds the first conversation any more; it resumes from host RAM
    assert all(len(held) != 52 for held in engine.slots)
    assert engine.run(first + tokens(801, 2) + [7], []) == 52


def test_a_lost_spilled_entry_is_decoded_again() -> None:
    engine = Engine(limit_cells=2000, spares=8, spill_after_tokens=0)
    prefix = tokens(900, 80)
    engine.run([*prefix, 1], [])
    engine.run(tokens(901, 30), [])
    lost = [entry for entry, cells in engine.kv.host.items() if cells[0] == (0, prefix[0])]
    assert lost
    for entry in lost:  # the host copy is gone (as after an allocation that failed)
        del engine.kv.host[entry]
    assert engine.run([*prefix, 2], []) == 0
    engine.check()
    assert engine.run([*prefix, 3], []) == 80


def test_random_traces_with_spilling_keep_the_model_and_the_policy_in_step() -> None:
    for spill_after in (0, 15, 80):
        rng = random.Random(spill_after)
        prefixes = [tokens(100 + index, rng.randrange(5, 60)) for index in range(4)]
        engine = Engine(limit_cells=300, spares=4, spill_after_tokens=spill_after)
        for step in range(300):
            prompt = list(rng.choice(prefixes)) + tokens(
                1000 + rng.randrange(40), rng.randrange(1, 30)
            )
            if rng.random() < 0.3:
                prompt = prompt[: rng.randrange(1, len(prompt) + 1)]
            engine.run(prompt, tokens(5000 + step, rng.randrange(0, 5)), rng.random() > 0.1)


def test_the_measured_costs_decide_when_cells_spill() -> None:
    """Keep a cell while the attention it has cost since its last use is below what moving
    it out and back costs: spill after round trip / attention-per-token tokens."""
    policy = Engine(limit_cells=100).policy
    assert policy.needs_costs() and policy.kv_report()["spill_after_tokens"] == -1
    policy.set_costs(KvCosts(attention_s_per_cell_token=2e-8, round_trip_s_per_cell=3e-6))
    assert policy.kv_report()["spill_after_tokens"] == 150
    policy.set_costs(KvCosts(attention_s_per_cell_token=0.0, round_trip_s_per_cell=3e-6))
    assert policy.kv_report()["spill_after_tokens"] == -1  # held cells cost nothing: keep them
    fixed = Engine(limit_cells=100, spill_after_tokens=500).policy
    assert not fixed.needs_costs()
    fixed.set_costs(KvCosts(attention_s_per_cell_token=1.0, round_trip_s_per_cell=1.0))
    assert fixed.kv_report()["spill_after_tokens"] == 500


def test_spills_and_restores_go_through_the_transfer_sequence() -> None:
    engine = Engine(limit_cells=1000, spares=8, spill_after_tokens=1)
    assert engine.policy.kv_layout(N_SLOTS, 4096).transfer_sequences == 1
    transfer = N_SLOTS + 8  # after the slots and the spares
    ops: list[KvOp] = []
    run = engine.kv.run
    engine.kv.run = lambda batch: ops.extend(batch) or run(batch)  # type: ignore[method-assign]
    first = tokens(950, 40)
    engine.run(first, [])
    engine.run(tokens(951, 20), [])
    assert engine.run([*first, 1], []) == 40
    spills = [op for op in ops if isinstance(op, SpillCells)]
    restores = [op for op in ops if isinstance(op, RestoreCells)]
    assert spills and restores
    assert all(op.via == transfer for op in [*spills, *restores])
    assert not any(isinstance(op, SeqCopy) and transfer in (op.src, op.dst) for op in ops)
