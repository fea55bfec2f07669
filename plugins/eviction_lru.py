"""Archive eviction `lru`: the least recently used archived states leave first."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from cacheproxy.disk.eviction import EvictionCandidate


class LruEviction:
    class Options(BaseModel):
        pass

    def __init__(self, options: Options, deps: object = None) -> None:
        self.options = options

    def choose_victims(
        self, candidates: Sequence[EvictionCandidate], bytes_to_free: int, archives_to_free: int
    ) -> list[str]:
        # ties (same last_used): the oldest first, then by id, so the order is reproducible
        ordered = sorted(candidates, key=lambda c: (c.last_used, c.created, c.archive_id))
        victims: list[str] = []
        freed_bytes = 0
        for candidate in ordered:
            if freed_bytes >= bytes_to_free and len(victims) >= archives_to_free:
                break
            victims.append(candidate.archive_id)
            freed_bytes += candidate.bytes
        return victims
