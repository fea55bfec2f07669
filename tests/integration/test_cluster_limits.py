"""One meter per tenant across two proxies on one shared database (a SQLite file, or PostgreSQL
under `--database postgresql`), in front of two real llama-servers: a tenant's requests and
prompt tokens per minute, daily and monthly budgets and `max_concurrent` hold whichever proxy
serves each request (hand-offs off, so each serves what it receives: the case the limits must
survive), and the hand-off header counts only when another proxy of the cluster signed it.

Counts of answers served and refused are asserted, never times; each figure is printed for the
closing table of what a tenant gets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.cluster.handoff import HANDOFF_HEADER, handoff_proof
from cacheproxy.tenancy.ledger import LedgerStore
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support import databases
from tests.support.cluster import (
    ADMIN,
    RENEWAL_S,
    TTL_S,
    Cluster,
    metric_values,
    two_proxies,
)
from tests.support.servers import StartServer

pytestmark = pytest.mark.database

SERVE_WHERE_RECEIVED = {"CACHEPROXY_CLUSTER__HANDOFF": "false"}
FLUSH_OFTEN = {"CACHEPROXY_USAGE__FLUSH_INTERVAL_S": "0.2"}
SECRET = "cluster-secret-of-the-limit-tests"
# 20 prompt ids and 4 generated tokens: 24 tokens of a budget per request
BODY = {"prompt": list(range(10, 30)), "n_predict": 4, "ignore_eos": True, "temperature": 0}
PER_REQUEST = 24
PROMPT_TOKENS = 20


async def post(
    client: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict = BODY
) -> tuple[int, Any, Any]:
    async with client.post(url + "/completion", json=body, headers=headers) as response:
        return response.status, response.headers, await response.json()


async def set_limits(client: aiohttp.ClientSession, cluster: Cluster, **limits: Any) -> None:
    """Through one proxy's admin API; until the other proxy reads them too."""

    def read(document: Any) -> bool:
        effective = document["effective"]
        return all(effective[name] == value for name, value in limits.items())

    await patched(client, cluster, f"/admin/tenants/{cluster.tenant_id}/limits", limits, read)


async def set_cap(client: aiohttp.ClientSession, cluster: Cluster, max_concurrent: int) -> None:
    """The tenant's `max_concurrent`, through one proxy; until the other proxy reads it too."""
    path, body = f"/admin/tenants/{cluster.tenant_id}", {"max_concurrent": max_concurrent}
    await patched(client, cluster, path, body, lambda tenant: tenant == {**tenant, **body})


async def patched(
    client: aiohttp.ClientSession,
    cluster: Cluster,
    path: str,
    body: dict[str, Any],
    read: Callable[[Any], bool],
) -> None:
    """`body` patched at `path` through one proxy; until `read` holds of the other's GET."""
    first, second = (proxy.url for proxy in cluster.proxies)
    async with client.patch(first + path, json=body, headers=ADMIN) as response:
        assert response.status == 200, await response.text()
    deadline = time.monotonic() + 10
    while True:
        async with client.get(second + path, headers=ADMIN) as response:
            document = await response.json()
        if read(document):
            return
        assert time.monotonic() < deadline, document
        await asyncio.sleep(0.1)


def assert_refused(status: int, headers: Any, document: Any, limit_type: str) -> None:
    assert status == 429, document
    assert document["error"]["type"] == limit_type, document
    assert int(headers["Retry-After"]) >= 1


async def burst(
    client: aiohttp.ClientSession, cluster: Cluster, count: int
) -> list[tuple[int, Any, Any]]:
    """`count` requests at once, half through each proxy: each is admitted or refused as it
    arrives, however long the ones admitted then take to serve (a rate's refill during the
    burst, 15 s a request at the most, is not what is measured)."""
    urls = [cluster.proxies[index % 2].url for index in range(count)]
    return list(await asyncio.gather(*(post(client, url, cluster.headers) for url in urls)))


