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
