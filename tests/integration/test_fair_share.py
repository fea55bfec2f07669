"""Fair share between tenants on a real llama-server: per-tenant bounds, weights, the
concurrency cap, priority classes, and the settings kept in the registry across a restart.

To make a queue build up deterministically, the llama-server is stopped with SIGSTOP while a
request holds its slot (the request hangs upstream, the others wait in the proxy), and
continued with SIGCONT: every request then runs for real. Prompts are token ids under
`disk.min_tokens`, so nothing calls the server before a slot is leased.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.tenancy.registry import Tenant
from tests.support.fair_share import ADMIN_KEY, MovedClock, Proxy, busy_slots, fair_proxy
from tests.support.servers import LlamaServer, StartServer
from tests.support.waiting import wait_for as until


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict


@contextlib.contextmanager
def stopped(server: LlamaServer) -> Iterator[None]:
    """The server frozen (SIGSTOP) for the block, continued (SIGCONT) after, whatever happens."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


_rng = random.Random(14)


def prompt() -> list[int]:
    """A fresh short prompt: no two requests share a prefix the router would wait for."""
    return [_rng.randrange(300, 31000) for _ in range(24)]


async def complete(
    http: aiohttp.ClientSession, proxy: Proxy, key: str, priority: str | None = None
) -> Answer:
    headers = {"Authorization": f"Bearer {key}"}
    if priority is not None:
        headers["X-Priority"] = priority
    body = {"prompt": prompt(), "n_predict": 2}
    async with http.post(proxy.url + "/completion", json=body, headers=headers) as response:
        return Answer(response.status, dict(response.headers), await response.json())


async def one_by_one(
    proxy: Proxy, requests: list[Callable[[], Awaitable[Answer]]]
) -> list[asyncio.Task[Answer]]:
    """Send the requests in this order, each one waiting in the queue before the next is sent."""
    tasks = []
    for send in requests:
        before = proxy.queued
        tasks.append(asyncio.ensure_future(send()))
        await until(lambda before=before: proxy.queued == before + 1, "a request to queue")
    return tasks


