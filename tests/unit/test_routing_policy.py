"""The exact-prefix routing plugin: pure decisions from slot and upstream figures."""

from __future__ import annotations

import pytest

from cacheproxy.plugins import PluginError, load_plugin
from cacheproxy.slots.routing import (
    QueueUntilFree,
    Restorable,
    RouteRequest,
    SlotCandidate,
    UpstreamView,
    UseSlot,
    WaitForSlot,
)


def slot(
    slot_id: int,
    *,
    upstream: int = 0,
    busy: bool = False,
    reuse: int = 0,
    lost: int = 0,
    empty: bool = False,
    last_used: float = 1.0,
    busy_for_s: float = 0.0,
    session: str | None = None,
    remaining_s: float | None = None,
    prefill_left_s: float = 0.0,
) -> SlotCandidate:
    # the request's expected end and its prompt's, only when given (the scheduler's estimates)
    estimates = {"remaining_s": remaining_s} if remaining_s is not None else {}
    if prefill_left_s:
        estimates["prefill_left_s"] = prefill_left_s
    return SlotCandidate(
        upstream, slot_id, busy, empty, reuse, lost, last_used, busy_for_s, session, **estimates
    )


def upstream(
    index: int = 0,
    *,
    in_flight: int = 0,
    ms_per_token: float = 0.1,
    request_s: float = 1.0,
    ram_cache: bool = False,
    healthy: bool = True,
) -> UpstreamView:
    return UpstreamView(index, in_flight, ms_per_token, request_s, ram_cache, healthy)


@pytest.fixture
def policy():  # noqa: ANN201 - the plugin, loaded by name as the app does
    return load_plugin("routing", "exact-prefix", {"loss_weight": 0.25, "max_wait_s": 5.0})


def test_unknown_plugin_names_the_known_ones() -> None:
    with pytest.raises(PluginError, match="exact-prefix"):
        load_plugin("routing", "no-such-policy")
    with pytest.raises(PluginError, match="loss_weight"):
        load_plugin("routing", "exact-prefix", {"loss_weight": -1})


def test_idle_slot_with_most_reuse_wins(policy) -> None:  # noqa: ANN001
    slots = [slot(0, reuse=10), slot(1, reuse=900), slot(2, reuse=300)]
    assert policy.plan(RouteRequest(1000), slots, [upstream()]) == UseSlot(0, 1)


def test_a_busy_slot_is_never_used(policy) -> None:  # noqa: ANN001
    slots = [slot(0, busy=True, reuse=900), slot(1, reuse=0)]
    plan = policy.plan(RouteRequest(1000, may_wait=False), slots, [upstream()])
    assert plan == UseSlot(0, 1)


def test_waits_for_a_busy_slot_only_when_the_wait_is_cheaper(policy) -> None:  # noqa: ANN001
    slots = [slot(0, busy=True, reuse=9000, busy_for_s=0.9), slot(1, reuse=0)]
    # 9000 tokens at 0.1 ms save 900 ms; the busy request should end in about 100 ms
    assert policy.plan(RouteRequest(10000), slots, [upstream()]) == WaitForSlot(0, 0, 5.0)
    # the same wait is not worth 90 ms of prefill
    cheap = [slot(0, busy=True, reuse=900, busy_for_s=0.9), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), cheap, [upstream()]) == UseSlot(0, 1)
    # once the bounded wait ran out, the idle slot is taken
    assert policy.plan(RouteRequest(10000, may_wait=False), slots, [upstream()]) == UseSlot(0, 1)


def test_a_wait_lasts_the_requests_queued_ahead_for_the_same_slot(policy) -> None:  # noqa: ANN001
    # 9,000 tokens at 0.1 ms spare 900 ms; the busy request ends in about 100 ms
    slots = [slot(0, busy=True, reuse=9000, busy_for_s=0.9), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(10000), slots, [upstream()]) == WaitForSlot(0, 0, 5.0)
    slots[0].queued_ahead_s = 1.0  # a request queued ahead takes it first, for 1 s
    assert policy.plan(RouteRequest(10000), slots, [upstream()]) == UseSlot(0, 1)
    slots.append(slot(2, busy=True, reuse=8000, busy_for_s=0.9))
    assert policy.plan(RouteRequest(10000), slots, [upstream()]) == WaitForSlot(0, 2, 5.0)
    # worth it even behind one, when the request ahead is short
    slots[0].queued_ahead_s = 0.2
    assert policy.plan(RouteRequest(10000), slots[:2], [upstream()]) == WaitForSlot(0, 0, 5.0)


