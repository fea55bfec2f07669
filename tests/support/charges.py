"""What a tenant is charged, read as an operator reads it (the ledger through the admin API),
and clients that leave before their answer ended."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.support.fair_share import ADMIN_KEY
from tests.support.servers import LlamaServer
from tests.support.upstream_slots import SLOTS_POLL_S, slots


async def ledger_row(client: aiohttp.ClientSession, proxy_url: str, tenant_id: str) -> dict:
    """The tenant's one row of the usage ledger (all its hours together)."""
    async with client.get(
        proxy_url + "/admin/usage",
        params={"tenant": tenant_id, "group_by": "tenant"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ) as response:
        document = await response.json()
        assert response.status == 200, document
    [row] = document["rows"]
    return row


async def prompt_tokens(
    client: aiohttp.ClientSession, server: LlamaServer, counter: str | None, body: dict
) -> int:
    """The body's prompt tokens, as llama-server itself counts them (`counter`: its route that
    counts them; None: a native body of ids, counted as they are)."""
    if counter is None:
        return len(body["prompt"])
    async with client.post(server.url + counter, json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["input_tokens"]


async def leave_once_running(
    client: aiohttp.ClientSession, server: LlamaServer, url: str, body: dict, key: str | None
) -> None:
    """Send `body` and close the connection once the server runs it: a stream as its head
    arrives (llama-server sends it as the task starts), a whole answer once the server shows a
    slot processing (read no more often than its own check for closed connections allows)."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    if body.get("stream"):
        response = await client.post(url, json=body, headers=headers)
        assert response.status == 200, await response.text()
        response.close()  # gone before the first token
        return
    sent = asyncio.ensure_future(client.post(url, json=body, headers=headers))
    deadline = time.monotonic() + 60
    while not any(slot["is_processing"] for slot in await slots(client, server)):
        assert not sent.done(), "answered before it could be left"
        assert time.monotonic() < deadline, "the server never ran the request"
        await asyncio.sleep(SLOTS_POLL_S)
    sent.cancel()  # the connection closes with it, mid-request
    await asyncio.gather(sent, return_exceptions=True)


# llama-server looks for a closed connection once a second without any result: a test reading its
# slots more often than that would keep it from ever seeing a cut
LET_GO_POLL_S = 1.2


async def wait_until_let_go(
    client: aiohttp.ClientSession, server: LlamaServer, within_s: float = 60
) -> list[dict]:
    """The server's slots once none is processing, read no more often than its check for
    closed connections allows."""
    deadline = time.monotonic() + within_s
    while True:
        report = await slots(client, server)
        if not any(slot["is_processing"] for slot in report):
            return report
        assert time.monotonic() < deadline, f"a slot still processing after {within_s} s"
        await asyncio.sleep(LET_GO_POLL_S)


def last_task_slot(report: list[dict]) -> dict:
    """The slot of the task the server launched last (task ids only grow)."""
    return max((slot for slot in report if "id_task" in slot), key=lambda slot: slot["id_task"])
