"""How long the requests queued ahead hold the busy slot they wait for, as each tenant sees it."""

from __future__ import annotations

import pytest

from cacheproxy.slots.queued_ahead import QueuedAhead
from cacheproxy.slots.routing import SlotCandidate, WaitForSlot
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import SlotState, Smoothed, UpstreamSlots


def table() -> UpstreamSlots:
    measured = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(2)])
    measured.prefill_ms_per_token = Smoothed(0.5)
    measured.request_s = Smoothed(3.0)
    measured.after_prefill_s = Smoothed(0.2)
    return measured


def busy_slot(reuse: int) -> SlotCandidate:
    return SlotCandidate(0, 1, busy=True, empty=False, reuse=reuse, lost=0, last_used=1.0,
                         busy_for_s=0.1)  # fmt: skip


def test_a_tenants_own_waits_count_what_they_compute_and_others_a_mean_request() -> None:
    tables = [table()]
    ahead = QueuedAhead()
    # a's request leaves 200 of its 1,200 tokens to compute there: 0.1 s, then 0.2 s
    ahead.waits(WaitForSlot(0, 1, 5.0), "a", 1200, [busy_slot(1000)], tables)
    assert ahead.seconds("a", tables) == {(0, 1): pytest.approx(0.3)}
    # b never sees what a sent: a mean request's time, whatever a's prompt
    assert ahead.seconds("b", tables) == {(0, 1): pytest.approx(3.0)}
    ahead.waits(WaitForSlot(0, 1, 5.0), "b", 5000, [busy_slot(1000)], tables)
    assert ahead.seconds("a", tables) == {(0, 1): pytest.approx(3.3)}
    assert ahead.seconds("b", tables) == {(0, 1): pytest.approx(3.0 + 2.2)}
