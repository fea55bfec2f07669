"""A request about to wait for a busy slot holding its head asks for its tenant's archive first,
against a real llama-server (-np 2, one thread) and a real archive.

Conversation C is archived when a sibling sharing its 600-token head takes its slot. A long
answer then runs on that slot, and C's next turn arrives: the busy slot holds its head, the
idle one a short text of another conversation. Priced without the archive, waiting for the head
(the running request's expected end, from the short answers so far) beats computing 900 tokens
beside it and overwriting the idle slot's text; with the archive restored into the idle slot,
nothing is left to wait for. The verdict is on what the proxy and the server did: which slot
served it, what the server reused, that the proxy planned a wait first, while the long answer
still ran.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson

from cacheproxy.http.app_keys import CACHE
from tests.support.completions import complete
from tests.support.disk_tier import conversation, disk_settings, next_turn
from tests.support.metrics import sample
from tests.support.servers import StartServer, serving
from tests.support.waiting import wait_for

ONE_THREAD = ("--threads", "1", "--threads-batch", "1")
HEAD = conversation(1)  # 600 tokens every conversation here starts with
WAITED = "cacheproxy_queue_wait_by_reason_seconds_total"
RESTORED = "cacheproxy_archive_restores_total"


async def long_answer(client: aiohttp.ClientSession, url: str, prompt: list[int]) -> int:
    """A streamed answer of 3,000 tokens (seconds on one thread); the slot it ran on."""
    body = {"prompt": prompt, "n_predict": 3000, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    slot = -1
    async with client.post(url + "/completion", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: "):
                slot = orjson.loads(line[6:]).get("id_slot", slot)
    return slot


async def test_a_request_restores_its_archive_into_an_idle_slot_rather_than_wait(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=8192, extra_args=ONE_THREAD)
    settings = disk_settings(server, tmp_path, disk={"always_save": True})
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        first = HEAD + conversation(2, 300)
        answer = await complete(client, url, first)
        # the other slot holds a short text of its own (an empty slot would be taken at once,
        # credited with the wait it spares: not the case in question here)
        other = await complete(client, url, conversation(6, 100))
        assert other["id_slot"] != answer["id_slot"]
        # a sibling with the same head takes C's slot (cheaper than the empty one): C is saved
        sibling = await complete(client, url, HEAD + conversation(3, 100))
        assert sibling["id_slot"] == answer["id_slot"]
        assert sample(app, "cacheproxy_archive_saves_total", outcome="saved") >= 1
        running = asyncio.ensure_future(long_answer(client, url, HEAD + conversation(4, 50)))
        slots = app[CACHE].scheduler.tables[0].slots
        await wait_for(lambda: slots[answer["id_slot"]].busy, "the long answer runs")

        again = await complete(client, url, next_turn(first, answer, 5))
        assert not running.done()  # it came back while the long answer ran
        assert again["id_slot"] != answer["id_slot"]  # the idle slot
        assert again["timings"]["cache_n"] >= len(first)  # C restored there, not recomputed
        assert sample(app, RESTORED, outcome="restored") == 1
        # it was planned to wait at first (the case in question), for its lookup only
        assert sample(app, WAITED, reason="busy_slot_chosen") > 0
        assert await running == answer["id_slot"]
