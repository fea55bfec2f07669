"""The llama-servers behind the proxy, and which one takes a request with no cache preference."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(eq=False)
class Upstream:
    """One llama-server, known by its base URL (`http://host:port`, no trailing slash)."""

    base_url: str
    in_flight: int = 0

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
        if len(self.upstreams) == 1:
            return self.upstreams[0]
        start = next(self._turn)
        order = self.upstreams[start:] + self.upstreams[:start]
        return min(order, key=lambda upstream: upstream.in_flight)
