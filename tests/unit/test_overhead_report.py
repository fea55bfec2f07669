"""The overhead benchmark's summary: the ratio and CPU figures the proxy is held to."""

from __future__ import annotations

from dataclasses import replace

from cacheproxy.bench import overhead_report
from cacheproxy.bench.overhead_report import (
    Arm,
    Calibration,
    OverheadReport,
    Percentiles,
    ThroughputRun,
    render_markdown,
    report_as_json,
)
from cacheproxy.bench.run_counters import decode_fill
from cacheproxy.bench.stream_cpu import StreamCpu


def report(
    throughput: dict[int, dict[str, ThroughputRun]], round_ratios: dict[int, list[float]]
) -> OverheadReport:
    arms = (Arm("direct", "http://d"), Arm("bare", "http://b"), Arm("proxy", "http://p"))
    latency = {"GET /health": {arm.name: Percentiles(1.0, 2.0) for arm in arms}}
    return OverheadReport(
        command="cacheproxy bench overhead",
        cpu_count=2,
        load_average=(1.0, 1.0, 1.0),
        platform="linux",
        python="3.11",
        aiohttp="3",
        requests=10,
        duration=1.0,
        rounds=2,
        test_bed=overhead_report.TestBed(arms, "llama-server", "model.gguf"),
        latency=latency,
        throughput=throughput,
        stream_cpu={"bare": StreamCpu(10, 160, 0.008), "proxy": StreamCpu(10, 160, 0.016)},
        server_idle_cpu_ms=41.26,
        server_ms_per_token=0.482,
        round_ratios=round_ratios,
    )


def test_rounds_add_up_and_the_summary_gives_the_ratio_and_cpu_at_concurrency_8() -> None:
    # the server's decode calls and their busy slots, summed over an arm's runs
    # and llama-server's CPU over each run
    bare = ThroughputRun(100, 1.0, 0.03, 0.01, 100, 300, 0.2) + ThroughputRun(
        300, 1.0, 0.09, 0.03, 100, 340, 0.4
    )
    proxy = ThroughputRun(150, 1.0, 0.09, 0.09, 150, 300, 0.3) + ThroughputRun(
        210, 1.0, 0.126, 0.126, 50, 100, 0.42
    )
    # a run whose server CPU was not read leaves the sum unknown, not short
    assert (bare + ThroughputRun(10, 1.0)).server_cpu_us_per_request is None
    assert (bare.completed, bare.seconds) == (400, 2.0)
    assert bare.cpu_us_per_request == 300.0
    assert (bare.waiting_us_per_request, proxy.waiting_us_per_request) == (100.0, 600.0)
    direct = ThroughputRun(500, 2.0, decodes=200, busy_slot_decodes=760, server_cpu_s=0.5)
    figures = {8: {"direct": direct, "bare": bare, "proxy": proxy}}
    by_round = {8: [1.5, 0.7]}
    markdown = render_markdown(report(figures, by_round))
    assert "throughput at concurrency 8, proxy/bare: 0.900 (target: at least 0.9)" in markdown
    assert "CPU per request at concurrency 8: proxy 600 us, bare 300 us" in markdown
    assert (
        "busy slots per decode call at the same concurrency: direct 3.80, bare 3.20, proxy 2.00"
        in markdown
    )
    assert (
        "llama-server's CPU per request at the same concurrency: direct 1000 us, bare 1500 us,"
        " proxy 2000 us" in markdown
    )
    assert "64 concurrent streams through proxy: 1600 us CPU per stream, 100.0 us" in markdown
    # the rounds' own ratios beside the pooled one: 150/100 and 210/300
    assert "round by round (2): median 1.100, lowest 0.700, highest 1.500" in markdown
    row = report_as_json(report(figures, by_round))["throughput"]["8"]
    assert row["per_arm"]["proxy"]["cpu_us_per_request"] == 600.0
    assert row["per_arm"]["direct"]["cpu_us_per_request"] is None
    assert row["per_arm"]["proxy"]["waiting_us_per_request"] == 600.0
    assert row["per_arm"]["direct"]["waiting_us_per_request"] is None
    assert row["per_arm"]["bare"]["server_busy_slots_per_decode"] == 3.2
    assert row["per_arm"]["proxy"]["server_cpu_us_per_request"] == 2000.0
    # the table's row: rates, ratios, then CPU and the wait for a CPU, bare's and the proxy's,
    # then how full each arm kept the server's batches, and the server's CPU a request
    rates_and_ratios = "| 8 | 250.0 | 200.0 | 180.0 | 0.720 | 0.800 | 0.900"
    fill_and_server = "| 3.80 | 3.20 | 2.00 | 1000 | 1500 | 2000 |"
    assert f"{rates_and_ratios} | 300 | 600 | 100 | 600 {fill_and_server}" in markdown
    assert row["ratios"]["proxy/bare"] == 0.9
    assert row["proxy/bare_by_round"] == [1.5, 0.7]


