"""The budget of an upstream's RAM prompt cache, learnt from what the server demonstrably keeps.

llama-server does not report its `--cache-ram` (not in `/props`, not in `/metrics`), so the
shadow starts from `routing.server_ram_cache_mib` and corrects that figure from the answers.
The cache's rules in the pinned tree make each answer a bound on the budget:

- entries leave first in, first out, and the limit is strict: room is made before a new entry is
  allocated (server-task.cpp:1762-1768) and `update` evicts while the total is over the limit
  (1882-1888);
- an entry over the limit is never kept (1741-1746);
- an entry is moved out of the cache when it is loaded into a slot (1873-1875), and only one
  that keeps a quarter of itself is ever loaded (1823-1826).

So when a load the shadow replayed does not happen (the server's `cache_n` shows less), the
entry had been evicted: the budget is below that entry plus everything cached after it. And
when the server loads an entry the shadow had evicted for the budget (a *ghost*), the budget
holds that entry and everything cached after it. The shadow is then rebuilt at the new budget:
entries re-saved oldest first, so the same first-in-first-out order decides what stays.

Until an answer bounds it from below, the budget is a guess, and a guess too high costs a full
prefill each time the proxy counts on it (a save skipped, an archive left unrestored, for a load
that does not happen). So the learner also keeps the *proven* budget: the most the server has
been seen to keep (a load it made, with everything cached after the entry). A load is counted
on only as far as that reaches (`proves`); beyond it the shadow still predicts, but as a chance.

Pure: no I/O, no clock. Sizes are the shadow's own (tokens times its bytes per token), so a
budget learnt in them stays right whatever the server's own state sizes are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cacheproxy.prompt_cache import CacheEntry, EntryId
from cacheproxy.tokens import common_prefix_length

GHOSTS_KEPT = 256  # entries evicted for the budget remembered, newest kept
MIN_ENTRY_KEEP_FRACTION = 0.25  # server-task.cpp:1824: an entry keeping less is never loaded


@dataclass(frozen=True)
class LoadSeen:
    """An entry the shadow replayed loading into a slot, and the budget that load implies."""

    n_common: int  # what the task reuses of it: the `cache_n` it brings
    entry_bytes: int  # its size
    newer_bytes: int  # every entry cached after it: with it, what the server must have kept

    @property
    def bound_bytes(self) -> int:
        return self.entry_bytes + self.newer_bytes


class BudgetLearner:
    """Keeps the entries evicted for the budget and turns surprises into a new budget.

    `resized(limit_bytes)` builds an empty policy of the same kind at another byte limit (the
    caller's factory: the plugin and its dependencies are the caller's)."""

    def __init__(self, resized: Callable[[int], Any]) -> None:
        self.resized = resized
        self.ghosts: deque[CacheEntry] = deque(maxlen=GHOSTS_KEPT)  # oldest first
        self.changes = 0  # how many times the budget was learnt anew
        # the most the server has been seen to keep: what a load it made had cached after it
        self.proven_bytes = 0

    def evicted(self, entries: Iterable[CacheEntry]) -> None:
        """Entries the shadow's cache dropped to stay within the budget (oldest first)."""
        self.ghosts.extend(entries)

    def forget(self) -> None:
        """The server's cache is empty (a restart): what it may have kept is gone too, and a
        new process has shown nothing yet (it may run with other flags)."""
        self.ghosts.clear()
        self.proven_bytes = 0

    def proves(self, bound_bytes: int) -> bool:
        """Whether the server has shown it keeps `bound_bytes` (an entry and all cached after
        it): a load within that is a fact, beyond it a guess."""
        return bound_bytes <= self.proven_bytes

    def confirmed(self, seen: LoadSeen) -> None:
        """The load `seen` happened: the server kept the entry and all cached after it."""
        self.proven_bytes = max(self.proven_bytes, seen.bound_bytes)

    @staticmethod
    def load_seen(entries: Sequence[CacheEntry], entry_id: EntryId, n_common: int) -> LoadSeen:
        """The load of `entry_id` from a cache holding `entries` (oldest first)."""
        at = next(index for index, entry in enumerate(entries) if entry.entry_id == entry_id)
        newer = sum(entry.size_bytes for entry in entries[at + 1 :])
        return LoadSeen(n_common, entries[at].size_bytes, newer)

    def shrunk(self, cache: Any, seen: LoadSeen) -> Any | None:
        """The load `seen` did not happen: the server's budget is below its bound (the entry
        and all cached after it). The cache rebuilt at half of what was cached after it (at
        least the entry's size less a byte: a server that kept none of them) and at most half
        the budget it had, or None when it is that low already. A budget found too high costs
        a prefill each time it is, one too low only a disk save (and the server's next load of
        an entry the shadow dropped raises it)."""
        limit = cache.limit_bytes
        budget = min(seen.bound_bytes - 1, max(seen.newer_bytes // 2, seen.entry_bytes - 1))
        if limit > 0:
            budget = min(budget, limit // 2)
        budget = max(budget, 1)
        # an entry sized a little off may have shown more than the server keeps
        self.proven_bytes = min(self.proven_bytes, budget)
        if 0 < limit <= budget:
            return None
        return self._rebuilt(cache, budget, ())

    def grown(self, cache: Any, prompt: Sequence[int], cache_n: int) -> Any | None:
        """The server reused `cache_n` tokens of `prompt` that no live entry holds: if a ghost
        holds them, the server kept it, and every entry cached after it, within its budget.
        The cache rebuilt at that budget with those entries back (the ghost itself left the
        server's cache when it was loaded), or None when no ghost explains it."""
        ghosts = list(self.ghosts)
        found = next(
            (
                index
                for index in range(len(ghosts) - 1, -1, -1)
                if _would_load(ghosts[index], prompt, cache_n)
            ),
            None,
        )
        if found is None:
            return None
        newer = ghosts[found + 1 :]
        needed = ghosts[found].size_bytes + sum(g.size_bytes for g in newer) + cache.size_bytes()
        limit = cache.limit_bytes
        # the newer ones come back as entries, the loaded one is gone
        self.ghosts = deque(ghosts[:found], maxlen=GHOSTS_KEPT)
        self.proven_bytes = max(self.proven_bytes, needed)
        return self._rebuilt(cache, max(limit, needed), newer)

    def _rebuilt(self, cache: Any, limit_bytes: int, older: Sequence[CacheEntry]) -> Any:
        """A cache at `limit_bytes` holding `older` then `cache`'s entries, re-saved oldest
        first: what does not fit leaves first in, first out, and is remembered as a ghost."""
        fresh = self.resized(limit_bytes)
        kept = [*older, *cache.entries()]
        for entry in kept:
            fresh.save(entry.tokens, entry.size_bytes)
        fresh.update()
        held = {entry.tokens for entry in fresh.entries()}
        self.evicted(entry for entry in kept if entry.tokens not in held)
        self.changes += 1
        return fresh


def _would_load(entry: CacheEntry, prompt: Sequence[int], cache_n: int) -> bool:
    """Whether loading `entry` gives `prompt` a reuse of `cache_n` (a fully cached prompt
    reports one token less), and the server would load it at all."""
    shared = common_prefix_length(entry.tokens, prompt)
    reused = min(shared, max(len(prompt) - 1, 0))
    return reused == cache_n and shared >= MIN_ENTRY_KEEP_FRACTION * len(entry.tokens)


def entry_ids_by_tokens(entries: Iterable[CacheEntry]) -> dict[tuple[int, ...], EntryId]:
    return {entry.tokens: entry.entry_id for entry in entries}
