"""Measured disk and server rates the disk tier decides by, as moving averages.

Rates of a disk span orders of magnitude (a page cache, an NVMe drive, a throttled network
mount), so they are averaged in log space: two slow saves after a fast one already say the disk
is slow, where an arithmetic mean would take a dozen. Each rate also knows when it was last
measured: a decision made on a stale rate may be worth taking again only to measure it
(`stale`), or the tier would never notice that a disk came back; and the sample that measures it
again replaces the old average rather than joining it.

What a prompt token costs the server (`PrefillThroughput`) is not what one request reports:
slots computing prompts at the same time share the server's batches, and each request's
`prompt_ms` counts the whole of them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# A prompt with fewer uncached tokens measures the server's fixed time per step, not its prefill
# rate: one token takes a whole step (a few ms here, tens on a GPU), which as ms per token made
# every uncached token of a short prompt look dear (the router queued short prompts for the busy
# slot holding them rather than take an idle one). The scheduler's per-request rate and the
# server's throughput here both learn only from larger prompts.
MIN_PREFILL_SAMPLE_TOKENS = 64


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


@dataclass
class PrefillThroughput:
    """What a prompt token costs the server: the prompt tokens it computed over the time it
    spent computing them (the union of the prompts' intervals), over the last `window_s`.

    Four prompts computed in the same batches for a second each report a second; the server
    computed all four in that second. A request reports its `prompt_ms` and, after it, the
    `predicted_ms` of its generation: its prompt ended `predicted_ms` before its answer."""

    window_s: float = 60.0
    max_spans: int = 256
    _spans: deque[tuple[float, float, int]] = field(default_factory=deque)
    # worked out at each `add`: every request's routing reads it
    _ms_per_token: float | None = None

    def add(self, end_s: float, prompt_ms: float | None, prompt_n: int | None) -> None:
        """A prompt of `prompt_n` tokens computed in the `prompt_ms` before `end_s` (seconds,
        any clock the caller keeps to)."""
        if not prompt_n or prompt_n < MIN_PREFILL_SAMPLE_TOKENS or not prompt_ms or prompt_ms <= 0:
            return
        self._spans.append((end_s - prompt_ms / 1000, end_s, prompt_n))
        latest = max(end for _, end, _ in self._spans)
        while self._spans and (
            len(self._spans) > self.max_spans or self._spans[0][1] < latest - self.window_s
        ):
            self._spans.popleft()
        self._ms_per_token = self._measure()

    def ms_per_token(self) -> float | None:
        """Milliseconds of the server per prompt token; None until a prompt measured it."""
        return self._ms_per_token

    def _measure(self) -> float | None:
        if not self._spans:
            return None
        busy_s, tokens = 0.0, 0
        reach = float("-inf")  # the end of the merged intervals so far
        for start, end, n_tokens in sorted(self._spans):
            tokens += n_tokens
            if end <= reach:
                continue
            busy_s += end - max(start, reach)
            reach = end
        return busy_s * 1000 / tokens


def round_trip_sample(elapsed_ms: float, server_ms: float, others_busy: int) -> float | None:
    """What a save or restore on a request's path made that request wait beyond the server's
    own time: the round trip, measured only while no other slot was busy. Beside busy slots the
    server first finishes the batch under way (`batch_wait_sample`)."""
    if server_ms <= 0 or others_busy:
        return None
    return max(elapsed_ms - server_ms, 0.0)


def batch_wait_sample(
    elapsed_ms: float, server_ms: float, others_busy: int, round_trip_ms: float
) -> float | None:
    """What a save or restore waited, beside busy slots, for the batch under way: its time
    beyond the server's own and the round trip (None: no other slot was busy, or the server
    did not say how long it took). The request behind it waits as long again for the batch
    after it, which its prompt alone would not have (disk/policy.py)."""
    if server_ms <= 0 or not others_busy:
        return None
    return max(elapsed_ms - server_ms - round_trip_ms, 0.0)


@dataclass
class Smoothed:
    """An exponentially weighted mean: recent measurements count most. A `prior` value is a
    guess made before any measurement: the first sample replaces it."""

    value: float
    weight: float = 0.2
    prior: bool = False

    def add(self, sample: float) -> None:
        if self.prior:
            self.value, self.prior = sample, False
            return
        self.value += self.weight * (sample - self.value)
