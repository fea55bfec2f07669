"""The stage clock: each stage of a request timed into the proxy's metrics when it is on, and
nothing of it made, wrapped or added when it is off."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE, METER, TRACER
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.stage_clock import StageClock
from cacheproxy.slots.stages import Stages
from cacheproxy.tenancy.metering import Meter
from tests.support.completions import complete
from tests.support.fake_llama_server import FakeLlamaServer, fake_llama_server
from tests.support.fake_stack import proxy_before
from tests.support.metrics import sample

STAGES = ("request", "handler", "admit", "mirror", "meter", "place", "queue", "disk", "forward")
STAGES_TOO = ("upstream", "headers", "record", "account")


@pytest.fixture
async def fake() -> FakeLlamaServer:
    async with fake_llama_server() as server:
        yield server


async def test_every_stage_of_a_request_is_timed(fake: FakeLlamaServer, tmp_path: Path) -> None:
    async with (
        proxy_before(fake, tmp_path, tracing={"stage_clock": True}) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        assert isinstance(app[TRACER], StageClock)
        for _ in range(3):
            await complete(client, url, "a text prompt")
        for stage in (*STAGES, *STAGES_TOO):
            assert sample(app, "cacheproxy_stage_entries_total", stage=stage) >= 3, stage
        wall = {
            stage: sample(app, "cacheproxy_stage_seconds_total", stage=stage, clock="wall")
            for stage in (*STAGES, *STAGES_TOO)
        }
        assert all(seconds > 0 for seconds in wall.values())
        # inclusive times: the request holds its handler, which holds every stage of it
        assert wall["request"] >= wall["handler"] >= wall["forward"] >= wall["upstream"]
        assert wall["place"] >= wall["queue"]


async def test_off_nothing_is_timed_or_wrapped(fake: FakeLlamaServer, tmp_path: Path) -> None:
    async with (
        proxy_before(fake, tmp_path) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        await complete(client, url, "a text prompt")
        stages, meter = app[CACHE].stages, app[METER]
        # the stages and the meter run their class's own methods: no wrapper in between
        assert "forward" not in vars(stages) and "admit" not in vars(stages)
        assert stages.forward.__func__ is Stages.forward
        assert "admit" not in vars(meter) and meter.admit.__func__ is Meter.admit
        assert not any(getattr(m, "__name__", "") == "time_stage" for m in app.middlewares)
        assert sample(app, "cacheproxy_stage_entries_total", stage="request") == 0


async def test_instrument_times_sync_and_async_methods() -> None:
    metrics = ProxyMetrics()
    clock = StageClock(metrics)

    class Target:
        def work(self, value: int) -> int:
            return value + 1

        async def wait(self, value: int) -> int:
            return value * 2

    target = Target()
    clock.instrument(target, {"work": "one", "wait": "two"})
    assert target.work(1) == 2
    assert await target.wait(2) == 4
    assert Target().work(1) == 2  # other objects of the class stay as they were
    entries = metrics.registry.get_sample_value
    assert entries("cacheproxy_stage_entries_total", {"stage": "one"}) == 1
    assert entries("cacheproxy_stage_entries_total", {"stage": "two"}) == 1
