"""The overhead benchmark's added latency by route and its stage-by-stage breakdown."""

from __future__ import annotations

from cacheproxy.bench.overhead_routes import (
    RouteRun,
    _stage_seconds,
    routes_as_json,
    routes_markdown,
)


def test_stage_counters_are_read_by_clock_with_the_queue_wait_beside_them() -> None:
    samples = {
        'cacheproxy_stage_seconds_total{clock="wall",stage="forward"}': 2.0,
        'cacheproxy_stage_seconds_total{clock="cpu",stage="forward"}': 0.5,
        'cacheproxy_stage_entries_total{stage="forward"}': 4.0,
        "cacheproxy_queue_wait_seconds_sum": 0.25,
    }
    assert _stage_seconds(samples, "wall") == {"forward": 2.0, "queue wait": 0.25}
    assert _stage_seconds(samples, "cpu") == {"forward": 0.5, "queue wait": 0.25}


def run() -> RouteRun:
    # two requests an arm; the timed proxy's stages in seconds over both
    wall = {"request": 0.020, "handler": 0.018, "auth": 0.001, "mirror": 0.003, "forward": 0.010}
    return RouteRun(
        route="/v1/chat/completions",
        level=1,
        latencies_ms={
            "direct": [5.0, 7.0],
            "bare": [6.0, 8.0],
            "proxy": [8.0, 10.0],
            "timed": [9.0, 11.0],
        },
        cpu_s={"direct": None, "bare": 0.002, "proxy": 0.004, "timed": 0.005},
        stages_wall_s=wall,
        stages_cpu_s={name: seconds / 2 for name, seconds in wall.items()},
    )


def test_the_table_gives_what_the_proxy_adds_over_the_bare_relay_and_the_stages_per_request() -> (
    None
):
    lines = routes_markdown([run()], rounds=3)
    row = next(line for line in lines if line.startswith("| `/v1/chat/completions` | 1 |"))
    # p50: direct 6, bare 7, proxy 9; CPU per request: bare 1000 us, proxy 2000 us
    assert "| 6.000 | 7.000 | 9.000 | +2.000 | +1.000 | 1000 | 2000 |" in row
    stages = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
    # mean ms a request, wall then CPU: the front door is the request less the handler, and
    # "other" the handler less the stages inside it
    assert stages["| front door (request - handler)"].endswith("| 1.000 | 0.500 |")
    assert stages["| forward"].endswith("| 5.000 | 2.500 |")
    assert stages["| other (handler - the above)"].endswith("| 2.000 | 1.000 |")
    assert stages["| &nbsp;&nbsp;queue wait"].endswith("| 0.000 | — |")
    figures = routes_as_json([run()])[0]
    assert figures["p50_ms"]["proxy"] == 9.0
    assert figures["cpu_us_per_request"]["direct"] is None
    assert figures["stages_ms"]["mirror"] == {"wall": 1.5, "cpu": 0.75}
