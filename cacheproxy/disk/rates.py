"""Measured disk and server rates the disk tier decides by, as moving averages.

Rates of a disk span orders of magnitude (a page cache, an NVMe drive, a throttled network
mount), so they are averaged in log space: two slow saves after a fast one already say the disk
is slow, where an arithmetic mean would take a dozen. Each rate also knows when it was last
measured: a decision made on a stale rate may be worth taking again only to measure it
(`stale`), or the tier would never notice that a disk came back; and the sample that measures it
again replaces the old average rather than joining it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class MeasuredRate:
    """A geometric moving average of positive samples (bytes per ms, ms per token...)."""

    value: float
    weight: float = 0.5
    clock: Callable[[], float] = time.monotonic
    measured_at: float | None = None  # `clock()` of the last sample; None: still the guess
    samples: int = 0
    _log: float = field(init=False)

    def __post_init__(self) -> None:
        self._log = math.log(self.value)

    def add(self, sample: float, fresh_after_s: float | None = None) -> None:
        """Average `sample` in. The first replaces the guess; so does one that comes after
        `fresh_after_s` without any: the average describes hardware that may have changed."""
        if not sample > 0 or math.isinf(sample):
            return  # a zero-length timing says nothing about the rate
        if not self.samples or (fresh_after_s is not None and self.stale(fresh_after_s)):
            self._log = math.log(sample)
        else:
            self._log += self.weight * (math.log(sample) - self._log)
        self.value = math.exp(self._log)
        self.measured_at = self.clock()
        self.samples += 1

    def stale(self, max_age_s: float) -> bool:
        """Not measured for `max_age_s` (or never): worth measuring again."""
        return self.measured_at is None or self.clock() - self.measured_at > max_age_s
