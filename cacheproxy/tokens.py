"""Token-sequence arithmetic shared by the slot table, the router and the benchmarks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

_BLOCK = 64


def common_prefix_length(left: Sequence[int], right: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Every step is one C-level comparison of two slices, and there are few steps: slices twice
    as long each time while they are equal, then the slice holding the first difference is
    halved down to that token. A prefix of any length costs a few dozen steps at most, and a
    short prompt that continues what a slot holds (the common case) one.
    """
    limit = min(len(left), len(right))
    if type(left) is not type(right):  # a list slice never equals a tuple slice
        # only what can be shared is copied: a long cached entry against a short prompt
        left, right = list(itertools.islice(left, limit)), list(itertools.islice(right, limit))
    start, size = 0, _BLOCK
    while True:
        end = min(start + size, limit)
        if left[start:end] != right[start:end]:
            break
        if end == limit:
            return limit
        start, size = end, size * 2
    # everything before `start` is shared, and the first difference is before `end`
    while end - start > 1:
        middle = (start + end) // 2
        if left[start:middle] == right[start:middle]:
            start = middle
        else:
            end = middle
    return start


def is_prefix(head: tuple[int, ...], tokens: tuple[int, ...]) -> bool:
    """Whether `tokens` starts with all of `head` (or equals it). The token at the head's end
    is looked at first: most sequences that are not such a prefix are passed over at once."""
    count = len(head)
    return count <= len(tokens) and (
        count == 0 or (tokens[count - 1] == head[-1] and tokens[:count] == head)
    )


def reuse_with_shifts(held: Sequence[int], prompt: Sequence[int], common: int) -> int:
    """The most llama-server reuses of `prompt` on a slot holding `held`, past their `common`
    prefix, when it also shifts chunks of the slot's text into place (`--cache-reuse` or a
    body's `n_cache_reuse`): its walk with the smallest chunk, one token
    (tools/server/server-context.cpp, "reuse chunks from the cached prompt")."""
    reused, cached, wanted = common, common, common
    while cached < len(held) and wanted < len(prompt):
        run = 0
        while (
            cached + run < len(held)
            and wanted + run < len(prompt)
            and held[cached + run] == prompt[wanted + run]
        ):
            run += 1
        if run:
            reused, cached, wanted = reused + run, cached + run, wanted + run
        else:
            cached += 1
    return reused