async def test_requests_per_minute_hold_across_two_proxies(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with (
        two_proxies(start_server, tmp_path, SERVE_WHERE_RECEIVED) as cluster,
        aiohttp.ClientSession() as client,
    ):
        await set_limits(client, cluster, requests_per_minute=4)
        answers = await burst(client, cluster, 8)
        served = [status for status, *_ in answers if status == 200]
        print(f"requests_per_minute = 4 through two proxies: {len(served)} of 8 served")
        assert len(served) == 4, [status for status, *_ in answers]
        for status, headers, document in answers:
            if status != 200:
                assert_refused(status, headers, document, "requests_per_minute")
                # one request comes back every 15 s
                assert int(headers["Retry-After"]) <= 15
                assert headers["x-ratelimit-remaining-requests"] == "0"


async def test_prompt_tokens_per_minute_hold_across_two_proxies(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with (
        two_proxies(start_server, tmp_path, SERVE_WHERE_RECEIVED) as cluster,
        aiohttp.ClientSession() as client,
    ):
        # two prompts' worth a minute: a third prompt's tokens come back after 30 s
        await set_limits(client, cluster, prompt_tokens_per_minute=2 * PROMPT_TOKENS)
        answers = await burst(client, cluster, 6)
        served = [status for status, *_ in answers if status == 200]
        print(
            f"prompt_tokens_per_minute = {2 * PROMPT_TOKENS} through two proxies:"
            f" {len(served)} of 6 served"
        )
        # never past the limit; a burst may get one fewer (a token of the rate one proxy took at
        # admission and could not use is given back at its next round)
        assert 1 <= len(served) <= 2, [status for status, *_ in answers]
        for status, headers, document in answers:
            if status != 200:
                assert_refused(status, headers, document, "prompt_tokens_per_minute")


@pytest.mark.parametrize("budget", ["tokens_per_day", "tokens_per_month"])
async def test_budgets_hold_across_two_proxies(
    start_server: StartServer, tmp_path: Path, budget: str
) -> None:
    env = {**SERVE_WHERE_RECEIVED, **FLUSH_OFTEN}
    async with (
        two_proxies(start_server, tmp_path, env) as cluster,
        aiohttp.ClientSession() as client,
    ):
        await set_limits(client, cluster, **{budget: 300})
        served, refused = await until_both_refuse(client, cluster, f"budget_{budget}")
        await cluster.stop_gracefully()  # each writes its last ledger batch
    with LedgerStore(databases.chosen(cluster.state / "usage.db")) as ledger:
        rows = ledger.rows(cluster.tenant_id)
    used = sum(row["prompt_tokens"] + row["generated_tokens"] for row in rows)
    print(f"{budget} = 300 through two proxies: {served} served, {used} tokens used")
    assert used == served * PER_REQUEST
    # admitted while the budget is not spent: at most the last request of each proxy beyond
    assert 300 <= used <= 300 + 2 * PER_REQUEST, (used, refused)


async def until_both_refuse(
    client: aiohttp.ClientSession, cluster: Cluster, limit_type: str
) -> tuple[int, int]:
    """Requests through each proxy in turn until both refuse, and refuse again once every
    allowance was given back (a few renewal periods later); (served, refused)."""
    served = refused = 0
    settled = False
    for _ in range(60):
        statuses = []
        for proxy in cluster.proxies:
            status, headers, document = await post(client, proxy.url, cluster.headers)
            statuses.append(status)
            if status == 200:
                served += 1
            else:
                assert_refused(status, headers, document, limit_type)
                refused += 1
        if statuses == [429, 429]:
            if settled:
                return served, refused
            await asyncio.sleep(3 * RENEWAL_S)  # what either proxy held unspent goes back
            settled = True
        else:
            settled = False
    raise AssertionError(f"never refused: {served} served")


async def test_max_concurrent_holds_across_two_proxies_and_a_dead_proxys_place_expires(
    start_server: StartServer, tmp_path: Path
) -> None:
    async with (
        two_proxies(start_server, tmp_path, SERVE_WHERE_RECEIVED) as cluster,
        aiohttp.ClientSession() as client,
    ):
        with TenantRegistry(cluster.registry) as registry:
            registry.update(cluster.tenant_id, max_concurrent=1)
        first, second = cluster.proxies
        await serves_eventually(client, second.url, cluster.headers, 10.0)  # the cap is read
        async with streaming(client, first.url, cluster.headers):
            # one request runs on the first proxy: the second refuses the tenant's next
            status, headers, document = await post(client, second.url, cluster.headers)
            assert_refused(status, headers, document, "concurrency_limit_error")
            print(f"max_concurrent = 1 through two proxies: second request answered {status}")
            # another tenant is not held to it
            other = {"Authorization": f"Bearer {cluster.other_key}"}
            assert (await post(client, second.url, other))[0] == 200
        # the stream ended: its place is given back, and the second proxy serves
        await serves_eventually(client, second.url, cluster.headers, 10.0)
        # a proxy killed while it holds the tenant's place: the place expires with it
        async with streaming(client, second.url, cluster.headers):
            second.process.kill()
            await second.process.wait()
        killed_at = time.monotonic()
        # its place is still held in the shared count, until it expires: within the lease ttl
        # of the kill (renewed, at the latest, just before it)
        held = databases.query(
            cluster.registry,
            "SELECT proxy_id, held, expires_at FROM shared_limit_holdings"
            " WHERE name = 'max_concurrent'",
        )
        assert [(proxy, amount) for proxy, amount, _ in held] == [(second.url, 1.0)]
        assert held[0][2] <= time.time() + TTL_S
        # a hang guard: the request is served as soon as the place has expired
        await serves_eventually(client, first.url, cluster.headers, 120.0)
        print(f"a dead proxy's place expired: served {time.monotonic() - killed_at:.1f} s later")


async def test_a_split_requests_tasks_count_toward_max_concurrent_across_two_proxies(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A batch of three prompts is three requests in progress: beside one running on the other
    proxy, past a cap of three (refused whole, before anything runs); two prompts fit."""
    async with (
        two_proxies(start_server, tmp_path, SERVE_WHERE_RECEIVED) as cluster,
        aiohttp.ClientSession() as client,
    ):
        await set_cap(client, cluster, 3)
        first, second = cluster.proxies
        async with streaming(client, first.url, cluster.headers):
            three = {**BODY, "prompt": [list(range(start, start + 20)) for start in (10, 40, 70)]}
            status, headers, document = await post(client, second.url, cluster.headers, three)
            assert_refused(status, headers, document, "concurrency_limit_error")
            assert "on other proxies" in document["error"]["message"], document
            print(f"3 prompts beside a request on the other proxy, max_concurrent = 3: {status}")
            two = {**BODY, "prompt": three["prompt"][:2]}
            status, _, document = await post(client, second.url, cluster.headers, two)
            assert status == 200, document


@contextlib.asynccontextmanager
async def streaming(
    client: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> AsyncIterator[None]:
    """A long streamed completion, running (its first event read) while the body runs."""
    body = {**BODY, "n_predict": 8000, "stream": True}
    async with client.post(url + "/completion", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: "):
                break
        yield
        response.close()


async def serves_eventually(
    client: aiohttp.ClientSession, url: str, headers: dict[str, str], within_s: float
) -> None:
    deadline = time.monotonic() + within_s
    while True:
        with contextlib.suppress(aiohttp.ClientConnectionError):
            status, _, document = await post(client, url, headers)
            if status == 200:
                return
        assert time.monotonic() < deadline, document
        await asyncio.sleep(0.2)


async def test_a_forged_or_stale_handoff_header_gains_nothing_and_a_signed_one_is_served(
    start_server: StartServer, tmp_path: Path
) -> None:
    env = {"CACHEPROXY_CLUSTER__SECRET": SECRET}
    async with (
        two_proxies(start_server, tmp_path, env) as cluster,
        aiohttp.ClientSession() as client,
    ):
        await set_limits(client, cluster, requests_per_minute=1000)

        async def handoffs() -> tuple[float, float]:
            sent = invalid = 0.0
            for proxy in cluster.proxies:
                values = await metric_values(client, proxy.url)
                sent += values.get('cacheproxy_handoffs_total{outcome="sent"}', 0.0)
                invalid += values.get('cacheproxy_handoffs_total{outcome="invalid"}', 0.0)
            return sent, invalid

        async def through_both(header: str | Callable[[], str] | None) -> tuple[float, float]:
            """The same request through each proxy: (hand-offs sent, invalid headers seen).
            `header` made anew for each request when it is a function."""
            before = await handoffs()
            for proxy in cluster.proxies:
                headers = dict(cluster.headers)
                if header is not None:
                    headers[HANDOFF_HEADER] = header if isinstance(header, str) else header()
                status, answer_headers, document = await post(client, proxy.url, headers)
                assert status == 200, document
                # the owner's answer, with the tenant's rate-limit headers
                assert answer_headers["x-ratelimit-limit-requests"] == "1000"
            after = await handoffs()
            return after[0] - before[0], after[1] - before[1]

        # no header: the proxy that does not own the conversation hands it to the one that does
        assert await through_both(None) == (1, 0)
        # a client's own header is taken off and counts for nothing: the same hand-off
        assert await through_both("anything") == (1, 2)
        signed = handoff_proof(
            SECRET.encode(), "POST", "/completion", cluster.tenant_id, "proxy-x", time.time()
        )
        version, stamp, _, sender = signed.split(".", 3)
        altered = ".".join((version, stamp, "0" * 64, sender))
        assert await through_both(altered) == (1, 2)
        stale = handoff_proof(
            SECRET.encode(), "POST", "/completion", cluster.tenant_id, "proxy-x", time.time() - 60
        )
        assert await through_both(stale) == (1, 2)
        other_tenant = handoff_proof(
            SECRET.encode(), "POST", "/completion", "t_0000000000000000", "proxy-x", time.time()
        )
        assert await through_both(other_tenant) == (1, 2)

        # signed with the cluster's secret, for this request, now: served where it arrived
        # (made as each is sent: a request served slowly must not age the next one's proof)
        def fresh() -> str:
            return handoff_proof(
                SECRET.encode(), "POST", "/completion", cluster.tenant_id, "proxy-x", time.time()
            )

        assert await through_both(fresh) == (0, 0)
        print("forged, altered, stale or another tenant's hand-off header: handed on as if absent")
