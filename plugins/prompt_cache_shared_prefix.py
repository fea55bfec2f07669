"""A prompt cache whose prefixes live once in the engine's unified KV cache, shared by every slot
and every cached entry that holds them (SGLang's RadixAttention idea, on llama.cpp's cells).

In a unified KV cache (one stream for all sequences) `llama_memory_seq_cp(src, dst, p0, p1)`
only adds `dst` to the cells `src` holds: no K/V bytes move; `llama_memory_seq_rm` frees a cell
only when its last sequence lets go of it (shared_prefix_tree.py cites llama.cpp's code). So:

- A radix tree of token runs describes the cells (shared_prefix_tree.py): every sequence (a
  slot, or a spare sequence id holding a cached prefix) holds one root-to-node path, and all
  sequences through a node share its cells, gone when the last holder leaves.
- A slot starts a task from the longest prefix in the tree: it joins those cells with one
  seq_cp (no copy, no decode) and decodes the rest privately. When it is released, what it
  decoded joins the tree; a part some other sequence already holds is deduplicated (the slot
  drops its own cells for it and joins the shared ones).
- Before a slot lets go of content no other sequence holds, a spare sequence id takes it over
  (one seq_cp): the RAM tier, at no copy. Spare-only cells ("cached", no slot uses them) are
  limited by `limit_bytes`, counted once however many entries share them, and evicted a leaf
  node at a time: never reused ones first, then least recently used.
- Cached cells are not free within the budget: attention in a unified cache spans every used
  cell (llama_kv_cache::get_n_kv pads the highest used cell + 1, llama-kv-cache.cpp:1260-1273
  in 0.3.36's vendor tree), masked per sequence, so each one slows every decode. What a task
  leaves behind therefore starts on probation: cells no later task has reused are held to a
  smaller cap that adapts to demand (`probation_share` of the budget to start with, see
  shared_prefix_probation.py), and a reuse moves them out of it.
- Cells nobody uses go to host RAM when holding them costs more than moving them: a cached
  node (or an idle slot's content, handed to a spare first: "parked") unused for
  `spill_after` decoded tokens is read out through a transfer sequence id and freed, so
  attention spans little more than the running slots; a prompt that runs into spilled nodes
  gets them back into a spare sequence (a state write, no decode) and then shares them as
  above. `spill_after` is the engine's measured round-trip cost of a cell over the attention
  a held cell costs per decoded token (ski rental: within 2x of the best offline choice);
  on the small test model it is a few dozen tokens, on a large model far more. A parked slot
  keeps reporting its tokens, as llama-server's idle slots do: the engine takes them back
  before its KV is read (a slot save).

Slot choice: the idle slot sharing the longest prefix with the task (no seq_cp needed), then
one whose content is empty or also held by another sequence (nothing to take over), then the
least recently used, then the lowest id. A requested busy slot, or no idle slot, defers.

The engine cannot know tenants: everything here is shared between all requests it serves. The
proxy never lets two tenants share such an engine (it refuses an upstream with a RAM prompt
cache while tenants exist), and `cache_prompt: false` starts from nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheproxy_plugins.shared_prefix_probation import ProbationCap
from cacheproxy_plugins.shared_prefix_tree import PrefixNode, PrefixTree
from pydantic import BaseModel, ConfigDict, Field

from cacheproxy.prompt_cache import (
    CacheEntry,
    EntryId,
    IdleSlotPlan,
    KvCosts,
    KvLayout,
    KvOp,
    LoadDecision,
    PromptCacheDeps,
    RestoreCells,
    SaveDecision,
    SeqCopy,
    SeqRemove,
    SharedRestore,
    SharedStart,
    SlotChoice,
    SlotView,
    SpillCells,
    slot_by_requested_id,
)
from cacheproxy.tokens import common_prefix_length

MIB = 1 << 20
LLAMA_MAX_SEQ = 256  # llama.cpp's limit on sequence ids in one context (src/llama-cparams.h)


class SharedPrefixOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    limit_bytes: int = Field(
        256 * MIB,
        ge=0,
        description="KV bytes for cached prefixes no slot uses (shared cells counted once);"
        " reserved in the context up front, 0: only live slots share",
    )
    spare_sequences: int = Field(
        64, ge=0, description="sequence ids that hold cached prefixes (at most 256 minus slots)"
    )
    probation_share: float = Field(
        0.375,
        ge=0.0,
        le=1.0,
        description="starting share of limit_bytes for cached cells never reused yet (the"
        " probation segment); it then grows when a prompt wanted what probation evicted and"
        " shrinks when what it evicted is never asked for",
    )
    ghosts: int = Field(
        16, ge=1, description="evicted probation entries remembered to tell a miss from junk"
    )
    spill_after_tokens: float | None = Field(
        None,
        ge=0,
        description="tokens decoded (by any slot) after which a cached cell no slot uses moves"
        " from the KV cache to host RAM, where it costs no attention; unset: the engine's"
        " measured cost of a spill and restore over the attention a held cell costs per token"
        " (a policy used without an engine never spills)",
    )


class SharedPrefixCache:
    """See the module docstring. Pure: decisions are KV operations the engine runs in order."""

    Options = SharedPrefixOptions
    shares_kv = True

    def __init__(self, options: SharedPrefixOptions, deps: PromptCacheDeps | None = None) -> None:
        deps = deps or PromptCacheDeps()
        self.options = options
        self.n_slots = deps.n_slots
        self.kv_bytes_per_cell = max(1, deps.kv_bytes_per_cell)
        self.budget_cells = options.limit_bytes // self.kv_bytes_per_cell
        self._tree = PrefixTree(deps.n_slots)  # which sequence holds which cells
        self._free_spares: list[int] = []
        self._clock = 0
        # what cached cells never reused yet may take: it adapts to demand
        self._probation = ProbationCap(self.budget_cells, options.probation_share, options.ghosts)
        # Spilling: tokens decoded so far (the clock cached cells age by), where each slot's
        # task started, and after how many tokens an unused cached cell leaves the KV cache.
        self._token_clock = 0
        self._n_past: dict[int, int] = {}  # slots attached to a task (busy), and where it began
        self._released_at: dict[int, int] = {}  # the token clock when each slot last published
        self.spill_after: float | None = options.spill_after_tokens
        self._next_entry = 0
        self.layout(deps.n_slots)

    # --------------------------------------------------------------------------- configuration

    def layout(self, n_slots: int) -> None:
        self.n_slots = self._tree.n_slots = n_slots
        spares = max(0, min(self.options.spare_sequences, LLAMA_MAX_SEQ - n_slots - 1))
        self._spare_ids = range(n_slots, n_slots + spares)
        self._free_spares = list(reversed(self._spare_ids))
        self.transfer_seq = n_slots + spares  # the one id spills and restores go through

    def kv_layout(self, n_slots: int, n_ctx_slot: int) -> KvLayout:
        if n_slots != self.n_slots:
            self.layout(n_slots)
        # A cached prefix longer than a slot could never be used again; spare-only cells beyond
        # the budget are evicted before anything is decoded, so this many extra cells suffice.
        return KvLayout(len(self._spare_ids), self.budget_cells, transfer_sequences=1)

    @property
    def probation_cap(self) -> int:
        """What cached cells never reused yet may take, as adapted (shared_prefix_probation.py)."""
        return self._probation.cells

    def needs_costs(self) -> bool:
        return self.options.spill_after_tokens is None

    def set_costs(self, costs: KvCosts) -> None:
        """A held cell costs `attention` per token decoded beside it; moving it out and back
        costs `round_trip` once: keep it while the rent paid since its last use is below the
        price of buying it back (the ski-rental rule, within 2x of the best offline choice)."""
        if self.options.spill_after_tokens is not None:
            return
        if costs.attention_s_per_cell_token > 0:
            self.spill_after = costs.round_trip_s_per_cell / costs.attention_s_per_cell_token
        else:
            self.spill_after = None  # held cells cost nothing measurable: never spill

    def _touch(self, node: PrefixNode) -> None:
        self._clock += 1
        for on_path in self._tree.path(node):
            on_path.last_used = self._clock
            on_path.touched_at = self._token_clock

    # ------------------------------------------------------------------------------ eviction

    def _evict_one(
        self, protected: set[int], probation_only: bool = False
    ) -> tuple[KvOp, ...] | None:
        """Drop a leaf that no slot uses, never reused ones first, least recently used first;
        None if there is none."""
        leaves = self._tree.cached_leaves(protected, probation_only)
        if not leaves:
            return None
        leaf = min(leaves, key=lambda node: (node.hits > 0, node.last_used))
        assert leaf.parent is not None
        if leaf.hits == 0:
            self._probation.evicted(leaf.start, leaf.tokens)
        if leaf.spilled:
            self._tree.drop_spilled(leaf)
            return ()
        return self._let_go(leaf)

    def _let_go(self, leaf: PrefixNode) -> tuple[KvOp, ...]:
        """The spare sequences holding `leaf` (no slot does, nothing resident below it) let go
        of its cells: each then ends at the parent, or is freed if others hold the parent."""
        parent = leaf.parent
        assert parent is not None
        ops: list[KvOp] = []
        for spare in sorted(leaf.holders):
            if parent is self._tree.root or len(parent.holders) > 1:
                # what is left of this entry is held by others too: free the id
                self._free_spare(spare, ops)
            else:
                ops.append(SeqRemove(spare, leaf.start, -1))
                self._tree.move(spare, parent)
        return tuple(ops)

    def _evict_to_budget(self) -> list[KvOp]:
        ops: list[KvOp] = []
        while self._tree.cached > self.budget_cells:
            evicted = self._evict_one(set())
            if evicted is None:
                break
            ops += evicted
        # (probation cells are cached cells: count them only when they might be too many)
        while (
            self._tree.cached > self._probation.cells
            and self._tree.probation_cells() > self._probation.cells
        ):
            evicted = self._evict_one(set(), probation_only=True)
            if evicted is None:
                break
            ops += evicted
        return ops

    # ------------------------------------------------------------ spilling to host RAM
    #
    # A cell in the KV cache costs attention on every token any slot decodes (see the
    # module docstring); in host RAM it costs nothing until a prompt wants it back. A cached
    # node (no slot holds it, nothing resident below it) that has gone `spill_after` tokens
    # without use is spilled: its cells are read out through the transfer sequence and freed.
    # A prompt that runs into spilled nodes gets them back into a spare sequence first
    # (bring_back), and then attaches as to any cached prefix. Spilled cells stay in the
    # budget, counted once like resident ones, and are evicted by the same order.

    def _park_cold_slots(self, horizon: int = 0, exclude: int = -1) -> list[KvOp]:
        """An idle slot unused for `spill_after` tokens hands what it holds to a spare
        sequence and lets go of it, so that its cells can be spilled like any cached ones
        (llama-server with a unified KV cache likewise saves idle slots to its RAM cache and
        clears them, server-context.cpp:2651-2654). A slot whose content others hold too just
        lets go; one no spare can take over keeps it."""
        if self.spill_after is None:
            return []
        ops: list[KvOp] = []
        for slot_id in range(self.n_slots):
            end = self._tree.end(slot_id)
            idle = slot_id not in self._n_past
            unused = self._token_clock + horizon - self._released_at.get(slot_id, 0)
            cold = unused >= self.spill_after
            if end is self._tree.root or not idle or not cold or slot_id == exclude:
                continue
            path = self._tree.path(end)
            if any(node.holders == {slot_id} for node in path):
                if not self._hand_to_spare(slot_id, end, {id(node) for node in path}, ops):
                    continue
            ops.append(SeqRemove(slot_id, -1, -1))
            self._tree.move(slot_id, self._tree.root)
        return ops

    def _spill_cold(self, horizon: int = 0) -> list[KvOp]:
        if self.spill_after is None:
            return []
        ops: list[KvOp] = []
        while True:
            cold = [
                node
                for node in self._tree.nodes()
                if node.holders
                and not self._tree.slot_used(node)
                and all(child.spilled for child in node.children.values())
                and self._token_clock + horizon - node.touched_at >= self.spill_after
            ]
            if not cold:
                return ops
            for node in cold:
                entry_id = EntryId(self._next_entry)
                self._next_entry += 1
                source = min(node.holders)
                ops.append(SpillCells(source, self.transfer_seq, node.start, node.end, entry_id))
                node.entry_id = entry_id
                ops += self._let_go(node)

    def bring_back(self, task_tokens: Sequence[int], cache_prompt: bool) -> SharedRestore:
        if not cache_prompt:
            return SharedRestore()
        deepest, _ = self._tree.match(task_tokens, resident=False)
        path = self._tree.path(deepest)
        spilled = [node for node in path if node.spilled]
        if not spilled:
            return SharedRestore()
        ops: list[KvOp] = []
        spare = self._take_spare({id(node) for node in path}, ops)
        if spare is None:
            return SharedRestore(tuple(ops))
        above = spilled[0].parent
        assert above is not None
        if above is not self._tree.root:
            ops.append(SeqCopy(min(above.holders), spare, 0, above.end))
        for node in spilled:
            assert node.entry_id is not None
            ops.append(RestoreCells(node.entry_id, self.transfer_seq, spare))
            node.entry_id = None
            self._tree.cached -= len(node.tokens)  # counted again, as held by the spare, by move
        self._tree.move(spare, spilled[-1])
        ops += self._drop_redundant_spares(spilled[-1], spare)
        return SharedRestore(tuple(ops), spare)

    def bring_back_finished(self, seq_id: int, restored: bool) -> tuple[KvOp, ...]:
        if restored:
            return ()
        ops: list[KvOp] = []
        self._free_spare(seq_id, ops)  # the half-restored cells are gone
        return tuple(ops)

    def spilled_ids(self) -> frozenset[EntryId]:
        return frozenset(node.entry_id for node in self._tree.nodes() if node.entry_id is not None)

    def _take_spare(self, protected: set[int], ops: list[KvOp]) -> int | None:
        while not self._free_spares:
            evicted = self._evict_one(protected)
            if evicted is None:
                return None
            ops += evicted
        return self._free_spares.pop()

    # ------------------------------------------------------------------------------ decisions

    def choose_slot(
        self,
        task_tokens: Sequence[int],
        slots: Sequence[SlotView],
        *,
        requested_slot_id: int | None = None,
    ) -> SlotChoice:
        slots_by_id = sorted(slots, key=lambda slot: slot.id)
        chosen: SlotView | None = None
        if requested_slot_id not in (None, -1) and slots_by_id:
            chosen = slot_by_requested_id(slots_by_id, requested_slot_id)
            selected_by = "requested"
        else:
            idle = [slot for slot in slots_by_id if not slot.busy]
            if idle:
                chosen = max(idle, key=lambda slot: self._slot_key(slot, task_tokens))
            selected_by = "longest_prefix"
        if chosen is None:
            return SlotChoice(None, "none", must_defer=True, save_slot=False, try_load=False)
        n_common = common_prefix_length(chosen.tokens, task_tokens)
        return SlotChoice(
            slot_id=chosen.id,
            selected_by=selected_by,  # type: ignore[arg-type]
            must_defer=chosen.busy,
            save_slot=False,  # attach() takes over what is worth keeping, without a copy
            try_load=False,
            f_sim=n_common / len(task_tokens) if task_tokens else 0.0,
            f_keep=n_common / len(chosen.tokens) if chosen.tokens else float("nan"),
        )

    def _slot_key(self, slot: SlotView, task_tokens: Sequence[int]) -> tuple[int, int, int, int]:
        end = self._tree.end(slot.id)
        # parked (end is the root), or holding what others hold too: taking it loses nothing
        nothing_to_keep = slot.empty or end is self._tree.root or len(end.holders) > 1
        return (
            common_prefix_length(slot.tokens, task_tokens),
            int(nothing_to_keep),
            -slot.t_last_used,
            -slot.id,
        )

    def attach(
        self, slot_id: int, task_tokens: Sequence[int], cache_prompt: bool, whole: bool = False
    ) -> SharedStart:
        ops: list[KvOp] = []
        node, depth = self._tree.match(task_tokens) if cache_prompt else (self._tree.root, 0)
        if cache_prompt and not whole:
            self._probation.asked(task_tokens, depth)
        # The last prompt token is always decoded again, for its logits; `whole`: the slot
        # takes back all it can of `task_tokens` (content, not a task).
        n_past = max(0, min(depth, len(task_tokens) - (0 if whole else 1)))
        target = self._tree.node_ending_at(node, n_past)
        old_end = self._tree.end(slot_id)
        target_path = self._tree.path(target)
        on_old_path = {id(on_path) for on_path in self._tree.path(old_end)}
        own = target is self._tree.root or id(target) in on_old_path

        # What only this slot holds, beyond where the task starts, would be freed: a spare id
        # takes it over first (one seq_cp, no copy), if the budget can hold it.
        kept = {id(on_path) for on_path in target_path}
        lost_cells = sum(
            len(on_path.tokens)
            for on_path in self._tree.path(old_end)
            if on_path.holders == {slot_id} and id(on_path) not in kept
        )
        if 0 < lost_cells <= self.budget_cells:
            self._hand_to_spare(slot_id, old_end, kept | on_old_path, ops)

        if own:
            ops.append(SeqRemove(slot_id, n_past, -1))
        else:
            source = min(target.holders)  # any holder of the path shares exactly its cells
            ops.append(SeqRemove(slot_id, -1, -1))
            ops.append(SeqCopy(source, slot_id, 0, n_past))
        self._tree.move(slot_id, target)
        self._n_past[slot_id] = n_past
        for reused in target_path:
            reused.hits += 1  # decoded once, used again: off probation
        self._touch(target)
        # The prompt's own tokens are rent every held cell is sure to pay: count them now.
        horizon = len(task_tokens) - n_past
        ops += self._park_cold_slots(horizon)
        ops += self._spill_cold(horizon)
        ops += self._evict_to_budget()
        return SharedStart(tuple(ops), n_past)

    def _drop_redundant_spares(self, end: PrefixNode, keeper: int) -> list[KvOp]:
        """Spares ending above `end` hold a prefix of what `keeper` holds: free their ids."""
        ops: list[KvOp] = []
        above = {id(node) for node in self._tree.path(end)}
        for spare, spare_end in list(self._tree.ends.items()):
            if spare == keeper or self._tree.is_slot(spare):
                continue
            if id(spare_end) in above:
                self._free_spare(spare, ops)
        return ops

    def _hand_to_spare(
        self, slot_id: int, end: PrefixNode, protected: set[int], ops: list[KvOp]
    ) -> bool:
        """A spare sequence takes over what the slot holds, up to `end` (one seq_cp, no copy),
        unless no spare can be had without evicting what `protected` names (by `id`)."""
        spare = self._take_spare(protected, ops)
        if spare is None:
            return False
        ops.append(SeqCopy(slot_id, spare, -1, -1))
        self._tree.move(spare, end)
        ops += self._drop_redundant_spares(end, spare)
        return True

    def _free_spare(self, spare: int, ops: list[KvOp]) -> None:
        """The spare sequence lets go of all it holds; its id is free again."""
        ops.append(SeqRemove(spare, -1, -1))
        self._tree.move(spare, self._tree.root)
        self._free_spares.append(spare)

    def publish(self, slot_id: int, slot_tokens: Sequence[int]) -> tuple[KvOp, ...]:
        end = self._tree.end(slot_id)
        start = end.end
        if len(slot_tokens) < start or tuple(slot_tokens[:start]) != self._tree.tokens(end):
            raise ValueError(f"slot {slot_id} no longer holds the prefix it was attached to")
        ops: list[KvOp] = []
        # tokens decoded since attach (none for a slot the engine filled itself, through reset)
        decoded = len(slot_tokens) - self._n_past.pop(slot_id, len(slot_tokens))
        self._token_clock += max(0, decoded)
        tail = slot_tokens[start:]
        # The part of the tail some other sequence holds already: join its cells, drop ours.
        node, depth = self._tree.match(tail, below=end)
        if depth > 0:
            shared = self._tree.node_ending_at(node, start + depth)
            source = min(shared.holders)
            ops.append(SeqRemove(slot_id, start, start + depth))
            ops.append(SeqCopy(source, slot_id, start, start + depth))
            for reused in self._tree.path(shared)[len(self._tree.path(end)) :]:
                reused.hits += 1  # decoded again by this task: these cells are in demand
            self._tree.move(slot_id, shared)
            end = shared
        rest = tuple(tail[depth:])
        if rest:
            end = self._tree.grow(end, rest)
            self._tree.move(slot_id, end)
        self._touch(end)
        self._released_at[slot_id] = self._token_clock
        ops += self._park_cold_slots(exclude=slot_id)
        ops += self._spill_cold()
        ops += self._evict_to_budget()
        return tuple(ops)

    def held_by(self, seq_id: int) -> int:
        """How many leading tokens the sequence holds in the KV cache (a parked slot: 0)."""
        return self._tree.end(seq_id).end

    def retained(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` some sequence or spilled entry still holds."""
        return self._tree.match(tokens, resident=False)[1]

    def reset(self, slot_id: int, slot_tokens: Sequence[int]) -> tuple[KvOp, ...]:
        self._tree.move(slot_id, self._tree.root)  # its old cells are gone already
        return self.publish(slot_id, slot_tokens) if slot_tokens else ()

    # ------------------------------------------------------------------------ introspection

    def kv_report(self) -> dict[str, int]:
        return {
            **self._tree.cell_counts(),
            "spares_used": len(self._spare_ids) - len(self._free_spares),
            "cells_probation": self._tree.probation_cells(),  # cached cells not reused yet
            "cells_probation_cap": self.probation_cap,  # what probation may hold, as adapted
            # tokens without use after which a cached cell is spilled (-1: never)
            "spill_after_tokens": -1 if self.spill_after is None else round(self.spill_after),
        }

    def entries(self) -> tuple[CacheEntry, ...]:
        spares = [
            (end.last_used, seq_id, end)
            for seq_id, end in self._tree.ends.items()
            if not self._tree.is_slot(seq_id)
        ]
        return tuple(
            CacheEntry(EntryId(seq_id), self._tree.tokens(end), end.end * self.kv_bytes_per_cell)
            for _, seq_id, end in sorted(spares, key=lambda item: (item[0], item[1]))
        )

    def size_bytes(self) -> int:
        return self._tree.cached * self.kv_bytes_per_cell

    def longest_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens some sequence holds (the lookup a task launch makes)."""
        return self._tree.match(tokens)[1]

    def check_invariants(self) -> None:
        """For tests: the tree's own invariants (`PrefixTree.check`), and the ids of spares are
        either free or in use."""
        self._tree.check()
        used = {seq_id for seq_id in self._tree.ends if not self._tree.is_slot(seq_id)}
        assert used.isdisjoint(self._free_spares)
        assert used | set(self._free_spares) == set(self._spare_ids)

    # ------------------------------------- the copying RAM tier's steps: nothing to do here

    def save(self, slot_tokens: Sequence[int], state_size_bytes: int) -> SaveDecision:
        return SaveDecision("cache_disabled")

    def allocation_failed(self, entry_id: EntryId) -> tuple[EntryId, ...]:
        return ()

    def load(self, slot_tokens: Sequence[int], task_tokens: Sequence[int]) -> LoadDecision:
        return LoadDecision()

    def load_finished(self, entry_id: EntryId, restored: bool) -> None:
        return None

    def update(self) -> tuple[EntryId, ...]:
        return ()

    def idle_slots_to_cache(self, slots: Sequence[SlotView]) -> IdleSlotPlan:
        return IdleSlotPlan()