def test_nothing_idle_and_nothing_to_reuse_queues(policy) -> None:  # noqa: ANN001
    slots = [slot(0, busy=True), slot(1, busy=True)]
    assert policy.plan(RouteRequest(100), slots, [upstream()]) == QueueUntilFree()
    # with reuse on a busy slot, wait for that one rather than any
    slots = [slot(0, busy=True), slot(1, busy=True, reuse=50)]
    assert policy.plan(RouteRequest(100), slots, [upstream()]) == WaitForSlot(0, 1, 5.0)


def test_among_equals_the_slot_losing_least_then_the_oldest(policy) -> None:  # noqa: ANN001
    slots = [
        slot(0, lost=500, last_used=1.0),
        slot(1, lost=10, last_used=9.0),
        slot(2, lost=10, last_used=3.0),
    ]
    assert policy.plan(RouteRequest(100), slots, [upstream()]) == UseSlot(0, 2)


def test_session_wins_a_tie(policy) -> None:  # noqa: ANN001
    slots = [slot(0, last_used=1.0), slot(1, last_used=5.0, session="s1")]
    assert policy.plan(RouteRequest(100, session="s1"), slots, [upstream()]) == UseSlot(0, 1)
    assert policy.plan(RouteRequest(100, session="s2"), slots, [upstream()]) == UseSlot(0, 0)


def test_with_a_server_ram_cache_empty_slots_are_kept_back(policy) -> None:  # noqa: ANN001
    slots = [slot(0, empty=True, last_used=0.0), slot(1, lost=800, last_used=5.0)]
    # llama-server consults its RAM cache only for a pinned slot that holds something
    assert policy.plan(RouteRequest(100), slots, [upstream(ram_cache=True)]) == UseSlot(0, 1)
    assert policy.plan(RouteRequest(100), slots, [upstream(ram_cache=False)]) == UseSlot(0, 0)
    only_empty = [slot(0, empty=True), slot(1, busy=True)]
    assert policy.plan(
        RouteRequest(100, may_wait=False), only_empty, [upstream(ram_cache=True)]
    ) == UseSlot(0, 0)


def test_a_busy_upstream_does_not_win_on_a_small_prefix(policy) -> None:  # noqa: ANN001
    slots = [slot(0, upstream=0, reuse=100), slot(0, upstream=1, reuse=0)]
    ups = [upstream(0, in_flight=3), upstream(1, in_flight=0)]
    assert policy.plan(RouteRequest(1000), slots, ups) == UseSlot(1, 0)
    # a large prefix is still worth the busier server
    slots = [slot(0, upstream=0, reuse=900), slot(0, upstream=1, reuse=0)]
    assert policy.plan(RouteRequest(1000), slots, ups) == UseSlot(0, 0)


def test_unhealthy_upstreams_are_skipped(policy) -> None:  # noqa: ANN001
    slots = [slot(0, upstream=0, reuse=900), slot(0, upstream=1)]
    ups = [upstream(0, healthy=False), upstream(1)]
    assert policy.plan(RouteRequest(1000), slots, ups) == UseSlot(1, 0)


def test_no_waiting_on_a_busier_upstream_while_another_has_room(policy) -> None:  # noqa: ANN001
    slots = [
        slot(0, upstream=0, busy=True, reuse=9000, busy_for_s=0.9),
        slot(0, upstream=1, reuse=0),
    ]
    ups = [upstream(0, in_flight=2), upstream(1, in_flight=1)]
    assert policy.plan(RouteRequest(10000), slots, ups) == UseSlot(1, 0)
    # equally busy: the wait for the prefix is worth it again
    even = [upstream(0, in_flight=2), upstream(1, in_flight=2)]
    assert policy.plan(RouteRequest(10000), slots, even) == WaitForSlot(0, 0, 5.0)


