"""Several tasks answered as one (a whole upstream's `n_cmpl`, or a batch of prompts): the
outcome they add up to, for the meter and the limits; what each slot holds is read from the
server instead (slots/unpinned.py)."""

from __future__ import annotations

from typing import Any

from cacheproxy.upstreams.slot_table import TaskOutcome


def summed(outcomes: list[TaskOutcome]) -> TaskOutcome:
    """Tasks answered together as one: their counts added up (a count one of them lacks is
    not known), their times the longest; what a slot holds is not told (the caller reads it
    from the server)."""

    def total(counts: list[int | None]) -> int | None:
        known = [count for count in counts if count is not None]
        return sum(known) if len(known) == len(counts) else None

    def longest(times: list[float | None]) -> float | None:
        known = [time for time in times if time is not None]
        return max(known) if known and len(known) == len(times) else None

    return TaskOutcome(
        ok=all(outcome.ok for outcome in outcomes),
        cache_n=total([outcome.cache_n for outcome in outcomes]),
        prompt_n=total([outcome.prompt_n for outcome in outcomes]),
        prompt_ms=longest([outcome.prompt_ms for outcome in outcomes]),
        predicted_n=total([outcome.predicted_n for outcome in outcomes]),
        predicted_ms=longest([outcome.predicted_ms for outcome in outcomes]),
    )


def of_timings(timings: dict[str, Any]) -> TaskOutcome:
    """A task's outcome as its final timings tell it."""
    return TaskOutcome(
        ok=True,
        cache_n=timings.get("cache_n"),
        prompt_n=timings.get("prompt_n"),
        prompt_ms=timings.get("prompt_ms"),
        predicted_n=timings.get("predicted_n"),
        predicted_ms=timings.get("predicted_ms"),
    )
