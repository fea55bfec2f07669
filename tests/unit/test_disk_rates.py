"""Measured rates: a disk that turns slow (or fast) shows within a few samples."""

from __future__ import annotations

import pytest

from cacheproxy.upstreams.rates import (
    MeasuredRate,
    PrefillThroughput,
    batch_wait_sample,
    round_trip_sample,
)


def test_the_first_sample_replaces_the_guess() -> None:
    rate = MeasuredRate(1000.0)
    rate.add(2.0)
    assert rate.value == pytest.approx(2.0)


def test_two_slow_samples_bring_a_fast_rate_within_tenfold() -> None:
    rate = MeasuredRate(1000.0)
    rate.add(1000.0)
    rate.add(1.0)
    rate.add(1.0)
    assert rate.value == pytest.approx(1000 ** (1 / 4))  # 5.6: the geometric mean moved 3/4
    for _ in range(10):
        rate.add(1000.0)
    assert rate.value == pytest.approx(1000.0, rel=0.01)


def test_staleness_follows_the_last_sample() -> None:
    now = [100.0]
    rate = MeasuredRate(5.0, clock=lambda: now[0])
    assert rate.stale(60)  # only the initial guess
    rate.add(5.0)
    now[0] += 60
    assert not rate.stale(60)
    now[0] += 1
    assert rate.stale(60)


def test_empty_timings_are_no_sample() -> None:
    rate = MeasuredRate(5.0)
    rate.add(0.0)
    rate.add(float("inf"))
    assert rate.samples == 0 and rate.value == 5.0


def test_a_sample_after_a_long_silence_replaces_the_average() -> None:
    now = [0.0]
    rate = MeasuredRate(1000.0, clock=lambda: now[0])
    rate.add(1.0, fresh_after_s=60)
    rate.add(1.0, fresh_after_s=60)
    now[0] += 61  # nothing measured since: the disk may have changed
    rate.add(500.0, fresh_after_s=60)
    assert rate.value == pytest.approx(500.0)


def test_prompts_computed_together_cost_the_server_a_share_each() -> None:
    # four 500-token prompts in the same batches for 1 s: each reports 2 ms a token, the
    # server computed 2,000 tokens in that second, 0.5 ms each
    throughput = PrefillThroughput()
    for _ in range(4):
        throughput.add(end_s=10.0, prompt_ms=1000.0, prompt_n=500)
    assert throughput.ms_per_token() == pytest.approx(0.5)


def test_a_prompt_computed_alone_costs_what_it_reports() -> None:
    throughput = PrefillThroughput()
    throughput.add(end_s=10.0, prompt_ms=1000.0, prompt_n=500)
    throughput.add(end_s=12.0, prompt_ms=500.0, prompt_n=250)  # after a pause
    assert throughput.ms_per_token() == pytest.approx(2.0)


def test_overlapping_prompts_count_their_common_time_once() -> None:
    throughput = PrefillThroughput()
    throughput.add(end_s=10.0, prompt_ms=1000.0, prompt_n=400)  # 9.0 - 10.0
    throughput.add(end_s=10.5, prompt_ms=1000.0, prompt_n=400)  # 9.5 - 10.5
    assert throughput.ms_per_token() == pytest.approx(1500 / 800)


def test_the_throughput_follows_the_recent_prompts_only() -> None:
    throughput = PrefillThroughput(window_s=30.0)
    assert throughput.ms_per_token() is None  # nothing measured yet
    throughput.add(end_s=10.0, prompt_ms=1000.0, prompt_n=100)  # 10 ms a token, long ago
    throughput.add(end_s=100.0, prompt_ms=100.0, prompt_n=100)
    assert throughput.ms_per_token() == pytest.approx(1.0)


def test_short_prompts_are_no_sample() -> None:
    # a prompt of a few tokens still costs a whole server step: it says nothing of a token's cost
    throughput = PrefillThroughput()
    throughput.add(end_s=10.0, prompt_ms=50.0, prompt_n=1)
    throughput.add(end_s=11.0, prompt_ms=0.0, prompt_n=500)
    assert throughput.ms_per_token() is None


def test_the_round_trip_is_measured_on_a_quiet_server_only() -> None:
    # alone: what the request waited beyond the server's own 10 ms is the round trip
    assert round_trip_sample(elapsed_ms=14.0, server_ms=10.0, others_busy=0) == pytest.approx(4.0)
    # beside busy slots the server finished the batch under way first (serving them, not the
    # disk tier): no sample of the round trip
    assert round_trip_sample(elapsed_ms=400.0, server_ms=10.0, others_busy=3) is None
    # a server that did not say how long it took: no sample either
    assert round_trip_sample(elapsed_ms=14.0, server_ms=0.0, others_busy=0) is None


def test_the_batch_waited_for_is_measured_beside_busy_slots_only() -> None:
    # beside busy slots: 400 ms of which the server's own 10 ms and a 4 ms round trip
    assert batch_wait_sample(
        elapsed_ms=414.0, server_ms=10.0, others_busy=3, round_trip_ms=4.0
    ) == pytest.approx(400.0)
    # alone there is no batch under way to wait for
    assert (
        batch_wait_sample(elapsed_ms=14.0, server_ms=10.0, others_busy=0, round_trip_ms=4.0) is None
    )
    # a server that did not say how long it took: no sample
    assert (
        batch_wait_sample(elapsed_ms=414.0, server_ms=0.0, others_busy=3, round_trip_ms=4.0) is None
    )
    # never below nothing (a round trip faster than its average)
    assert batch_wait_sample(12.0, 10.0, 1, 4.0) == 0.0