def test_a_wait_is_priced_by_the_busy_requests_expected_end(policy) -> None:  # noqa: ANN001
    # 1 ms a token, one request running: the 900 shared tokens cost 1.8 s to compute again.
    # The mean request (5 s, just begun) would say the wait costs more; the scheduler's
    # estimate for this request (its prompt computed, 0.3 s to go) says it costs less.
    ups = [upstream(in_flight=1, ms_per_token=1.0, request_s=5.0)]
    ending = [slot(0, busy=True, reuse=900, remaining_s=0.3), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), ending, ups) == WaitForSlot(0, 0, 5.0)
    unknown = [slot(0, busy=True, reuse=900), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), unknown, ups) == UseSlot(0, 1)
    late = [slot(0, busy=True, reuse=900, remaining_s=4.0), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), late, ups) == UseSlot(0, 1)


def test_the_rest_after_a_wait_is_computed_beside_one_request_fewer(policy) -> None:  # noqa: ANN001
    # Only the waited-for request runs: once it ends, the 400 tokens left are computed alone
    # (400 ms), not beside it. On the idle slot the 1,000 tokens are computed beside it only
    # until it ends, 1.1 s (550 of them), then alone (450 ms): wait 1.5 s < 1.55 s.
    ups = [upstream(in_flight=1, ms_per_token=1.0)]
    slots = [slot(0, busy=True, reuse=600, remaining_s=1.1), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), slots, ups) == WaitForSlot(0, 0, 5.0)
    # 500 shared tokens: 1.6 s of waiting and computing against 1.55 s on the idle slot
    slots = [slot(0, busy=True, reuse=500, remaining_s=1.1), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), slots, ups) == UseSlot(0, 1)


def test_a_busy_slot_reusing_no_more_than_an_idle_one_is_waited_for_only_to_keep_its_text(
    policy,  # noqa: ANN001
) -> None:
    # Every slot holds the 300 shared tokens; 200 of the request's own are left either way.
    # Beside three requests that looks dear on the idle slot (200 x 4 x 0.5 ms = 400 ms),
    # but the awaited request ends in 50 ms all the same: the idle slot is taken.
    ups = [upstream(in_flight=3, ms_per_token=0.5)]
    slots = [
        slot(0, busy=True, reuse=300, remaining_s=0.05),
        slot(1, busy=True, reuse=300, remaining_s=0.05),
        slot(2, busy=True, reuse=300, remaining_s=0.05),
        slot(3, reuse=300, lost=200),
    ]
    assert policy.plan(RouteRequest(500), slots, ups) == UseSlot(0, 3)
    # unless the idle slot holds much that waiting keeps (0.25 x 2,000 tokens x 0.5 ms)
    slots[3] = slot(3, reuse=300, lost=2000)
    assert policy.plan(RouteRequest(500), slots, ups) == WaitForSlot(0, 0, 5.0)


def test_a_shared_prompt_being_computed_is_waited_for_not_computed_again(policy) -> None:  # noqa: ANN001
    # Slot 0 is computing a prompt sharing 900 tokens with this one, 0.2 s from done; its
    # request then holds the slot 3 s more (worth less than the 1.8 s of computing them
    # again): wait for that prompt, not for the request, and plan again when it is computed.
    ups = [upstream(in_flight=1, ms_per_token=1.0)]
    computing = [
        slot(0, busy=True, reuse=900, remaining_s=3.2, prefill_left_s=0.2),
        slot(1, reuse=0),
    ]
    assert policy.plan(RouteRequest(1000), computing, ups) == WaitForSlot(0, 0, 5.0)
    # computed: the request's 3 s left are not worth it
    computed = [slot(0, busy=True, reuse=900, remaining_s=3.0), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), computed, ups) == UseSlot(0, 1)
    # a prompt 2 s from done is not worth waiting for either
    far = [slot(0, busy=True, reuse=900, remaining_s=5.0, prefill_left_s=2.0), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), far, ups) == UseSlot(0, 1)
    # nor a few shared tokens (a wait is never priced below MIN_REMAINING_S), nor once the
    # bounded wait ran out
    few = [slot(0, busy=True, reuse=20, remaining_s=3.0, prefill_left_s=0.01), slot(1, reuse=0)]
    assert policy.plan(RouteRequest(1000), few, ups) == UseSlot(0, 1)
    assert policy.plan(RouteRequest(1000, may_wait=False), computing, ups) == UseSlot(0, 1)


