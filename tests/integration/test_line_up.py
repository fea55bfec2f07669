"""A request lined up at the server behind its tenant's running request (slots/line_up.py), on a
real llama-server with one slot and no RAM cache: it waits there (the server shows it deferred),
starts as the running one ends, answers what llama-server answers it alone, and its prediction
holds; cut while it waits, or cut while running with one behind it, each is charged what the
server computed, and the slot's next request is still predicted right; another tenant's request
is never lined up.

Real processes: a llama-server, the proxy in this process on a real socket, its tenants."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.support.charges import ledger_row
from tests.support.fair_share import Proxy, busy_slots, fair_proxy
from tests.support.metrics import sample
from tests.support.servers import LlamaServer, StartServer
from tests.support.waiting import wait_for as until

ONE_THREAD = ("--threads", "1", "--threads-batch", "1")
LONG = 4000  # tokens the running request generates: it runs for seconds on one thread

_rng = random.Random(3737)
PROMPT = [_rng.randrange(300, 31000) for _ in range(300)]


def body(n_predict: int, stream: bool = False) -> dict:
    return {
        "prompt": PROMPT,
        "n_predict": n_predict,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


# the server's own counts of prompt tokens it computed, and of those it reused
COUNTERS = ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total")


async def counter(client: aiohttp.ClientSession, server: LlamaServer, name: str) -> float:
    """One of the server's own samples."""
    async with client.get(server.url + "/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in the server's metrics")


@dataclass(frozen=True)
class Counts:
    computed: float
    reused: float

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.computed - other.computed, self.reused - other.reused)

    def as_tuple(self) -> tuple[float, float]:
        return self.computed, self.reused


async def server_counts(client: aiohttp.ClientSession, server: LlamaServer) -> Counts:
    """The prompt tokens the server computed and reused so far, by its own counters."""
    return Counts(*[await counter(client, server, name) for name in COUNTERS])


async def deferred(client: aiohttp.ClientSession, server: LlamaServer) -> float:
    """Requests the server holds deferred (its own gauge)."""
    return await counter(client, server, "llamacpp:requests_deferred")


async def deferred_there(client: aiohttp.ClientSession, server: LlamaServer) -> None:
    """Until the server holds one request deferred: the proxy counts a request lined up as it
    sends it, and a read of the server's gauge may reach the server before the request does."""

    async def one_deferred() -> bool:
        return await deferred(client, server) == 1

    await until(one_deferred, "the request deferred at the server")


async def start_running(
    client: aiohttp.ClientSession, proxy: Proxy, key: str
) -> tuple[aiohttp.ClientResponse, asyncio.Future]:
    """A long stream through the proxy, read until its first token: the slot is busy with it."""
    headers = {"Authorization": f"Bearer {key}"}
    response = await client.post(proxy.url + "/completion", json=body(LONG, True), headers=headers)
    assert response.status == 200, await response.text()
    async for line in response.content:
        if line.startswith(b"data: "):
            break
    return response, asyncio.ensure_future(response.read())


async def running_and_lined_up(
    client: aiohttp.ClientSession, proxy: Proxy, key: str
) -> tuple[aiohttp.ClientResponse, asyncio.Future, asyncio.Future]:
    """A long stream running on the one slot (its response, and the rest of it being read), and
    a request of the same tenant lined up behind it (its answer, pending)."""
    running, rest = await start_running(client, proxy, key)
    headers = {"Authorization": f"Bearer {key}"}
    behind = asyncio.ensure_future(
        client.post(proxy.url + "/completion", json=body(8), headers=headers)
    )
    await until(
        lambda: sample(proxy.app, "cacheproxy_requests_lined_up_total") == 1,
        "the request to be lined up",
    )
    return running, rest, behind


async def test_a_request_lined_up_waits_at_the_server_and_answers_as_alone(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1, extra_args=ONE_THREAD)
    async with client.post(server.url + "/completion", json=body(8)) as response:
        alone = (await response.json())["content"]
    async with fair_proxy(server, tmp_path) as proxy:
        tenant, key = await proxy.create("liner")
        running, rest, behind = await running_and_lined_up(client, proxy, key)
        # at the server, deferred behind the running stream: waiting there, not in the proxy
        assert proxy.queued == 1  # a request waiting for a slot, as the bounds count it
        await deferred_there(client, server)
        assert not behind.done()
        await rest
        running.release()
        answer = await behind
        assert answer.status == 200
        assert (await answer.json())["content"] == alone
        await until(lambda: busy_slots(proxy) == 0, "the slot to be given back")
        # both predicted right: the lined-up one reused the running prompt, to its last token
        assert sample(proxy.app, "cacheproxy_predictions_total", result="match") == 2
        assert sample(proxy.app, "cacheproxy_predictions_total", result="mismatch") == 0
        row = await ledger_row(client, proxy.url, tenant.id)
        assert row["prompt_tokens"] == 2 * len(PROMPT)
        assert row["reused_tokens"] == len(PROMPT) - 1


