"""What llama-server's compute threads cost beside a front: the CPU they take while idle, and how
fast they generate.

Built with OpenMP (the pinned build is), llama-server's compute threads wait for their next step
by spinning on their CPUs, for libgomp's 300,000 rounds by default (milliseconds), before they
sleep: between requests too they keep CPUs busy that a front on the same cores would use. Told
to sleep at once (`OMP_WAIT_POLICY=passive`), they are woken at every step of every token
instead, which makes generating several times slower; one thread fewer than the cores leaves the
front a CPU and keeps the waits (docs/drop-in.md). So both figures:

- `idle_cpu_ms`: the CPU its threads used in the `WINDOW_S` after an answer, nothing more asked
  of it meanwhile, the median of `PROBES`; read to the nanosecond from the scheduler's run time
  of each thread (`/proc/PID/stat` counts clock ticks of 10 ms);
- `ms_per_token`: what generating a token took it, one request at a time, by its own timings
  (`predicted_per_token_ms`), the median of `PROBES` requests of `GENERATED` tokens.
"""

from __future__ import annotations

import asyncio
import statistics

import aiohttp

from cacheproxy.bench.cache_client import post_json
from cacheproxy.bench.harness import BenchmarkError, process_run_ns

WINDOW_S = 0.05
PROBES = 10
GENERATED = 64


async def idle_cpu_ms(
    session: aiohttp.ClientSession, server_url: str, pid: int, prompt: list[int]
) -> float:
    """Milliseconds of CPU llama-server (process `pid`) used in the `WINDOW_S` after answering
    a one-token completion of `prompt`, the median of `PROBES`."""
    samples = []
    for _ in range(PROBES):
        await post_json(session, server_url + "/completion", {"prompt": prompt, "n_predict": 1})
        before = process_run_ns(pid)
        await asyncio.sleep(WINDOW_S)
        samples.append(max(process_run_ns(pid) - before, 0) / 1e6)
    return statistics.median(samples)


async def ms_per_token(session: aiohttp.ClientSession, server_url: str, prompt: list[int]) -> float:
    """Milliseconds llama-server took a generated token, `GENERATED` of them after `prompt`, one
    request at a time, by its own timings: the median of `PROBES`."""
    samples = []
    for _ in range(PROBES):
        body = {"prompt": prompt, "n_predict": GENERATED, "ignore_eos": True, "temperature": 0}
        timings = (await post_json(session, server_url + "/completion", body)).get("timings") or {}
        if timings.get("predicted_n") != GENERATED or "predicted_per_token_ms" not in timings:
            raise BenchmarkError(f"{server_url} did not time {GENERATED} tokens: {timings}")
        samples.append(float(timings["predicted_per_token_ms"]))
    return statistics.median(samples)