def test_a_prompt_computed_on_another_upstream_is_not_waited_for(policy) -> None:  # noqa: ANN001
    # a copy computed on another server does not share that server's compute
    slots = [
        slot(0, upstream=0, busy=True, reuse=900, remaining_s=3.2, prefill_left_s=0.2),
        slot(0, upstream=1, reuse=0),
    ]
    ups = [upstream(0, in_flight=1, ms_per_token=1.0), upstream(1, in_flight=1, ms_per_token=1.0)]
    assert policy.plan(RouteRequest(1000), slots, ups) == UseSlot(1, 0)


def test_the_requesters_archive_restored_into_an_idle_slot_beats_a_wait(policy) -> None:  # noqa: ANN001
    # The conversations' case: three busy slots hold the shared system prompt (400 of 441
    # tokens), the idle one nothing. Computing 441 tokens beside three requests (132 ms) loses
    # to a 40 ms wait and 41 tokens; with the requester's archive of 430 tokens restorable at
    # 10 ms, the idle slot costs 10 ms and 11 tokens: no wait.
    ups = [upstream(in_flight=3, ms_per_token=0.075)]
    slots = [slot(i, busy=True, reuse=400, remaining_s=0.04) for i in range(3)]
    slots.append(slot(3, empty=True))
    assert policy.plan(RouteRequest(441), slots, ups) == WaitForSlot(0, 0, 5.0)
    archived = {0: Restorable(430, 10.0)}
    plan = policy.plan(RouteRequest(441, restorable=archived), slots, ups)
    assert plan == UseSlot(0, 3)
    # a restore dearer than computing what it gives is not taken, and the wait stands
    dear = {0: Restorable(430, 500.0)}
    assert policy.plan(RouteRequest(441, restorable=dear), slots, ups) == WaitForSlot(0, 0, 5.0)
    # an archive on another upstream does not price this one's slots
    elsewhere = {1: Restorable(430, 10.0)}
    assert policy.plan(RouteRequest(441, restorable=elsewhere), slots, ups) == WaitForSlot(
        0, 0, 5.0
    )


def test_an_archive_holding_no_more_than_a_computing_prompt_does_not_end_its_wait(policy) -> None:  # noqa: ANN001
    # slot 0 computes a prompt sharing 900 tokens, 0.2 s from done: worth waiting for while
    # the archive gives less; an archive of 950 gives the idle slot more than the wait would
    ups = [upstream(in_flight=1, ms_per_token=1.0)]
    computing = [
        slot(0, busy=True, reuse=900, remaining_s=3.2, prefill_left_s=0.2),
        slot(1, reuse=0),
    ]
    short = {0: Restorable(300, 5.0)}
    assert policy.plan(RouteRequest(1000, restorable=short), computing, ups) == WaitForSlot(
        0, 0, 5.0
    )
    longer = {0: Restorable(950, 5.0)}
    assert policy.plan(RouteRequest(1000, restorable=longer), computing, ups) == UseSlot(0, 1)


def test_an_empty_idle_slot_is_credited_with_the_wait_its_copy_spares(policy) -> None:  # noqa: ANN001
    # The conversations' trap: two busy slots hold the system prompt every conversation starts
    # with (402 of 429 tokens), two idle slots nothing. Computing 429 tokens beside two
    # requests (63 ms) against a 50 ms wait and 27 tokens (59 ms): the wait, for every request,
    # and the empty slots stayed empty. The copy spares the next request such a wait.
    ups = [upstream(in_flight=2, ms_per_token=0.049)]
    busy = [slot(i, busy=True, reuse=402, lost=25, remaining_s=0.03) for i in (2, 3)]
    empty = [slot(0, empty=True), slot(1, empty=True)]
    assert policy.plan(RouteRequest(429), [*empty, *busy], ups) == UseSlot(0, 0)
    # an idle slot holding another text is not credited: the wait keeps that text
    held = [slot(0, reuse=0, lost=500), slot(1, reuse=0, lost=500)]
    assert policy.plan(RouteRequest(429), [*held, *busy], ups) == WaitForSlot(0, 2, 5.0)
