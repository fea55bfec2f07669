"""The two-sample Kolmogorov-Smirnov test the isolation audit relies on."""

from __future__ import annotations

import random

import pytest

from cacheproxy.bench.isolation import kolmogorov_survival, ks_two_sample


def test_identical_samples_cannot_be_told_apart() -> None:
    sample = [random.Random(1).random() for _ in range(100)]
    assert ks_two_sample(sample, list(sample)) == (0.0, 1.0)


def test_disjoint_samples_are_told_apart() -> None:
    distance, p = ks_two_sample([1.0, 2.0, 3.0] * 30, [10.0, 11.0] * 40)
    assert distance == 1.0
    assert p < 1e-10


def test_statistic_and_p_value_match_the_reference() -> None:
    rng = random.Random(1)
    first = [rng.gauss(0, 1) for _ in range(200)]
    second = [rng.gauss(0.3, 1) for _ in range(200)]
    distance, p = ks_two_sample(first, second)
    # scipy.stats.ks_2samp(first, second, method="asymp") gives D = 0.160, p = 0.01054
    assert distance == pytest.approx(0.160)
    assert p == pytest.approx(0.01054, rel=0.05)


def test_kolmogorov_distribution_known_points() -> None:
    assert kolmogorov_survival(0.0) == 1.0
    assert kolmogorov_survival(1.3581) == pytest.approx(0.05, abs=1e-3)  # the 5% critical value
    assert kolmogorov_survival(1.6276) == pytest.approx(0.01, abs=1e-3)
