"""The engine's KV operations: its sequences trimmed, cleared, shared and copied, their states
read out and written back, as the prompt-cache policy decides.

A policy that copies (llama-server's RAM cache and its kind) answers each launch in the steps
and the order of `cacheproxy.prompt_cache`: the slot to use, save its state to host RAM, load a
cached state into it, drop what the cache evicted, then cache idle slots. The entries' bytes are
kept here, copied in and out with `llama_state_seq_get_data_ext` / `llama_state_seq_set_data_ext`.

A policy that shares KV (`SharedKvPolicy`) gets a unified KV cache instead, with spare sequence
ids beyond the slots and extra cells for its cached prefixes; it answers in `llama_memory_seq_cp`
/ `seq_rm` operations, and in spills and restores of cells to and from host RAM (sequence states,
kept here by entry id), having been told what a held cell and a spill cost on this context
(kv_costs, measured at start).

Everything here runs on the worker thread that owns the context, except `sharing_report`, which
reads the snapshot taken after the last KV decision.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import llama_cpp as llama

from cacheproxy.embedded.kv_costs import measure_kv_costs
from cacheproxy.embedded.tasks import CompletionTask, EngineSlot, EngineStats
from cacheproxy.prompt_cache import (
    EntryId,
    KvOp,
    PromptCachePolicy,
    RestoreCells,
    SeqCopy,
    SeqRemove,
    SharedKvPolicy,
    SlotView,
    SpillCells,
)

log = logging.getLogger(__name__)

STATE_FLAGS = 0  # LLAMA_STATE_SEQ_FLAGS_NONE, as llama-server saves its slots


class EngineKv:
    def __init__(
        self,
        ctx: Any,
        policy: PromptCachePolicy,
        shared: SharedKvPolicy | None,
        slots: list[EngineSlot],
        stats: EngineStats,
    ) -> None:
        self.ctx = ctx
        self._memory = llama.llama_get_memory(ctx)
        # the model's sliding attention window (0: none): what a reused prefix must still hold
        self._n_swa = llama.llama_model_n_swa(llama.llama_get_model(ctx))
        self.policy = policy
        self.shared = shared  # the policy, when it shares KV
        self._slots = slots
        self._stats = stats
        self._ram_entries: dict[EntryId, ctypes.Array[ctypes.c_uint8]] = {}
        self._report: dict[str, int] = {}  # the sharing policy's, for other threads

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def measure_costs(self, batch: Any, n_batch: int, n_vocab: int) -> None:
        """Tell a sharing policy that asks what a held cell and a spill cost on this context."""
        if self.shared is None or not self.shared.needs_costs():
            return
        # a slot's and a spare's sequence ids, in the still empty cache
        try:
            costs = measure_kv_costs(
                self.ctx, batch, n_batch, n_vocab, held_seq=len(self._slots), active_seq=0
            )
        except RuntimeError:
            log.warning("could not measure KV cell costs: cached cells stay in the KV cache")
        else:
            self.shared.set_costs(costs)
        self._report = self.shared.kv_report()

    # -------------------------------------------------------------------- placing a task

    def views(self) -> list[SlotView]:
        return [
            SlotView(slot.id, tuple(slot.tokens), slot.busy, slot.t_last_used)
            for slot in self._slots
        ]

    def place(self, task: CompletionTask) -> EngineSlot | None:
        """The slot the policy places the task on, its KV made ready for it (what the slot
        holds, or a cached prefix, is what the task may reuse); None: the task waits."""
        prompt = task.prompt
        choice = self.policy.choose_slot(
            prompt, self.views(), requested_slot_id=task.requested_slot_id
        )
        if choice.must_defer or choice.slot_id is None:
            return None
        slot = self._slots[choice.slot_id]
        if self.shared is not None:
            self._bring_back(prompt, task.cache_prompt)
            start = self.shared.attach(slot.id, prompt, task.cache_prompt)
            self.run(start.ops)
            slot.tokens = list(prompt[: start.n_past])
            return slot
        if choice.save_slot:
            self._save_to_ram(slot)
        if choice.try_load:
            self._load_from_ram(slot, prompt)
        if choice.update_cache:
            self._drop_entries(self.policy.update())
        return slot

    def cache_idle_slots(self) -> None:
        """A copying policy's last step of a launch: the idle slots it caches (and clears)."""
        plan = self.policy.idle_slots_to_cache(self.views())
        for slot_id in plan.slot_ids:
            idle = self._slots[slot_id]
            if self._save_to_ram(idle):
                self._drop_entries(self.policy.update())
            if plan.clear_after_save:
                self.clear(idle)

    def keep(self, slot: EngineSlot, n_past: int) -> int:
        """The slot keeps only its first `n_past` tokens (a task reuses them), or none where its
        memory does not hold all that the next token needs of them: returns what it kept. A
        state loaded from the RAM cache or a slot file holds only the last `n_swa` cells of a
        sliding-window model's window layers (`llama_kv_cache::state_write`), and the token
        after `n_past` attends over the `n_swa` positions up to its own: a prefix shorter than
        the state's all but one token lacks some (another answer than a prefill gives;
        llama-server's `pos_min_thold` check). A recurrent state cannot be cut short at all
        (`seq_rm` refuses)."""
        if n_past > 0 and not self._window_held(slot, n_past):
            n_past = 0
        if not llama.llama_memory_seq_rm(self._memory, slot.id, n_past, -1):
            n_past = 0
            llama.llama_memory_seq_rm(self._memory, slot.id, -1, -1)
        del slot.tokens[n_past:]
        return n_past

    def _window_held(self, slot: EngineSlot, n_past: int) -> bool:
        """Whether the slot's sequence holds the cells of the sliding window before position
        `n_past` (all of them, for a model without one)."""
        if self._n_swa <= 0:
            return True
        first = llama.llama_memory_seq_pos_min(self._memory, slot.id)
        return 0 <= first <= max(0, n_past - self._n_swa + 1)

    def clear(self, slot: EngineSlot) -> None:
        llama.llama_memory_seq_rm(self._memory, slot.id, -1, -1)
        slot.tokens = []
        self.reset_shared(slot)

    def published(self, slot: EngineSlot) -> None:
        """The slot's task ended: what it decoded joins a sharing policy's prefixes."""
        if self.shared is not None:
            self.run(self.shared.publish(slot.id, tuple(slot.tokens)))

    # ------------------------------------------------------------------ the copying RAM tier

    def _save_to_ram(self, slot: EngineSlot) -> bool:
        """`save()` the slot and copy its state if the policy stores it; True when stored."""
        size = llama.llama_state_seq_get_size_ext(self.ctx, slot.id, STATE_FLAGS)
        # the size llama-server would measure for the same tokens (see state_format)
        decision = self.policy.save(tuple(slot.tokens), size)
        self._drop_entries(decision.evicted)
        if not decision.stored or decision.entry_id is None:
            return False
        try:
            data = (ctypes.c_uint8 * size)()
        except MemoryError:
            self._drop_entries(self.policy.allocation_failed(decision.entry_id))
            return False
        llama.llama_state_seq_get_data_ext(self.ctx, data, size, slot.id, STATE_FLAGS)
        self._ram_entries[decision.entry_id] = data
        self._stats.ram_cache_saves += 1
        return True

    def _load_from_ram(self, slot: EngineSlot, prompt: Sequence[int]) -> None:
        found = self.policy.load(tuple(slot.tokens), prompt)
        if found.entry_id is None:
            return
        data = self._ram_entries.get(found.entry_id)
        restored = data is not None and (
            llama.llama_state_seq_set_data_ext(self.ctx, data, len(data), slot.id, STATE_FLAGS)
            == len(data)
        )
        self.policy.load_finished(found.entry_id, restored)
        if restored:
            slot.tokens = list(found.tokens)
            self._stats.ram_cache_restores += 1
        else:
            self.clear(slot)
        self._sync_entries()

    def _drop_entries(self, entry_ids: Sequence[EntryId]) -> None:
        for entry_id in entry_ids:
            self._ram_entries.pop(entry_id, None)

    def _sync_entries(self) -> None:
        """Free the bytes of entries the policy no longer lists (a restored entry leaves some
        caches without being reported as evicted)."""
        cached = {entry.entry_id for entry in self.policy.entries()}
        for entry_id in [entry_id for entry_id in self._ram_entries if entry_id not in cached]:
            del self._ram_entries[entry_id]

    # ------------------------------------------------------------------- the sharing policy

    def run(self, ops: Sequence[KvOp]) -> bool:
        """Run a KV-sharing policy's operations in order; False if a restore failed (the
        rest still run: the policy's bookkeeping expects them)."""
        restored = True
        for op in ops:
            if isinstance(op, SeqCopy):
                llama.llama_memory_seq_cp(self._memory, op.src, op.dst, op.p0, op.p1)
            elif isinstance(op, SeqRemove):
                llama.llama_memory_seq_rm(self._memory, op.seq_id, op.p0, op.p1)
            elif isinstance(op, SpillCells):
                self._spill(op)
            elif isinstance(op, RestoreCells):
                restored = self._restore_spilled(op) and restored
        if self.shared is not None:
            if any(isinstance(op, SpillCells | RestoreCells) for op in ops) or len(
                self._ram_entries
            ):
                spilled = self.shared.spilled_ids()
                for entry_id in [entry for entry in self._ram_entries if entry not in spilled]:
                    del self._ram_entries[entry_id]
            for slot in self._slots:
                # An idle slot the policy parked still holds its tokens, as llama-server's
                # would (the proxy relies on idle slots keeping them), as long as the cache
                # can give them back: unpark() does so before its KV is read.
                if not slot.busy and len(slot.tokens) > self.shared.held_by(slot.id):
                    del slot.tokens[self.shared.retained(slot.tokens) :]
            # a snapshot for other threads: the tree is the worker's alone
            self._report = self.shared.kv_report()
        return restored

    def _bring_back(self, tokens: Sequence[int], cache_prompt: bool) -> None:
        """What the sharing policy spilled of `tokens` back into the KV cache, as it decides."""
        assert self.shared is not None
        back = self.shared.bring_back(tokens, cache_prompt)
        restored = self.run(back.ops)
        if back.seq_id is not None:
            self.run(self.shared.bring_back_finished(back.seq_id, restored))

    def _spill(self, op: SpillCells) -> None:
        """The cells go to host RAM through the transfer sequence (seq_cp shares, no copy)."""
        llama.llama_memory_seq_cp(self._memory, op.src, op.via, op.p0, op.p1)
        size = llama.llama_state_seq_get_size_ext(self.ctx, op.via, STATE_FLAGS)
        try:
            data = (ctypes.c_uint8 * size)()
        except MemoryError:
            log.warning("no memory to spill %d KV cells: they will be decoded again", size)
        else:
            llama.llama_state_seq_get_data_ext(self.ctx, data, size, op.via, STATE_FLAGS)
            self._ram_entries[op.entry_id] = data
        llama.llama_memory_seq_rm(self._memory, op.via, -1, -1)

    def _restore_spilled(self, op: RestoreCells) -> bool:
        data = self._ram_entries.pop(op.entry_id, None)
        restored = data is not None and (
            llama.llama_state_seq_set_data_ext(self.ctx, data, len(data), op.via, STATE_FLAGS)
            == len(data)
        )
        if restored:
            llama.llama_memory_seq_cp(self._memory, op.via, op.dst, -1, -1)
            self._stats.ram_cache_restores += 1
        llama.llama_memory_seq_rm(self._memory, op.via, -1, -1)
        return restored

    def unpark(self, slot: EngineSlot) -> None:
        """Put a parked idle slot's content back in its own sequence (shared, not copied)."""
        shared = self.shared
        if shared is None or shared.held_by(slot.id) >= len(slot.tokens):
            return
        tokens = tuple(slot.tokens)
        self._bring_back(tokens, True)
        start = shared.attach(slot.id, tokens, True, whole=True)
        self.run(start.ops)
        slot.tokens = list(tokens[: start.n_past])
        self.run(shared.publish(slot.id, tuple(slot.tokens)))

    def reset_shared(self, slot: EngineSlot) -> None:
        """The slot's KV was replaced here, not through the policy: tell it."""
        if self.shared is not None:
            self.run(self.shared.reset(slot.id, tuple(slot.tokens)))

    def sharing_report(self, kv_bytes_per_cell: int) -> dict[str, int]:
        """Cell counts of a KV-sharing policy (empty otherwise), and the cells each slot holds
        (shared or its own) and the cache holds alone, as of the last KV decision."""
        if self.shared is None:
            return {}
        report = {f"kv_{name}": value for name, value in self._report.items()}
        report["kv_bytes_per_cell"] = kv_bytes_per_cell
        for slot in self._slots:
            report[f'kv_cells_held_by{{holder="slot_{slot.id}"}}'] = len(slot.tokens)
        report['kv_cells_held_by{holder="cache"}'] = report.get("kv_cells_cached", 0)
        return report

    # ----------------------------------------------------------------- a slot's whole state

    def read_state(self, slot: EngineSlot) -> bytes:
        """The slot's sequence state, as llama.cpp writes it (after any parked part is back)."""
        self.unpark(slot)
        size = llama.llama_state_seq_get_size_ext(self.ctx, slot.id, STATE_FLAGS)
        state = (ctypes.c_uint8 * size)()
        llama.llama_state_seq_get_data_ext(self.ctx, state, size, slot.id, STATE_FLAGS)
        return bytes(state)

    def write_state(self, slot: EngineSlot, data: bytes) -> bool:
        """Write a sequence state into the slot; False when llama.cpp took less than all of it
        (no room in the KV cache, or not a state it can read)."""
        state = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        read = llama.llama_state_seq_set_data_ext(self.ctx, state, len(state), slot.id, STATE_FLAGS)
        return read == len(state)
