"""The proxy's own counters, read from its /metrics as a test reads them."""

from __future__ import annotations

import re
from typing import Any

import aiohttp

from cacheproxy.http.app_keys import METRICS


async def proxy_counters(
    client: aiohttp.ClientSession, proxy_url: str, headers: dict[str, str] | None = None
) -> dict[str, float]:
    """The proxy's own counters from /metrics, keyed by `name{labels}` (`headers`: the admin
    key, once tenants exist)."""
    async with client.get(proxy_url + "/metrics", headers=headers) as response:
        text = await response.text()
    counters = {}
    for line in text.splitlines():
        match = re.match(r"^(cacheproxy_\w+)(\{[^}]*\})? (\S+)$", line)
        if match:
            counters[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return counters


def sample(app: Any, name: str, **labels: str) -> float:
    """One of the proxy's own samples, read from the registry behind /metrics (0: none yet)."""
    return app[METRICS].registry.get_sample_value(name, labels) or 0.0