def test_the_servers_batch_fill_over_a_run_comes_from_its_mean_since_it_started() -> None:
    # llama-server keeps the mean since it started: 100 calls at 2 slots, then 100 at 4
    before = {"n_decode_total": 100.0, "n_busy_slots_per_decode": 2.0}
    after = {"n_decode_total": 200.0, "n_busy_slots_per_decode": 3.0}
    decodes, busy = decode_fill(before, after)
    assert (decodes, busy) == (100.0, 400.0)
    run = ThroughputRun(10, 1.0, decodes=decodes, busy_slot_decodes=busy)
    assert run.busy_slots_per_decode == 4
    # a server started without --metrics tells nothing
    decodes, busy = decode_fill({}, {})
    assert (
        ThroughputRun(10, 1.0, decodes=decodes, busy_slot_decodes=busy).busy_slots_per_decode
        is None
    )


def test_the_calibration_arm_gives_what_a_microsecond_of_the_fronts_cpu_costs() -> None:
    # bare: 1000 req/s at 300 us; 100 us more CPU a request: 850 req/s (15% lost, 0.15% a us)
    runs = {
        "bare": ThroughputRun(1000, 1.0, 0.3),
        "calibrated": ThroughputRun(850, 1.0, 0.34),
        "proxy": ThroughputRun(700, 1.0, 0.35),
    }
    calibration = Calibration(100.0, runs)
    assert abs(calibration.share_lost_per_us - 0.0015) < 1e-12
    assert abs(calibration.proxy_as_calibrated - (1 - 0.0015 * 200)) < 1e-12  # 0.700
    assert abs(calibration.cpu_to_shed(0.9) - (200 - 0.1 / 0.0015)) < 1e-9  # 133 us
    assert calibration.cpu_to_shed(0.5) == 0.0  # already above it
    markdown = render_markdown(replace(report({}, {}), calibration=calibration))
    assert "| calibrated | 850.0 | 0.850 | 400 |" in markdown
    assert "each 100 us of a front's CPU per request costs 15.0%" in markdown
    assert "proxy/bare 0.700 (measured 0.700)" in markdown
    assert "the proxy would spend 133 us less CPU per request" in markdown
    # and in the summary
    assert (
        "costs 15.0% of throughput here (calibrated): the proxy's CPU alone gives 0.700"
        in (markdown.split("## Latency")[0])
    )
    figures = report_as_json(replace(report({}, {}), calibration=calibration))["calibration"]
    assert figures["per_arm"]["proxy"]["ratio_to_bare"] == 0.7
    assert figures["cpu_to_shed_for_0.9_us"] == calibration.cpu_to_shed(0.9)
    # a calibration arm that cost nothing (a machine with CPUs to spare) tells no rate
    idle = Calibration(100.0, {**runs, "calibrated": ThroughputRun(1000, 1.0, 0.4)})
    assert idle.share_lost_per_us is None and idle.cpu_to_shed(0.9) is None
    assert "lost no throughput" in render_markdown(replace(report({}, {}), calibration=idle))
    assert report_as_json(report({}, {}))["calibration"] is None


def test_the_summary_gives_llama_servers_idle_cpu_and_its_time_a_token() -> None:
    figures = report({}, {})
    summary = render_markdown(figures).split("## Latency")[0]
    assert (
        "- llama-server, idle after an answer: 41.3 ms of CPU in the 50 ms that followed"
        " (median of 10)" in summary
    )
    assert "generating alone, it took 0.48 ms a token (64 tokens a request" in summary
    figures_json = report_as_json(figures)
    assert figures_json["server_idle_cpu_ms"] == 41.26
    assert figures_json["server_ms_per_token"] == 0.482
