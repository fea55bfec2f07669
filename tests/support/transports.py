"""What a proxy in front of a llama-server reached over another transport (a unix socket,
https) must still do: place and predict, save and restore slots, relay streams and the
server's own routes."""

from __future__ import annotations

from typing import Any

import aiohttp

from cacheproxy.http.app_keys import CACHE
from tests.support.completions import complete
from tests.support.disk_tier import conversation, evict_with_others, next_turn
from tests.support.metrics import proxy_counters, sample

SERVER_ROUTES = ("/props", "/v1/models", "/slots", "/metrics")


async def serves_as_over_tcp(client: aiohttp.ClientSession, url: str, app: Any) -> None:
    """Through the proxy at `url` (its app `app`), in front of one llama-server of two slots
    with the disk tier on: the probe found its slots; a conversation evicted is restored, every
    prediction right; a stream is relayed whole; the server's routes answer."""
    table = app[CACHE].tables[0]
    assert table.healthy and len(table.slots) == 2 and table.ram_cache_state == "off"
    first = conversation(1)
    answer = await complete(client, url, first)
    await evict_with_others(client, url, range(100, 102))  # the slot saved
    again = await complete(client, url, next_turn(first, answer, 2))
    assert again["timings"]["cache_n"] >= len(first)  # restored, not computed again
    counters = await proxy_counters(client, url)
    assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 1
    assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 0
    assert sample(app, "cacheproxy_predictions_total", result="match") == 4

    body = {"prompt": conversation(7, 50), "n_predict": 4, "stream": True}
    async with client.post(url + "/completion", json=body) as response:
        assert response.status == 200
        events = [line for line in (await response.text()).splitlines() if line]
    assert events[-1].startswith("data: ") and '"stop":true' in events[-1]
    for path in SERVER_ROUTES:
        async with client.get(url + path) as proxied:
            assert proxied.status == 200, path
