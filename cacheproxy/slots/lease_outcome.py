"""What a request tells: how it compared with the prediction, what its timings teach the
upstream's measurements, and whether it continued the text it reused.

The verdict is pure: the reuse the table predicted for the request against the server's
`timings.cache_n` (a prediction the server did not report on is not checked). The timings feed
the measurements the routing policy and the disk tier price with: how long a request holds a
slot, how long it holds it once its prompt is computed, what a prompt token costs the server.
Only a request that ended well (not cut) teaches anything, and a prompt too short to time says
nothing of the rate. Whether a tenant's requests continue what they reuse or branch off it is
smoothed per tenant, the last requests counting most. Cost: a few additions per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from cacheproxy.upstreams.rates import MIN_PREFILL_SAMPLE_TOKENS
from cacheproxy.upstreams.slot_table import ReuseBounds, Smoothed, TaskOutcome, UpstreamSlots

# a tenant's last requests that reused a text count most in how often its requests continue one
LINEAGE_WEIGHT = 0.1


@dataclass(frozen=True)
class Verdict:
    """How a finished request compared with the table's prediction."""

    predicted: ReuseBounds
    cache_n: int | None

    @property
    def checked(self) -> bool:
        return self.cache_n is not None

    @property
    def matched(self) -> bool:
        return self.cache_n is not None and self.predicted.holds(self.cache_n)


def learn_timings(
    table: UpstreamSlots, started: float, ended: float, prefill_end: float, outcome: TaskOutcome
) -> None:
    """Record a request that held a slot of `table` from `started` to `ended` and whose prompt
    was computed by `prefill_end` (as far as the scheduler knows; inf: not known)."""
    if not outcome.ok or outcome.cut:
        return
    table.request_s.add(ended - started)
    if prefill_end <= ended:
        table.after_prefill_s.add(ended - prefill_end)
    if outcome.prompt_n and outcome.prompt_n >= MIN_PREFILL_SAMPLE_TOKENS and outcome.prompt_ms:
        table.prefill_ms_per_token.add(outcome.prompt_ms / outcome.prompt_n)
        # its prompt ended before the tokens it generated
        prompt_end = ended - (outcome.predicted_ms or 0.0) / 1000
        table.prefill_throughput.add(prompt_end, outcome.prompt_ms, outcome.prompt_n)


class ContinueRates:
    """Per tenant: how often its requests lately continued the whole text they reused rather
    than branched off it, and how often to its very end (the disk tier prices an archive of its
    slots by them)."""

    def __init__(self) -> None:
        self._rates: dict[str, Smoothed] = {}
        self._exact_rates: dict[str, Smoothed] = {}

    def chance(self, tenant: str | None) -> float:
        """The rate for `tenant` (1 until any request of its reused a text)."""
        return _rate(self._rates, tenant)

    def exact_chance(self, tenant: str | None) -> float:
        """The rate for `tenant` of requests that left out at most one token of the text."""
        return _rate(self._exact_rates, tenant)

    def seen(self, tenant: str, continued: bool, exactly: bool | None = None) -> None:
        """One more request of `tenant` that reused a text; `exactly` None: not known how
        close to its end."""
        rate = self._rates.setdefault(tenant, Smoothed(1.0, LINEAGE_WEIGHT))
        rate.add(1.0 if continued else 0.0)
        if exactly is not None:
            exact = self._exact_rates.setdefault(tenant, Smoothed(1.0, LINEAGE_WEIGHT))
            exact.add(1.0 if exactly else 0.0)


def _rate(rates: dict[str, Smoothed], tenant: str | None) -> float:
    measured = rates.get(tenant) if tenant is not None else None
    return 1.0 if measured is None else measured.value
