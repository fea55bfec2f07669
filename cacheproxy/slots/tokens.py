"""Token-sequence arithmetic shared by the slot table, the router and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

_BLOCK = 64


def common_prefix_length(left: Sequence[int], right: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Compares 64-token slices first (a C-level comparison), and only walks token by token inside
    the first block that differs, so long shared prefixes cost little Python time.
    """
    if type(left) is not type(right):  # a list slice never equals a tuple slice
        left, right = list(left), list(right)
    limit = min(len(left), len(right))
    start = 0
    while start + _BLOCK <= limit and left[start : start + _BLOCK] == right[start : start + _BLOCK]:
        start += _BLOCK
    while start < limit and left[start] == right[start]:
        start += 1
    return start
