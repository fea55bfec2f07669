"""Split requests (`n` > 1, prompt batches) within their tenant's cap and share, on a real
llama-server: each task counts toward `max_concurrent` (one that passes it alone is refused
with its 429), a prompt's tasks take their slots together within the share or wait in the
tenant's queue holding none, and another tenant's next request finds the slot kept for it.

Occupancy is read from the proxy's own records (which slot is leased to whom) while the server
is stopped (SIGSTOP): nothing ends meanwhile, so whatever a test sees granted was granted
beside the requests already running, never after them; SIGCONT lets every request finish. (The
proxy does not read an idle upstream's slots before placing a request here: a stopped server
would hold that read.)"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from tests.support.fair_share import MovedClock, Proxy, fair_proxy
from tests.support.servers import StartServer
from tests.support.waiting import wait_for as until

NO_RECHECK = {"recheck_idle_s": 0}
_rng = random.Random(4242)


def ids(n: int = 24) -> list[int]:
    return [_rng.randrange(300, 31000) for _ in range(n)]


async def post(
    client: aiohttp.ClientSession, proxy: Proxy, key: str, body: dict, priority: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    if priority is not None:
        headers["X-Priority"] = priority
    async with client.post(proxy.url + "/completion", json=body, headers=headers) as response:
        return response.status, await response.json()


def held_by(proxy: Proxy, tenant_id: str) -> int:
    """Slots the proxy has leased to the tenant's requests."""
    slots = proxy.app[CACHE].scheduler.tables[0].slots
    return sum(slot.busy and slot.tenant == tenant_id for slot in slots)


SPLIT_BODIES = {
    "n=4": {"prompt": ids(), "n": 4, "n_predict": 4},
    "a 16-prompt batch": {"prompt": [ids() for _ in range(16)], "n_predict": 4},
}


@pytest.mark.parametrize("shape", SPLIT_BODIES)
async def test_a_split_request_past_the_tenants_cap_is_refused_and_takes_no_slot(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, shape: str
) -> None:
    """Capped at one request in progress (and the batch class): its four (sixteen) tasks are
    four requests in progress, more than its cap can ever hold."""
    server = start_server(parallel=4)
    async with fair_proxy(server, tmp_path, NO_RECHECK) as proxy:
        capped_tenant, capped = await proxy.create("capped", max_concurrent=1, max_priority="batch")
        other_tenant, other = await proxy.create("other")
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            split = asyncio.ensure_future(post(client, proxy, capped, SPLIT_BODIES[shape]))
            small = asyncio.ensure_future(
                post(client, proxy, other, {"prompt": ids(8), "n_predict": 2})
            )
            # the other tenant's request gets a slot beside whatever the split one holds
            await until(lambda: held_by(proxy, other_tenant.id) == 1, "the small request's slot")
            assert held_by(proxy, capped_tenant.id) == 0
            status, answer = await split
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert status == 429, answer
        assert answer["error"]["type"] == "concurrency_limit_error"
        assert (await small)[0] == 200
        assert proxy.app[CACHE].gate.in_flight(capped_tenant.id) == 0


async def test_a_prompts_completions_beyond_the_share_wait_together_holding_no_slot(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Four slots, two tenants active: each one's share is two. n=4 cannot fit beside the other
    tenant: it waits in its tenant's queue and holds nothing, and the other tenant's next
    request is served at once; once that tenant is quiet, the four tasks start side by side."""
    server = start_server(parallel=4)
    # a window no machine's pauses outlast; the clock is moved on past it once light is quiet
    async with fair_proxy(server, tmp_path, NO_RECHECK, share_window_s=60) as proxy:
        clock = MovedClock()
        proxy.app[CACHE].scheduler.clock = clock
        heavy_tenant, heavy = await proxy.create("heavy")
        light_tenant, light = await proxy.create("light")
        assert (await post(client, proxy, light, {"prompt": ids(8), "n_predict": 1}))[0] == 200
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            body = {"prompt": ids(), "n": 4, "n_predict": 4}
            split = asyncio.ensure_future(post(client, proxy, heavy, body))
            await until(lambda: proxy.queued == 1, "the split request to wait")
            assert held_by(proxy, heavy_tenant.id) == 0  # none of its slots held meanwhile
            small = asyncio.ensure_future(
                post(client, proxy, light, {"prompt": ids(8), "n_predict": 2})
            )
            await until(lambda: held_by(proxy, light_tenant.id) == 1, "the light request's slot")
            assert held_by(proxy, heavy_tenant.id) == 0 and proxy.queued == 1
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert (await small)[0] == 200
        # once the light tenant is quiet, the four tasks get their slots together
        clock.ahead_s = 60
        proxy.app[CACHE].scheduler.upstream_changed()  # plan again on the moved clock
        status, results = await asyncio.wait_for(split, 30)
        assert status == 200, results
        assert sorted(result["id_slot"] for result in results) == [0, 1, 2, 3]


async def test_a_batch_takes_no_more_than_its_share_beside_an_active_tenant(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """A 16-prompt batch beside a tenant active within the window: its prompts take slots as a
    flood of single requests would, leaving the last one free for the other tenant's next."""
    server = start_server(parallel=4)
    async with fair_proxy(server, tmp_path, NO_RECHECK, share_window_s=60) as proxy:
        heavy_tenant, heavy = await proxy.create("heavy")
        light_tenant, light = await proxy.create("light")
        assert (await post(client, proxy, light, {"prompt": ids(8), "n_predict": 1}))[0] == 200
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            body = {"prompt": [ids() for _ in range(16)], "n_predict": 4}
            batch = asyncio.ensure_future(post(client, proxy, heavy, body))
            await until(lambda: proxy.queued == 13, "the batch's prompts to take their slots")
            assert held_by(proxy, heavy_tenant.id) == 3  # its share, and one more: not the last
            small = asyncio.ensure_future(
                post(client, proxy, light, {"prompt": ids(8), "n_predict": 2})
            )
            await until(lambda: held_by(proxy, light_tenant.id) == 1, "the light request's slot")
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert (await small)[0] == 200
        status, results = await batch
        assert status == 200, results
        assert [result["index"] for result in results] == list(range(16))
