"""What relaying streams costs a front process in CPU: per stream and per token it carried.

Clients stream in a closed loop through one process (the proxy, or the bare pass-through), and
the process's own user + system CPU time (Linux /proc) over the run is divided by the streams and
the tokens relayed, so other load on the machine changes the rate but not the cost per token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp

from cacheproxy.bench.harness import (
    STREAM_HEADERS,
    fail_on_bad_status,
    process_cpu_s,
    table_row,
)


@dataclass(frozen=True)
class StreamCpu:
    """CPU a process spent relaying `requests` streams of `tokens` tokens in all."""

    requests: int
    tokens: int
    cpu_s: float

    @property
    def us_per_request(self) -> float:
        return 1e6 * self.cpu_s / max(self.requests, 1)

    @property
    def us_per_token(self) -> float:
        return 1e6 * self.cpu_s / max(self.tokens, 1)


async def streamed_tokens(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    """One native stream read to its end; the tokens it carried (every event but the last)."""
    async with session.post(url, data=body, headers=STREAM_HEADERS) as response:
        await fail_on_bad_status(response)
        events = (await response.read()).count(b"data: ")
    return max(events - 1, 0)


async def stream_cpu(
    session: aiohttp.ClientSession, url: str, body: bytes, pid: int, duration: float, streams: int
) -> StreamCpu:
    """`streams` clients streaming `body` to `url` for `duration` s; the CPU process `pid` used."""
    await asyncio.gather(*(streamed_tokens(session, url, body) for _ in range(streams)))  # warm
    deadline, started_cpu = time.perf_counter() + duration, process_cpu_s(pid)
    counts = [0, 0]  # streams, tokens

    async def client() -> None:
        while time.perf_counter() < deadline:
            tokens = await streamed_tokens(session, url, body)
            counts[0] += 1
            counts[1] += tokens

    await asyncio.gather(*(client() for _ in range(streams)))
    return StreamCpu(counts[0], counts[1], process_cpu_s(pid) - started_cpu)


def stream_cpu_rows(runs: dict[str, StreamCpu]) -> Iterator[str]:
    yield table_row(["arm", "streams", "tokens", "CPU s", "CPU us/stream", "CPU us/token"])
    yield table_row(["---", "---:", "---:", "---:", "---:", "---:"])
    for name, run in runs.items():
        yield table_row(
            [
                name,
                str(run.requests),
                str(run.tokens),
                f"{run.cpu_s:.2f}",
                f"{run.us_per_request:.0f}",
                f"{run.us_per_token:.1f}",
            ]
        )
