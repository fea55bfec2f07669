"""The llama-servers behind the proxy, and which one takes a request with no cache preference."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from urllib.parse import quote

from cacheproxy.upstreams.unix_sockets import transport_base


@dataclass(eq=False)
class Upstream:
    """One llama-server, known by its base URL (`http://host:port`, no trailing slash, or
    `unix:///path/server.sock`: upstreams/unix_sockets.py)."""

    base_url: str
    in_flight: int = 0
    # whether this proxy may place requests, saves and restores on it: always, unless proxies
    # of a cluster share the upstreams, each held by one of them (cluster/keeper.py)
    held: bool = True
    # One model instance of a router-mode llama-server (`--models-dir`, `--models-preset`):
    # the model's name there. The router routes a POST by its body's "model" and a GET by
    # `?model=` (tools/server/server-models.cpp `proxy_post`, `proxy_get`); None: a server of
    # its own.
    model: str | None = None
    # where the HTTP clients send its requests: `base_url`, or a unix socket's host name
    transport_base: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.transport_base = transport_base(self.base_url)

    def url(self, path_qs: str) -> str:
        """Where a client's request goes, its query as the client wrote it."""
        return self.transport_base + path_qs

    def own_url(self, path_qs: str) -> str:
        """Where the proxy's own calls go: on a model instance, with its `model` and
        `autoload=false` (a save, a read of the slots, a health check must never load a model
        the router unloaded: it answers 400 "model is not loaded" instead, server-models.cpp
        `router_validate_model`)."""
        if self.model is None:
            return self.transport_base + path_qs
        separator = "&" if "?" in path_qs else "?"
        model = quote(self.model, safe="")
        return f"{self.transport_base}{path_qs}{separator}model={model}&autoload=false"

    def own_body(self, body: dict) -> dict:
        """A body of the proxy's own calls: on a model instance, naming its model."""
        return body if self.model is None else {**body, "model": self.model}

    @property
    def name(self) -> str:
        """How logs and labels name it: its URL, and on a router its model."""
        return self.base_url if self.model is None else f"{self.base_url} [{self.model}]"


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
