"""The llama-servers behind the proxy, and which one takes a request with no cache preference."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(eq=False)
class Upstream:
    """One llama-server, known by its base URL (`http://host:port`, no trailing slash)."""

    base_url: str
    in_flight: int = 0
    # whether this proxy may place requests, saves and restores on it: always, unless proxies
    # of a cluster share the upstreams, each held by one of them (cluster/keeper.py)
    held: bool = True

    def url(self, path_qs: str) -> str:
        return self.base_url + path_qs


class UpstreamPool:
    """Least-in-flight choice among upstreams, ties broken round-robin."""

    def __init__(self, base_urls: list[str]) -> None:
        if not base_urls:
            raise ValueError("at least one upstream is needed")
        self.upstreams = [Upstream(url.rstrip("/")) for url in base_urls]
        self._turn = itertools.cycle(range(len(self.upstreams)))

    def pick(self) -> Upstream:
        """One this proxy holds, when it holds any (in a cluster, the others are another
        proxy's to use)."""
        candidates = [upstream for upstream in self.upstreams if upstream.held] or self.upstreams
        if len(candidates) == 1:
            return candidates[0]
        start = next(self._turn) % len(candidates)
        order = candidates[start:] + candidates[:start]
        return min(order, key=lambda upstream: upstream.in_flight)
