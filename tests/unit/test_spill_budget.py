"""Spilled bytes bounded per tenant (429) and in all (503), refused at once with Retry-After."""

from __future__ import annotations

import pytest

from cacheproxy.errors import ApiError
from cacheproxy.http.spill_budget import BODY_LIMIT_ERROR, SpillBudget


def test_a_tenant_past_its_bound_gets_429_and_another_is_served() -> None:
    budget = SpillBudget(total_bytes=1000, tenant_bytes=300)
    budget.reserve("a", 200)
    with pytest.raises(ApiError) as refused:
        budget.reserve("a", 200)
    assert refused.value.status == 429 and refused.value.error_type == BODY_LIMIT_ERROR
    assert refused.value.headers == {"Retry-After": "1"}
    budget.reserve("b", 300)  # another tenant's bound is its own
    assert budget.held_by == {"a": 200, "b": 300} and budget.held == 500


def test_the_proxy_past_its_bound_gets_503() -> None:
    budget = SpillBudget(total_bytes=500, tenant_bytes=300)
    budget.reserve("a", 300)
    budget.reserve("b", 150)
    with pytest.raises(ApiError) as refused:
        budget.reserve("c", 100)
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    assert budget.held == 450  # a refusal holds nothing


def test_released_bytes_can_be_spilled_again() -> None:
    budget = SpillBudget(total_bytes=500, tenant_bytes=300)
    budget.reserve("a", 300)
    budget.release("a", 300)
    assert budget.held == 0 and not budget.held_by
    budget.reserve("a", 300)