async def test_a_lined_up_request_cut_while_it_waits_is_charged_what_the_server_computed(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Its client leaves while the server holds it deferred. The server drops it, or (it looks
    for a closed connection only after a second without any result, and the running stream
    sends results all along) starts it as the running one ends and stops at its first token.
    Either way the proxy charges what the server computed, read from the slot once the server
    let go, and knows what the slot holds."""
    server = start_server(parallel=1, extra_args=ONE_THREAD)
    async with fair_proxy(server, tmp_path) as proxy:
        tenant, key = await proxy.create("leaver")
        headers = {"Authorization": f"Bearer {key}"}
        before = await server_counts(client, server)
        running, rest, behind = await running_and_lined_up(client, proxy, key)
        behind.cancel()  # its client leaves while the server holds it deferred
        await asyncio.gather(behind, return_exceptions=True)
        await rest
        running.release()
        await until(lambda: busy_slots(proxy) == 0, "both to be settled")
        row = await ledger_row(client, proxy.url, tenant.id)
        after = await server_counts(client, server)
        assert (row["computed_tokens"], row["reused_tokens"]) == (after - before).as_tuple()
        assert row["prompt_tokens"] in (len(PROMPT), 2 * len(PROMPT))  # dropped, or ran
        # the table still knows what the slot holds: the next request is predicted right
        async with client.post(
            proxy.url + "/completion", json=body(4), headers=headers
        ) as response:
            assert response.status == 200
        assert sample(proxy.app, "cacheproxy_predictions_total", result="mismatch") == 0
        assert sample(proxy.app, "cacheproxy_predictions_total", result="match") == 2


async def test_a_running_request_cut_with_one_behind_it_is_charged_its_prompt(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """The running stream's client leaves: the server stops it and starts the request lined up
    behind it at once, so its slot cannot be read for the cut one, which is charged its prompt
    (computed before its first token); the one behind answers as alone."""
    server = start_server(parallel=1, extra_args=ONE_THREAD)
    async with client.post(server.url + "/completion", json=body(8)) as response:
        alone = (await response.json())["content"]
    async with fair_proxy(server, tmp_path) as proxy:
        tenant, key = await proxy.create("cutter")
        before = await server_counts(client, server)
        running, rest, behind = await running_and_lined_up(client, proxy, key)
        rest.cancel()
        running.close()  # gone mid-stream
        answer = await behind
        assert answer.status == 200
        assert (await answer.json())["content"] == alone
        await until(lambda: busy_slots(proxy) == 0, "both to be settled")
        row = await ledger_row(client, proxy.url, tenant.id)
        assert row["prompt_tokens"] == 2 * len(PROMPT)
        after = await server_counts(client, server)
        assert (row["computed_tokens"], row["reused_tokens"]) == (after - before).as_tuple()


async def test_another_tenants_request_waits_in_the_proxy(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1, extra_args=ONE_THREAD)
    async with fair_proxy(server, tmp_path) as proxy:
        _, key = await proxy.create("first")
        _, other = await proxy.create("second")
        running, rest = await start_running(client, proxy, key)
        waiting = asyncio.ensure_future(
            client.post(
                proxy.url + "/completion",
                json=body(8),
                headers={"Authorization": f"Bearer {other}"},
            )
        )
        await until(lambda: proxy.queued == 1, "the other tenant's request to queue")
        assert await deferred(client, server) == 0  # nothing of it at the server
        assert sample(proxy.app, "cacheproxy_requests_lined_up_total") == 0
        await rest
        running.release()
        answer = await waiting
        assert answer.status == 200
        assert sample(proxy.app, "cacheproxy_requests_lined_up_total") == 0


# a fresh prompt under the running one's first 250 tokens: what it adds (39 tokens it may reuse
# beyond them) is less than any archive's first block, so no restore is looked for
FRESH = [*PROMPT[:250], *(_rng.randrange(300, 31000) for _ in range(40))]


@pytest.mark.parametrize("min_tokens", [8192, 256])
async def test_a_fresh_prompt_is_lined_up_where_the_disk_tier_would_archive_nothing(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, min_tokens: int
) -> None:
    """A fresh prompt of the tenant, not keeping the running one, waits at the server when the
    disk tier would not archive what the running one leaves: at most 300 + 4,000 tokens, fewer
    than a `min_tokens` of 8,192. With 256 it would: the request waits in the proxy, and the
    slot is archived before it runs. Either way it answers what llama-server answers it alone."""
    server = start_server(parallel=1, extra_args=ONE_THREAD)
    fresh = {"prompt": FRESH, "n_predict": 8, "temperature": 0}
    async with client.post(server.url + "/completion", json=fresh) as response:
        alone = (await response.json())["content"]
    # nobody's text left in the slot: a request on it may be followed (line_up.py)
    async with client.post(server.url + "/slots/0?action=erase") as response:
        assert response.status == 200
    # every slot worth keeping saved, whatever the cost model says: the save is certain
    disk = {"directory": server.slot_save_path, "min_tokens": min_tokens, "always_save": True}
    async with fair_proxy(server, tmp_path, disk=disk) as proxy:
        _, key = await proxy.create("fresh")
        running, rest = await start_running(client, proxy, key)
        headers = {"Authorization": f"Bearer {key}"}
        behind = asyncio.ensure_future(
            client.post(proxy.url + "/completion", json=fresh, headers=headers)
        )
        lined_up = min_tokens == 8192
        if lined_up:
            await until(
                lambda: sample(proxy.app, "cacheproxy_requests_lined_up_total") == 1,
                "the fresh request to be lined up",
            )
            assert proxy.queued == 1  # waiting for the slot, at the server
            await deferred_there(client, server)
        else:
            await until(lambda: proxy.queued == 1, "the fresh request to queue in the proxy")
            assert await deferred(client, server) == 0
        await rest
        running.release()
        answer = await behind
        assert answer.status == 200
        document = await answer.json()
        assert document["content"] == alone
        assert document["timings"]["cache_n"] == 250  # the head it shares with the running one
        await until(lambda: busy_slots(proxy) == 0, "the slot to be given back")
        assert sample(proxy.app, "cacheproxy_requests_lined_up_total") == int(lined_up)
        assert sample(proxy.app, "cacheproxy_predictions_total", result="mismatch") == 0
        assert sample(proxy.app, "cacheproxy_predictions_total", result="match") == 2
        # what the running one left was archived only where it was not lined up
        saved = sample(proxy.app, "cacheproxy_archive_saves_total", outcome="saved")
        assert saved == (0 if lined_up else 1)
