"""The `lru` archive eviction policy, loaded by name like any plugin."""

from __future__ import annotations

import pytest
from cacheproxy_plugins.eviction_lru import LruEviction

from cacheproxy.disk.eviction import EvictionCandidate, EvictionPolicy
from cacheproxy.plugins import PluginError, available, load_plugin


@pytest.fixture
def lru() -> EvictionPolicy:
    return load_plugin("eviction", "lru")


def candidate(
    archive_id: str, size: int = 100, last_used: float = 0.0, created: float = 0.0
) -> EvictionCandidate:
    return EvictionCandidate(archive_id, size, last_used, hits=0, created=created)


def test_lru_is_found_by_name_and_takes_no_options() -> None:
    assert "lru" in available("eviction")
    assert isinstance(load_plugin("eviction", "lru", {}), LruEviction)
    with pytest.raises(PluginError, match=r"unknown eviction plugin .mru.; known: .*lru"):
        load_plugin("eviction", "mru")


def test_the_least_recently_used_leave_first_until_enough_bytes_are_free(
    lru: EvictionPolicy,
) -> None:
    candidates = [
        candidate("recent", last_used=30.0),
        candidate("oldest", last_used=10.0),
        candidate("middle", last_used=20.0),
    ]
    assert lru.choose_victims(candidates, bytes_to_free=1, archives_to_free=0) == ["oldest"]
    assert lru.choose_victims(candidates, 101, 0) == ["oldest", "middle"]
    assert lru.choose_victims(candidates, 300, 0) == ["oldest", "middle", "recent"]


def test_a_count_to_free_is_met_as_well_as_bytes(lru: EvictionPolicy) -> None:
    candidates = [candidate("a", 1000, 1.0), candidate("b", 10, 2.0), candidate("c", 10, 3.0)]
    assert lru.choose_victims(candidates, bytes_to_free=0, archives_to_free=2) == ["a", "b"]
    assert lru.choose_victims(candidates, bytes_to_free=1, archives_to_free=1) == ["a"]


def test_nothing_to_free_evicts_nothing(lru: EvictionPolicy) -> None:
    assert lru.choose_victims([candidate("a")], 0, 0) == []
    assert lru.choose_victims([], 0, 0) == []


def test_ties_go_to_the_oldest_then_by_id(lru: EvictionPolicy) -> None:
    candidates = [
        candidate("b", last_used=5.0, created=2.0),
        candidate("c", last_used=5.0, created=1.0),
        candidate("a", last_used=5.0, created=2.0),
    ]
    assert lru.choose_victims(candidates, 0, 3) == ["c", "a", "b"]


def test_when_the_candidates_cannot_free_enough_all_are_named(lru: EvictionPolicy) -> None:
    # the store sees the shortfall and refuses the reservation without evicting anything
    candidates = [candidate("a", 10, 1.0), candidate("b", 10, 2.0)]
    assert lru.choose_victims(candidates, 1000, 0) == ["a", "b"]
