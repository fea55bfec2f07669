"""A group's shared prefix computed once on a real llama-server (-np 4): requests that share a
prompt being computed on one slot wait for it rather than compute it again on an idle slot.

The server runs one thread and computes prompts in batches of 256 tokens, reporting its progress
after each (`return_progress`): the group's next requests are sent once half the prefix is
computed, whatever the machine's speed, so that waiting for the rest (and for the one request
ahead in the wait) plainly costs less than computing it all again. (Sent as the prefix starts,
waiting costs its whole prefill and a little more: computing it again is then the better
choice, and which is made would follow the machine's speed.) The warm-up requests are long
prompts with short answers: the mean request time is then mostly prompt, much longer than
what a request holds its slot once its prompt is computed; a router that priced a wait by the
mean request time would compute the prefix again on an idle slot."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import load_settings
from tests.support.servers import StartServer, serving
from tests.support.waiting import WITHIN_S
from tests.support.waiting import wait_for as until

# one thread, prompts computed (and their progress reported) 256 tokens at a time
SERVER_ARGS = (
    "--threads",
    "1",
    "--threads-batch",
    "1",
    "--batch-size",
    "256",
    "--ubatch-size",
    "256",
)
PREFIX_TOKENS = 2048
QUESTION_TOKENS = 16

_rng = random.Random(1313)


def ids(n: int) -> list[int]:
    return [_rng.randrange(300, 31000) for _ in range(n)]


@asynccontextmanager
async def proxy_for(url: str, tmp_path: Path) -> AsyncIterator[tuple[str, web.Application]]:
    settings = load_settings(upstreams=[url], state_dir=tmp_path / "state")
    async with serving(settings) as served:
        yield served


async def timings(
    http: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    half_computed: asyncio.Event | None = None,
) -> dict:
    """The final timings of a streamed /completion (its first event ends its prompt for the
    scheduler); `half_computed` is set once the server reports half the prompt computed."""
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "stream": True}
    if half_computed is not None:
        body["return_progress"] = True
    final: dict = {}
    async with http.post(url + "/completion", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                event = orjson.loads(line[6:])
                final = event.get("timings", final)
                progress = event.get("prompt_progress")
                if half_computed is not None and progress is not None:
                    if 2 * progress["processed"] >= progress["total"]:
                        half_computed.set()
    return final


def busy(app: web.Application) -> int:
    return sum(slot.busy for slot in app[CACHE].scheduler.tables[0].slots)


async def test_requests_of_a_group_arriving_while_its_prefix_is_computed_reuse_it(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=4, extra_args=SERVER_ARGS)
    async with proxy_for(server.url, tmp_path) as (url, app):
        # the prefill rate and the request times, measured: long prompts, short answers
        for _ in range(2):
            await timings(client, url, ids(1800))
        prefix, half_computed = ids(PREFIX_TOKENS), asyncio.Event()
        first = asyncio.ensure_future(
            timings(client, url, prefix + ids(QUESTION_TOKENS), half_computed)
        )
        await until(lambda: busy(app) == 1, "the group's first request on its slot")
        # woken as the event arrives, not polled: the rest of the prefix is still to compute
        await asyncio.wait_for(half_computed.wait(), WITHIN_S)
        assert not first.done()
        # two more of the group while the rest of its prefix is computed, with idle slots free
        others = [
            asyncio.ensure_future(timings(client, url, prefix + ids(QUESTION_TOKENS)))
            for _ in range(2)
        ]
        answers = [await first, *await asyncio.gather(*others)]
    # the first computed the prefix; the two others reused it
    assert answers[0]["prompt_n"] >= PREFIX_TOKENS
    for answer in answers[1:]:
        assert answer["cache_n"] >= PREFIX_TOKENS, answers
    computed = sum(answer["prompt_n"] for answer in answers)
    assert computed <= PREFIX_TOKENS + 3 * QUESTION_TOKENS + 2, answers
