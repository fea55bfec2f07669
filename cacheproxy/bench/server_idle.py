"""llama-server's CPU while it has nothing to do, just after an answer.

Built with OpenMP (the pinned build is), llama-server's compute threads wait for their next step
by spinning on their CPUs, for libgomp's 300,000 rounds by default (milliseconds), before they
sleep: between requests too it keeps CPUs busy that a front on the same cores would use.
`OMP_WAIT_POLICY=passive` in its environment, or a single `--threads`, stops it (docs/drop-in.md).
The figure: the CPU its threads used in the `WINDOW_S` after an answer, nothing more asked of it
meanwhile, the median of `PROBES`; read to the nanosecond from the scheduler's run time of each
thread (`/proc/PID/stat` counts clock ticks of 10 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from pathlib import Path

import aiohttp

from cacheproxy.bench.harness import JSON_HEADERS, fail_on_bad_status

WINDOW_S = 0.05
PROBES = 10


def process_run_ns(pid: int) -> int:
    """Nanoseconds all the threads of process `pid` have run (`/proc/PID/task/*/schedstat`)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total


async def idle_cpu_ms(
    session: aiohttp.ClientSession, server_url: str, pid: int, completion: bytes
) -> float:
    """Milliseconds of CPU llama-server (process `pid`) used in the `WINDOW_S` after answering
    the `/completion` body `completion`, the median of `PROBES`."""
    samples = []
    for _ in range(PROBES):
        async with session.post(
            server_url + "/completion", data=completion, headers=JSON_HEADERS
        ) as response:
            await fail_on_bad_status(response)
            await response.read()
        before = process_run_ns(pid)
        await asyncio.sleep(WINDOW_S)
        samples.append(max(process_run_ns(pid) - before, 0) / 1e6)
    return statistics.median(samples)
