"""The slot table's arithmetic: reuse bounds, what a finished request leaves, GET /slots repairs."""

from __future__ import annotations

import random

import pytest

from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import (
    CONTINUATION_SLACK_TOKENS,
    ReuseBounds,
    SlotState,
    TaskOutcome,
    UpstreamSlots,
    branch_point,
)


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 200, 1000])
def test_common_prefix_length_matches_a_plain_walk(length: int) -> None:
    rng = random.Random(length)
    base = [rng.randrange(100) for _ in range(length)]
    for cut in {0, length // 3, length // 2, length - 1, length}:
        if cut < 0:
            continue
        other = [*base[:cut], 1000, *base[cut + 1 :]]
        pairs = enumerate(zip(base, other, strict=False))
        expected = next((i for i, (a, b) in pairs if a != b), len(base))
        assert common_prefix_length(base, other) == expected
        assert common_prefix_length(tuple(base), other) == expected
    assert common_prefix_length(base, [*base, 1, 2]) == length


def test_known_slot_predicts_exactly_and_caps_at_n_minus_one() -> None:
    slot = SlotState(0, 4096, known=[1, 2, 3, 4, 5])
    assert slot.reuse_bounds([1, 2, 3, 9]) == ReuseBounds(3, 3)
    assert slot.reuse_bounds([1, 2, 3, 4, 5, 6, 7]) == ReuseBounds(5, 5)
    # the whole prompt cached: the server still decodes its last token
    assert slot.reuse_bounds([1, 2, 3, 4, 5]) == ReuseBounds(4, 4)
    assert slot.reuse_bounds([1, 2, 3]) == ReuseBounds(2, 2)
    assert slot.reuse_bounds([7, 8]) == ReuseBounds(0, 0)


def test_unknown_tail_gives_a_range_only_past_the_known_part() -> None:
    slot = SlotState(0, 4096, known=[1, 2, 3], unknown_tail=4)
    assert slot.reuse_bounds([1, 2, 3, 10, 11, 12, 13, 14, 15]) == ReuseBounds(3, 7)
    assert slot.reuse_bounds([1, 2, 9, 10]) == ReuseBounds(2, 2)  # differs inside the known part
    assert slot.reuse_bounds([1, 2, 3, 10]) == ReuseBounds(3, 3)  # capped at n - 1
    unknown_count = SlotState(0, 4096, known=[1, 2], unknown_tail=None)
    assert unknown_count.reuse_bounds([1, 2, 5, 6, 7]) == ReuseBounds(2, 4)


def test_record_keeps_prompt_plus_generated_up_to_tokens_cached() -> None:
    slot = SlotState(0, 4096)
    slot.record([1, 2, 3], TaskOutcome(ok=True, tokens_cached=5, generated=[7, 8, 9]))
    assert (slot.known, slot.unknown_tail) == ([1, 2, 3, 7, 8], 0)
    # ids not given (an OAI stream): the prompt is known, the rest counted
    slot.record([1, 2, 3], TaskOutcome(ok=True, tokens_cached=6))
    assert (slot.known, slot.unknown_tail) == ([1, 2, 3], 3)
    # a failed request leaves the slot unknowable until GET /slots says more
    slot.record([1, 2, 3], TaskOutcome(ok=False))
    assert (slot.known, slot.unknown_tail, slot.n_tokens) == ([], None, None)


def test_reconcile_corrects_idle_slots_but_not_newer_ones() -> None:
    report = [
        {"id": 0, "n_ctx": 4096, "is_processing": False},
        {"id": 1, "n_ctx": 4096, "is_processing": False, "n_prompt_tokens": 10},
    ]
    table = UpstreamSlots.from_slots_report(0, Upstream("http://u"), report)
    assert table.slots[0].empty
    assert (table.slots[1].known, table.slots[1].n_tokens) == ([], 10)

    table.slots[0].hold([1, 2, 3])
    versions = {slot.slot_id: slot.version for slot in table.slots}
    table.slots[1].hold([4, 5])  # changed by the proxy after the report was asked for
    later = [
        {"id": 0, "n_ctx": 4096, "n_prompt_tokens": 0},
        {"id": 1, "n_ctx": 4096, "n_prompt_tokens": 10},
    ]
    assert table.reconcile(later, versions) == [0]
    assert table.slots[0].empty
    assert table.slots[1].known == [4, 5]


def test_tokens_lost_counts_what_the_prompt_does_not_share() -> None:
    slot = SlotState(0, 4096, known=[1, 2, 3, 4], unknown_tail=2)
    assert slot.tokens_lost_to([1, 2, 9]) == 4
    assert slot.tokens_lost_to([1, 2, 3, 4, 5]) == 2


def test_a_request_branches_where_it_stops_reusing_more_than_a_few_tokens() -> None:
    assert branch_point(held=296, reused=256) == 256
    # a conversation's next turn may lose the last tokens of the answer it re-templates
    assert branch_point(held=296, reused=296 - CONTINUATION_SLACK_TOKENS) is None
    assert branch_point(held=296, reused=296 - CONTINUATION_SLACK_TOKENS - 1) == 279
    assert branch_point(held=296, reused=0) is None  # it starts afresh


def unified_table() -> UpstreamSlots:
    slots = [SlotState(slot_id, 8192) for slot_id in range(3)]
    table = UpstreamSlots(0, Upstream("http://127.0.0.1:1"), slots, ram_cache=True)
    table.clears_idle = True
    return table


def test_a_launch_on_a_server_that_clears_idle_slots_empties_them_in_the_table() -> None:
    table = unified_table()
    table.slots[0].hold([1, 2, 3])
    table.slots[0].tenant = "default"
    table.slots[1].hold([4, 5])
    table.slots[1].busy = True  # running: the server leaves it
    table.shadow_dispatch(2, [], [7, 8, 9], pinned=False)
    assert table.slots[0].empty and table.slots[0].tenant is None
    assert table.slots[1].known == [4, 5]


def test_a_task_the_server_put_on_another_slot_swaps_the_two_rows() -> None:
    """The lease was on the slot predicted (1); the answer names slot 2, whose row was leased
    to a task the server will have put elsewhere: the rows swap ids, each object kept."""
    table = unified_table()
    predicted, other = table.slots[1], table.slots[2]
    other.busy = True
    table.relabel(predicted, 2)
    assert (predicted.slot_id, other.slot_id) == (2, 1)
    assert table.slots[2] is predicted and table.slots[1] is other
    table.relabel(predicted, 2)  # already so: nothing changes
    assert table.slots[2] is predicted
