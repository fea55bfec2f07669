"""What llama-server's compute threads cost beside a front (bench/server_threads.py), on real
servers: the pinned build computes through OpenMP, whose threads spin while they wait for work
unless told to sleep, and the overhead benchmark reports which, beside how fast it generates."""

from __future__ import annotations

import aiohttp
import pytest

from cacheproxy.bench.harness import BenchmarkError
from cacheproxy.bench.server_threads import WINDOW_S, idle_cpu_ms, ms_per_token
from tests.support.servers import LlamaServer, StartServer

PROMPT = [1000, 2345, 4567, 7890]


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

    spun = await idle_cpu_ms(client, spinning.url, spinning.process.pid, PROMPT)
    slept = await idle_cpu_ms(client, sleeping.url, sleeping.process.pid, PROMPT)

    window_ms = 1000 * WINDOW_S
    assert spun > window_ms / 5, spun  # a thread on a CPU, whatever else runs beside it
    assert slept < window_ms / 10, slept  # its threads asleep: next to nothing


async def test_the_time_a_token_is_the_servers_own_over_every_token_asked(
    llama_server: LlamaServer, client: aiohttp.ClientSession
) -> None:
    took = await ms_per_token(client, llama_server.url, PROMPT)
    # the server's own figure for the request's generated tokens (ignore_eos: all of them)
    body = {"prompt": PROMPT, "n_predict": 64, "ignore_eos": True, "temperature": 0}
    async with client.post(llama_server.url + "/completion", json=body) as response:
        timings = (await response.json())["timings"]
    assert timings["predicted_n"] == 64
    assert took > 0 and timings["predicted_per_token_ms"] > 0


async def test_a_server_that_generated_fewer_tokens_gives_no_figure(
    start_server: StartServer, client: aiohttp.ClientSession
) -> None:
    # slots of 256 tokens (llama-server's least) without context shift: after a 240-token
    # prompt it makes what fits of the 64 asked and answers 200; the probe says so rather than
    # time those
    small = start_server(ctx_size=1024, extra_args=("--no-context-shift",))  # 4 slots
    with pytest.raises(BenchmarkError, match="did not time 64 tokens"):
        await ms_per_token(client, small.url, [1000 + index for index in range(240)])
