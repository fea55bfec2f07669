"""What the upstreams' tables say a task request is admitted as (slots/guards.py)."""

from __future__ import annotations

import pytest

from cacheproxy.slots.guards import reuse_by_default
from cacheproxy.upstreams.slot_table import SlotState, Upstream, UpstreamSlots


def table(index: int, reuses: bool, healthy: bool = True) -> UpstreamSlots:
    upstream = Upstream(f"http://127.0.0.1:{index + 1}")
    found = UpstreamSlots(index, upstream, [SlotState(0, 4096)], reuses_by_default=reuses)
    found.healthy = healthy
    return found


@pytest.mark.parametrize(
    ("servers", "expected"),
    [
        ([(True, True)], True),
        ([(False, True)], False),  # --no-cache-prompt
        ([(False, True), (False, True)], False),
        ([(False, True), (True, True)], True),  # servers that differ: reuse assumed
        ([(False, True), (True, False)], False),  # only the healthy ones count
        ([(False, False)], True),  # none in service: nothing known, the server's default
    ],
)
def test_a_body_without_cache_prompt_is_taken_as_the_servers_default(
    servers: list[tuple[bool, bool]], expected: bool
) -> None:
    tables = [table(index, reuses, healthy) for index, (reuses, healthy) in enumerate(servers)]
    assert reuse_by_default(tables) is expected


def test_only_the_upstreams_serving_the_requests_model_count() -> None:
    """A router's models may differ (a preset's `cache-prompt = false`): a request is taken
    as the instances that may serve it reuse."""
    tables = [table(0, reuses=True), table(1, reuses=False)]
    assert reuse_by_default(tables, frozenset({1})) is False
    assert reuse_by_default(tables, frozenset({0})) is True
    assert reuse_by_default(tables, frozenset({0, 1})) is True
    assert reuse_by_default(tables, frozenset()) is True  # none: nothing known
