"""W5's SDK drivers when the server is not there: a real connection refused on a loopback port
nobody listens on, through the real SDKs."""

from __future__ import annotations

import time

import pytest

from cacheproxy.bench.agents_bench import run_trace
from cacheproxy.bench.agents_client import APIS, driver_for
from cacheproxy.bench.agents_trace import AgentSpec, DrawRange, agent_trace
from cacheproxy.bench.harness import HOST, BenchmarkError
from cacheproxy.upstreams.managed import free_port

SPEC = AgentSpec(agents=2, turns=DrawRange(2, 2), system_words=DrawRange(5, 5), arrival_gap_s=0)


@pytest.mark.parametrize("api", APIS)
async def test_an_agent_that_cannot_connect_fails_the_arm_naming_it(api: str) -> None:
    base_url = f"http://{HOST}:{free_port(HOST)}"  # nothing listens there
    driver = driver_for(api, base_url, 4, time.perf_counter())
    try:
        with pytest.raises(BenchmarkError, match=rf"agent-\d turn 0 over /v1/{api}"):
            await run_trace(driver, agent_trace(SPEC, 1))
    finally:
        await driver.close()
