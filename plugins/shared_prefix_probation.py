"""How many cached cells the shared-prefix cache keeps on probation: a cap that adapts to demand,
as ARC's recency target does.

Every cell in use costs every decode: attention in a unified KV cache spans all used cells (see
prompt_cache_shared_prefix.py), so a cached entry that is never reused is not free even within
the byte budget. What a finished task leaves behind therefore starts on probation (no later task
has reused it), in a segment smaller than the budget, and is evicted first; a reuse protects it.
The segment's size follows demand: a prompt that wanted an entry probation evicted grows it by
twice that entry's cells (up to the whole budget); an evicted entry forgotten without being
asked for (it falls off the list of the last `ghosts` evicted) shrinks it by its cells. An
evicted entry is recognised by its position and its first tokens.

Cost: one pass over the remembered entries (a handful) per prompt that attaches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

GROWTH = 2
GHOST_KEY_TOKENS = 16  # an evicted entry is recognised by its position and its first tokens


class ProbationCap:
    def __init__(self, budget_cells: int, share: float, ghosts: int) -> None:
        self.budget_cells = budget_cells
        self.cells = int(budget_cells * share)  # cached cells never reused yet may take these
        self._ghosts_kept = ghosts
        # probation entries evicted lately: (start, first tokens) -> their cells
        self._ghosts: OrderedDict[tuple[int, tuple[int, ...]], int] = OrderedDict()

    def evicted(self, start: int, tokens: tuple[int, ...]) -> None:
        """An entry on probation, `tokens` from position `start`, was evicted."""
        key = (start, tokens[:GHOST_KEY_TOKENS])
        self._ghosts.pop(key, None)
        self._ghosts[key] = len(tokens)
        while len(self._ghosts) > self._ghosts_kept:
            _, cells = self._ghosts.popitem(last=False)
            self.cells = max(0, self.cells - cells)

    def asked(self, task_tokens: Sequence[int], matched: int) -> None:
        """A prompt found its first `matched` tokens cached: what else of it probation evicted
        it would have reused."""
        for key in list(self._ghosts):
            start, head = key
            missed = matched < start + len(head)  # the tree no longer holds it (nor a copy)
            if missed and tuple(task_tokens[start : start + len(head)]) == head:
                cells = self._ghosts.pop(key)
                self.cells = min(self.budget_cells, self.cells + GROWTH * cells)
