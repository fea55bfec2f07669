"""The LRU prompt cache of `prompt_cache_lru_trie` over a radix tree (compressed trie).

Each edge carries a run of tokens, so a chain of nodes with one child each is a single node: with
no cached sequence a prefix of another (the policy guarantees it), every entry is a leaf and every
inner node but the root branches, hence fewer than 2 nodes per entry whatever the prompt lengths.
A lookup walks the prompt once, one dict access per node and one comparison per token, and each
node knows the most recently used entry below it: the cost is O(prompt length), not growing with
the number of entries. Eviction removes least recently used entries, all of which are leaves,
until the cache is under its byte budget. Slot choice: the longest-prefix rule documented in
`prompt_cache_lru_trie`.
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheproxy_plugins.prompt_cache_lru_trie import (
    LruPrefixCache,
    LruPrefixCacheOptions,
    PrefixMatch,
    Stamped,
    newest_below,
)

from cacheproxy.prompt_cache import PromptCacheDeps


class _RadixNode:
    __slots__ = ("children", "edge", "entry", "newest")

    def __init__(self, edge: tuple[int, ...]) -> None:
        self.edge = edge  # the tokens on the edge from the parent; empty only for the root
        self.children: dict[int, _RadixNode] = {}  # keyed by the first token of the child's edge
        self.entry: Stamped | None = None  # the entry whose tokens end at the end of this edge
        self.newest: Stamped | None = None  # the most recently used entry in this subtree

    def recompute_newest(self) -> None:
        self.newest = newest_below(self.entry, self.children.values())


def _edge_common_length(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal `tokens[start:]`, without copying a slice."""
    shortest = min(len(edge), len(tokens) - start)
    for offset in range(shortest):
        if edge[offset] != tokens[start + offset]:
            return offset
    return shortest


class RadixTree:
    """Token sequences in a compressed trie, each node knowing its newest entry below it."""

    def __init__(self) -> None:
        self._root = _RadixNode(())
        self._node_count = 1

    def node_count(self) -> int:
        return self._node_count

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        node = self._root
        depth = 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            matched = _edge_common_length(child.edge, tokens, depth)
            depth += matched
            # Even when the match stops inside the edge, the entries sharing exactly `depth`
            # tokens are those below this child.
            node = child
            if matched < len(child.edge):
                break
        return PrefixMatch(depth, node.newest[1] if node.newest else None)

    def insert(self, tokens: Sequence[int], entry: Stamped) -> None:
        node = self._root
        path = [node]
        depth = 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _RadixNode(tuple(tokens[depth:]))
                node.children[tokens[depth]] = leaf
                self._node_count += 1
                node = leaf
                path.append(node)
                depth = len(tokens)
                break
            matched = _edge_common_length(child.edge, tokens, depth)
            if matched < len(child.edge):
                # Split the edge where the new sequence leaves it.
                middle = _RadixNode(child.edge[:matched])
                child.edge = child.edge[matched:]
                middle.children[child.edge[0]] = child  # its newest is set below, with the path
                node.children[middle.edge[0]] = middle
                self._node_count += 1
                child = middle
            depth += matched
            node = child
            path.append(node)
        node.entry = entry
        for on_path in path:
            on_path.newest = entry  # just used, so the newest of every subtree it is in

    def touch(self, tokens: Sequence[int], entry: Stamped) -> None:
        path = self._path(tokens)
        path[-1].entry = entry
        for on_path in path:
            on_path.newest = entry

    def remove(self, tokens: Sequence[int]) -> None:
        path = self._path(tokens)
        path[-1].entry = None
        for position in range(len(path) - 1, 0, -1):
            node, parent = path[position], path[position - 1]
            if node.entry is None and not node.children:
                del parent.children[node.edge[0]]
                self._node_count -= 1
            elif node.entry is None and len(node.children) == 1:
                # A non-branching inner node: fold its only child into it to stay compressed.
                (only_child,) = node.children.values()
                node.edge += only_child.edge
                node.children = only_child.children
                node.entry = only_child.entry
                node.newest = only_child.newest
                self._node_count -= 1
            else:
                node.recompute_newest()
        self._root.recompute_newest()

    def _path(self, tokens: Sequence[int]) -> list[_RadixNode]:
        """The nodes down to the one where the stored `tokens` end."""
        node = self._root
        path = [node]
        depth = 0
        while depth < len(tokens):
            node = node.children[tokens[depth]]
            depth += len(node.edge)
            path.append(node)
        if depth != len(tokens):
            raise KeyError("sequence not stored in the radix tree")
        return path

    def check_invariants(self) -> None:
        """For tests: compressed (no inner node without an entry has a single child) and every
        node's newest entry is the maximum of its subtree."""
        stack = [self._root]
        count = 0
        while stack:
            node = stack.pop()
            count += 1
            if node is not self._root:
                assert node.edge, "only the root has an empty edge"
                assert node.entry is not None or len(node.children) >= 2, "uncompressed node"
            for first_token, child in node.children.items():
                assert child.edge[0] == first_token
            expected = [child.newest for child in node.children.values() if child.newest]
            if node.entry is not None:
                expected.append(node.entry)
            assert node.newest == (max(expected) if expected else None), "stale newest entry"
            stack.extend(node.children.values())
        assert count == self._node_count


class RadixPromptCache(LruPrefixCache):
    """Entries kept on use, least recently used leaves evicted, longest prefix via a radix tree."""

    Options = LruPrefixCacheOptions

    def __init__(self, options: LruPrefixCacheOptions, deps: PromptCacheDeps | None = None) -> None:
        super().__init__(options, RadixTree())
