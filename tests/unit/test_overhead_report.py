"""The overhead benchmark's summary: the ratio and CPU figures the proxy is held to."""

from __future__ import annotations

from cacheproxy.bench import overhead_report
from cacheproxy.bench.overhead_report import (
    Arm,
    OverheadReport,
    Percentiles,
    ThroughputRun,
    render_markdown,
    report_as_json,
)
from cacheproxy.bench.stream_cpu import StreamCpu


def report(throughput: dict[int, dict[str, ThroughputRun]]) -> OverheadReport:
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
    )


def test_rounds_add_up_and_the_summary_gives_the_ratio_and_cpu_at_concurrency_8() -> None:
    bare = ThroughputRun(100, 1.0, 0.03) + ThroughputRun(300, 1.0, 0.09)
    proxy = ThroughputRun(150, 1.0, 0.09) + ThroughputRun(210, 1.0, 0.126)
    assert (bare.completed, bare.seconds) == (400, 2.0)
    assert bare.cpu_us_per_request == 300.0
    figures = {8: {"direct": ThroughputRun(500, 2.0), "bare": bare, "proxy": proxy}}
    markdown = render_markdown(report(figures))
    assert "throughput at concurrency 8, proxy/bare: 0.900 (target: at least 0.9)" in markdown
    assert "CPU per request at concurrency 8: proxy 600 us, bare 300 us" in markdown
    assert "64 concurrent streams through proxy: 1600 us CPU per stream, 100.0 us" in markdown
    row = report_as_json(report(figures))["throughput"]["8"]
    assert row["per_arm"]["proxy"]["cpu_us_per_request"] == 600.0
    assert row["per_arm"]["direct"]["cpu_us_per_request"] is None
    assert row["ratios"]["proxy/bare"] == 0.9
