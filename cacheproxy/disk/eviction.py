"""The archive eviction-policy interface: which archived states leave when a quota is hit.

A policy is pure and synchronous: it gets the archives that may leave and how much must be freed,
and answers with the ids to evict. The archive store asks it inside the transaction that reserves
room, checks that the answer frees enough, and deletes the rows itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class EvictionCandidate:
    archive_id: str
    bytes: int
    last_used: float  # unix seconds of the last restore (creation time until then)
    hits: int  # restores so far
    created: float  # unix seconds


class EvictionPolicy(Protocol):
    def choose_victims(
        self, candidates: Sequence[EvictionCandidate], bytes_to_free: int, archives_to_free: int
    ) -> list[str]:
        """Ids among `candidates` whose removal frees at least `bytes_to_free` bytes and
        `archives_to_free` archives. When the candidates cannot free that much, any answer will do:
        the store refuses the reservation and evicts nothing.
        """
        ...
