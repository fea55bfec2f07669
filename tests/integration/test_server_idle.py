"""llama-server's CPU while idle after an answer (bench/server_idle.py), on real servers: the
pinned build computes through OpenMP, whose threads spin while they wait for work unless told
to sleep, and the overhead benchmark reports which."""

from __future__ import annotations

import json

import aiohttp
import pytest

from cacheproxy.bench.server_idle import WINDOW_S, idle_cpu_ms
from tests.support.servers import StartServer

COMPLETION = json.dumps({"prompt": [1000, 2345, 4567, 7890], "n_predict": 1}).encode()


async def test_threads_that_spin_while_idle_show_and_threads_that_sleep_do_not(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch, client: aiohttp.ClientSession
) -> None:
    # two compute threads each; the servers inherit this environment. Spinning without end
    # (not libgomp's default of a few milliseconds) keeps a thread on a CPU for the whole
    # window, however the machine's other load delays the probe's reads
    monkeypatch.setenv("GOMP_SPINCOUNT", "INFINITY")
    spinning = start_server(extra_args=("--threads", "2"))
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    sleeping = start_server(extra_args=("--threads", "2"))

    spun = await idle_cpu_ms(client, spinning.url, spinning.process.pid, COMPLETION)
    slept = await idle_cpu_ms(client, sleeping.url, sleeping.process.pid, COMPLETION)

    window_ms = 1000 * WINDOW_S
    assert spun > window_ms / 5, spun  # a thread on a CPU, whatever else runs beside it
    assert slept < window_ms / 10, slept  # its HTTP threads' keep-alive polls, no more
