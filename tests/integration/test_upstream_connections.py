"""The proxy keeps no more connections open to a llama-server than the server has HTTP threads
that stay (upstreams/connection_pool.py): llama-server serves each connection on one thread
while it is open, and a connection that finds none of those free may wait until a kept-alive
one ends.

Real processes: a llama-server with two slots, the proxy in this process on a real socket; the
connections are counted where the kernel keeps them (/proc/net/tcp)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import aiohttp
from yarl import URL

from cacheproxy.http.app_keys import UPSTREAM_CONNECTIONS
from cacheproxy.settings import load_settings
from cacheproxy.upstreams.client import KEPT_BEYOND_SLOTS
from tests.support.servers import StartServer, serving
from tests.support.waiting import wait_for as until

SLOTS = 2
# llama-server's HTTP threads that stay: max(slots + 4, cores - 1), at least slots + 4
SERVER_THREADS_AT_LEAST = SLOTS + 4
CLIENTS = 12
ESTABLISHED = "01"


def connections_to(port: int) -> int:
    """Established TCP connections of this process (where the proxy runs) whose far end is
    `port`: its side of every connection it holds to the server listening there."""
    own = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                own.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == ESTABLISHED and fields[9] in own:
                count += 1
    return count


async def test_a_burst_of_requests_leaves_at_most_slots_plus_two_connections_open(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Twelve chats at once: each is templated and tokenized by the server before it waits for
    one of the two slots, so the proxy needs a dozen connections at once; once answered, it
    keeps slots + 2 of them (without the bound, all twelve stay open for seconds, every one
    holding one of the server's six threads or more)."""
    server = start_server(parallel=SLOTS)
    port = int(server.url.rsplit(":", 1)[1])
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:

        async def chat(number: int) -> int:
            body = {
                "messages": [{"role": "user", "content": f"question {number}: " + "word " * 40}],
                "max_tokens": 4,
                "temperature": 0,
            }
            async with client.post(url + "/v1/chat/completions", json=body) as answer:
                await answer.read()
                return answer.status

        assert await asyncio.gather(*(chat(n) for n in range(CLIENTS))) == [200] * CLIENTS
        kept = SLOTS + KEPT_BEYOND_SLOTS
        pool, upstream = app[UPSTREAM_CONNECTIONS], URL(server.url)
        # the proxy's own exchanges after an answer (a slot read, say) may still hold a few:
        # the bound is on what stays once every one has ended (one upstream: every idle one
        # is the server's)
        await until(lambda: pool.idle_count == pool.open_count(upstream), "every exchange to end")
        # those beyond are given up a moment after their answer (kept alive, they would stay
        # open for seconds)
        assert pool.held_open(upstream) <= kept
        await until(lambda: connections_to(port) <= kept + 1, "the closed ones to be gone")
        # the proxy's other client (its metrics scraper) may hold one more: the server still
        # has a thread that stays free for a new connection
        assert 0 < connections_to(port) < SERVER_THREADS_AT_LEAST
        # and the kept ones carry the next requests
        assert await asyncio.gather(*(chat(n) for n in range(SLOTS))) == [200] * SLOTS
