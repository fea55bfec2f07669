"""The common prefix of two token sequences, whatever their types and lengths."""

from __future__ import annotations

import random
from array import array

import pytest

from cacheproxy.tokens import common_prefix_length, is_prefix, reuse_with_shifts


def reference(left: list[int], right: list[int]) -> int:
    shared = 0
    for one, other in zip(left, right, strict=False):  # up to the shorter
        if one != other:
            break
        shared += 1
    return shared


@pytest.mark.parametrize("seed", range(20))
def test_the_common_prefix_of_lists_tuples_and_arrays(seed: int) -> None:
    rng = random.Random(seed)
    head = [rng.randrange(50_000) for _ in range(rng.randrange(0, 3000))]
    left = head + [rng.randrange(50_000) for _ in range(rng.randrange(0, 2000))]
    right = head + [rng.randrange(50_000) for _ in range(rng.randrange(0, 200))]
    expected = reference(left, right)
    for make_left in (list, tuple, lambda tokens: array("i", tokens)):
        for make_right in (list, tuple):
            assert common_prefix_length(make_left(left), make_right(right)) == expected
            assert common_prefix_length(make_right(right), make_left(left)) == expected


@pytest.mark.parametrize("seed", range(20))
def test_a_prefix_is_found_whatever_its_end_and_middle(seed: int) -> None:
    rng = random.Random(seed)
    tokens = tuple(rng.randrange(50) for _ in range(rng.randrange(1, 400)))
    cut = rng.randrange(len(tokens) + 1)
    assert is_prefix(tokens[:cut], tokens) and is_prefix((), tokens) and is_prefix(tokens, tokens)
    assert not is_prefix((*tokens, 7), tokens)
    if cut >= 2:  # the same end after another middle
        other = (*tokens[: cut - 2], tokens[cut - 2] + 1, tokens[cut - 1])
        assert not is_prefix(other, tokens)


def test_shifting_reuses_the_runs_a_prompt_keeps_of_the_text_past_the_prefix() -> None:
    prefix, dropped, kept = list(range(10)), [100, 101, 102], list(range(50, 60))
    # a middle part dropped: the text after it is shifted into place
    assert reuse_with_shifts(prefix + dropped + kept, prefix + kept, 10) == 20
    # a token the slot never held stops the walk: the server reuses none of the rest
    assert reuse_with_shifts(prefix + dropped + kept, [*prefix, 7, *kept], 10) == 10
    # two runs, each found further on in the slot's text
    assert reuse_with_shifts([*prefix, 1, 2, 3, 9, 9, 4, 5], [*prefix, 2, 3, 4, 5], 10) == 14
    # nothing past the prefix, or nothing held
    assert reuse_with_shifts(prefix, [*prefix, 1], 10) == 10
    assert reuse_with_shifts([], [1, 2], 0) == 0
