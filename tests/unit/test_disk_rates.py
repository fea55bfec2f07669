"""Measured rates: a disk that turns slow (or fast) shows within a few samples."""

from __future__ import annotations

import pytest

from cacheproxy.disk.rates import MeasuredRate


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