class Arrivals:
    """Answers labelled by who sent them, in the order they arrived (one slot: service order)."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    def sender(self, label: str, send: Callable[[], Awaitable[Answer]]):  # noqa: ANN201
        async def labelled() -> Answer:
            answer = await send()
            assert answer.status == 200, answer.body
            self.labels.append(label)
            return answer

        return labelled


def slot_taken(proxy: Proxy) -> Callable[[], bool]:
    return lambda: all(slot.busy for slot in proxy.app[CACHE].scheduler.tables[0].slots)


async def test_a_flooding_tenant_gets_429_past_its_bound_and_the_other_tenant_is_served(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1)
    async with fair_proxy(server, tmp_path, max_queue_per_tenant=64) as proxy:
        _, heavy = await proxy.create("heavy", max_queued=3)
        _, light = await proxy.create("light")
        with stopped(server):
            holder = asyncio.ensure_future(complete(client, proxy, heavy))
            await until(slot_taken(proxy), "the first request to get the slot")
            flood = [asyncio.ensure_future(complete(client, proxy, heavy)) for _ in range(12)]
            lights = [asyncio.ensure_future(complete(client, proxy, light)) for _ in range(3)]
            await until(lambda: sum(task.done() for task in flood) == 9, "the flood's refusals")
            refused = [task.result() for task in flood if task.done()]
            assert proxy.queued == 3 + 3  # heavy at its bound, every light request waiting
            assert not any(task.done() for task in lights)
        for answer in refused:
            assert answer.status == 429
            assert answer.body["error"]["type"] == "queue_limit_error"
            assert answer.body["error"]["code"] == 429
            assert int(answer.headers["Retry-After"]) >= 1
        for answer in await asyncio.gather(*lights, holder):
            assert answer.status == 200, answer.body
        statuses = sorted(answer.status for answer in await asyncio.gather(*flood))
        assert statuses == [200] * 3 + [429] * 9


async def test_a_full_queue_turns_away_the_flooder_not_the_newcomer(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1)
    async with fair_proxy(server, tmp_path) as proxy:
        proxy.app[CACHE].scheduler.max_queue = 4
        _, heavy = await proxy.create("heavy")
        _, light = await proxy.create("light")
        with stopped(server):
            holder = asyncio.ensure_future(complete(client, proxy, heavy))
            await until(slot_taken(proxy), "the slot to be taken")
            flood = await one_by_one(proxy, [lambda: complete(client, proxy, heavy)] * 4)
            newcomer = asyncio.ensure_future(complete(client, proxy, light))
            await until(lambda: flood[-1].done(), "the flood's newest to give way")
            assert flood[-1].result().status == 429
            assert flood[-1].result().body["error"]["type"] == "queue_limit_error"
            assert not newcomer.done()
        assert (await newcomer).status == 200
        assert all(answer.status == 200 for answer in await asyncio.gather(holder, *flood[:3]))


@pytest.mark.parametrize("fair_share", [True, False])
async def test_weights_give_proportional_service(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, fair_share: bool
) -> None:
    server = start_server(parallel=1)
    async with fair_proxy(server, tmp_path, fair_share=fair_share) as proxy:
        _, blocker = await proxy.create("blocker")
        _, gold = await proxy.create("gold", weight=3)
        _, bronze = await proxy.create("bronze")
        with stopped(server):
            holder = asyncio.ensure_future(complete(client, proxy, blocker))
            await until(slot_taken(proxy), "the slot to be taken")
            # bronze's all arrive first: a FIFO serves them first, fair share does not
            arrivals = Arrivals()
            tasks = await one_by_one(
                proxy,
                [arrivals.sender("bronze", lambda: complete(client, proxy, bronze))] * 8
                + [arrivals.sender("gold", lambda: complete(client, proxy, gold))] * 8,
            )
        await asyncio.gather(holder, *tasks)
        first_eight = arrivals.labels[:8]
        if fair_share:
            assert first_eight.count("gold") == 6, first_eight  # 3 : 1
        else:
            assert first_eight.count("gold") == 0, first_eight


async def test_interactive_goes_before_batch_and_the_admin_caps_the_class(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1)
    async with fair_proxy(server, tmp_path) as proxy:
        _, user = await proxy.create("user")
        _, capped = await proxy.create("capped", max_priority="batch")
        bad = await complete(client, proxy, user, priority="urgent")
        assert bad.status == 400 and "X-Priority" in bad.body["error"]["message"]
        with stopped(server):
            holder = asyncio.ensure_future(complete(client, proxy, user))
            await until(slot_taken(proxy), "the slot to be taken")
            arrivals = Arrivals()
            tasks = await one_by_one(
                proxy,
                [
                    arrivals.sender("batch1", lambda: complete(client, proxy, user, "batch")),
                    arrivals.sender("batch2", lambda: complete(client, proxy, user, "batch")),
                    arrivals.sender("inter", lambda: complete(client, proxy, user, "interactive")),
                    arrivals.sender("c-batch", lambda: complete(client, proxy, capped, "batch")),
                    # asks for interactive, runs as batch: it does not pass its own batch one
                    arrivals.sender(
                        "c-inter", lambda: complete(client, proxy, capped, "interactive")
                    ),
                ],
            )
        await asyncio.gather(holder, *tasks)
        order = arrivals.labels
        assert order.index("inter") < order.index("batch1") < order.index("batch2")
        assert order.index("c-batch") < order.index("c-inter")


async def test_the_concurrency_cap_holds_under_concurrency(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=4)
    async with fair_proxy(server, tmp_path) as proxy:
        capped_tenant, capped = await proxy.create("capped", max_concurrent=2)
        other_tenant, other = await proxy.create("other")
        gate = proxy.app[CACHE].gate
        with stopped(server):
            burst = [asyncio.ensure_future(complete(client, proxy, capped)) for _ in range(8)]
            await until(lambda: sum(task.done() for task in burst) == 6, "the refusals")
            assert gate.in_flight(capped_tenant.id) == 2
            others = [asyncio.ensure_future(complete(client, proxy, other)) for _ in range(2)]
            await until(lambda: gate.in_flight(other_tenant.id) == 2, "the other tenant's")
            refused = [task.result() for task in burst if task.done()]
        for answer in refused:
            assert answer.status == 429
            assert answer.body["error"]["type"] == "concurrency_limit_error"
            assert int(answer.headers["Retry-After"]) >= 1
        assert [a.status for a in await asyncio.gather(*others)] == [200, 200]
        statuses = sorted([(await task).status for task in burst])
        assert statuses == [200] * 2 + [429] * 6
        assert gate.in_flight(capped_tenant.id) == 0
        assert (await complete(client, proxy, capped)).status == 200  # the cap was given back


@pytest.mark.database  # the shares, kept in the registry
async def test_share_settings_survive_a_restart_and_hold_after_it(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with fair_proxy(server, tmp_path) as proxy:
        async with client.post(
            proxy.url + "/admin/tenants", json={"name": "acme", "weight": 2.5}, headers=admin
        ) as response:
            assert response.status == 201, await response.text()
            created = await response.json()
        tenant_id, key = created["tenant"]["id"], created["api_key"]
        share = {"max_queued": 5, "max_concurrent": 1, "max_priority": "batch"}
        async with client.patch(
            f"{proxy.url}/admin/tenants/{tenant_id}", json=share, headers=admin
        ) as response:
            assert response.status == 200, await response.text()
        async with client.patch(
            f"{proxy.url}/admin/tenants/{tenant_id}", json={"weight": 0}, headers=admin
        ) as response:
            assert response.status == 400
    # a new proxy process on the same registry file
    async with fair_proxy(server, tmp_path) as proxy:
        async with client.get(f"{proxy.url}/admin/tenants/{tenant_id}", headers=admin) as response:
            shown = await response.json()
        assert (shown["weight"], shown["max_queued"], shown["max_concurrent"]) == (2.5, 5, 1)
        assert shown["max_priority"] == "batch"
        with stopped(server):
            first = asyncio.ensure_future(complete(client, proxy, key))
            await until(lambda: proxy.app[CACHE].gate.in_flight(tenant_id) == 1, "the first")
            second = await complete(client, proxy, key)
        assert second.status == 429 and second.body["error"]["type"] == "concurrency_limit_error"
        assert (await first).status == 200


async def flood_beside_a_recent_tenant(
    client: aiohttp.ClientSession, proxy: Proxy, heavy: tuple[Tenant, str], light: str
) -> list[asyncio.Task[Answer]]:
    """The light tenant's request ends; then, the server stopped, the heavy tenant sends six
    requests to its four slots: three run, three wait in the proxy (queued, not refused), one
    slot stays free."""
    assert (await complete(client, proxy, light)).status == 200
    os.kill(proxy.server.process.pid, signal.SIGSTOP)
    tenant, key = heavy
    flood = [asyncio.ensure_future(complete(client, proxy, key)) for _ in range(6)]
    gate = proxy.app[CACHE].gate
    await until(lambda: gate.in_flight(tenant.id) == 6 and proxy.queued == 3, "the flood")
    assert busy_slots(proxy) == 3
    assert not any(task.done() for task in flood)
    return flood


async def test_a_flooding_tenant_leaves_a_slot_to_a_tenant_active_within_the_window(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=4)
    async with fair_proxy(server, tmp_path, share_window_s=60) as proxy:
        heavy = await proxy.create("heavy")
        light_tenant, light = await proxy.create("light")
        try:
            flood = await flood_beside_a_recent_tenant(client, proxy, heavy, light)
            await asyncio.sleep(0.5)  # released nothing, nothing more is taken
            assert busy_slots(proxy) == 3 and proxy.queued == 3
            # the light tenant's next request finds the slot kept for it: no wait for the flood
            second = asyncio.ensure_future(complete(client, proxy, light))
            await until(lambda: busy_slots(proxy) == 4, "the light request to get the slot")
            assert proxy.queued == 3
            assert proxy.app[CACHE].gate.in_flight(light_tenant.id) == 1
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert (await second).status == 200
        assert [answer.status for answer in await asyncio.gather(*flood)] == [200] * 6


async def test_a_flooding_tenant_gets_every_slot_once_the_others_are_quiet(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=4)
    # the window is long enough for any machine to set the flood up inside it; the scheduler's
    # clock is then moved on to just before its end, so the test does not wait it out
    async with fair_proxy(server, tmp_path, share_window_s=60) as proxy:
        scheduler = proxy.app[CACHE].scheduler
        clock = MovedClock()
        scheduler.clock = clock
        heavy = await proxy.create("heavy")
        _, light = await proxy.create("light")
        try:
            flood = await flood_beside_a_recent_tenant(client, proxy, heavy, light)
            clock.ahead_s = 59.5
            # plan again on the moved clock: the timer it arms for the window's end, alone
            # (nothing ends: the server is stopped), hands over the slot
            scheduler.upstream_changed()
            await until(lambda: busy_slots(proxy) == 4, "the flood to take the last slot")
            assert proxy.queued == 2
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert [answer.status for answer in await asyncio.gather(*flood)] == [200] * 6
