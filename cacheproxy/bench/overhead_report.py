"""The overhead benchmark's figures: what a run measured, as Markdown and as JSON."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from cacheproxy.bench.harness import table_row
from cacheproxy.bench.overhead_routes import Arm, RouteRun, routes_as_json, routes_markdown
from cacheproxy.bench.server_threads import GENERATED, PROBES, WINDOW_S
from cacheproxy.bench.stream_cpu import StreamCpu, stream_cpu_rows

WARMUP_REQUESTS = 20
CPU_STREAMS = 64  # concurrent streams (of the stream body's 16 tokens) for the CPU per token
HEADLINE_CONCURRENCY = 8  # the level whose proxy/bare ratio the summary gives (target 0.9)


@dataclass(frozen=True)
class TestBed:
    arms: tuple[Arm, ...]
    llama_server_command: str
    model_name: str
    timed: Arm | None = None  # the proxy with the stage clock on (overhead_routes.py)
    admin_key: str = ""  # the timed proxy's, for its /metrics
    calibrated: Arm | None = None  # the bare pass-through burning CPU (`Calibration`)

    @property
    def server_url(self) -> str:
        """llama-server's own URL: the direct arm's."""
        [url] = [arm.base_url for arm in self.arms if arm.name == "direct"]
        return url


@dataclass(frozen=True)
class Percentiles:
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class ThroughputRun:
    completed: int
    seconds: float
    cpu_s: float | None = None  # the arm's front process (None: direct, llama-server itself)
    # how long that process's main thread (its event loop) was ready but waited for a CPU
    waiting_s: float | None = None
    # llama-server's decode calls over the run, and the busy slots they ran summed: how full
    # its batches were (a front that hands a freed slot on late leaves it idle meanwhile)
    decodes: float = 0.0
    busy_slot_decodes: float = 0.0
    # llama-server's CPU over the run (None: not measured): on a machine it shares with the
    # front, what its batches cost a request, which a front that fills them less raises
    server_cpu_s: float | None = None

    @property
    def per_second(self) -> float:
        return self.completed / self.seconds

    @property
    def cpu_us_per_request(self) -> float | None:
        return None if self.cpu_s is None else 1e6 * self.cpu_s / max(self.completed, 1)

    @property
    def waiting_us_per_request(self) -> float | None:
        return None if self.waiting_s is None else 1e6 * self.waiting_s / max(self.completed, 1)

    @property
    def server_cpu_us_per_request(self) -> float | None:
        if self.server_cpu_s is None:
            return None
        return 1e6 * self.server_cpu_s / max(self.completed, 1)

    @property
    def busy_slots_per_decode(self) -> float | None:
        return self.busy_slot_decodes / self.decodes if self.decodes > 0 else None

    def __add__(self, other: ThroughputRun) -> ThroughputRun:
        return ThroughputRun(
            self.completed + other.completed,
            self.seconds + other.seconds,
            _sum(self.cpu_s, other.cpu_s),
            _sum(self.waiting_s, other.waiting_s),
            self.decodes + other.decodes,
            self.busy_slot_decodes + other.busy_slot_decodes,
            _sum(self.server_cpu_s, other.server_cpu_s),
        )


def _sum(one: float | None, other: float | None) -> float | None:
    return None if one is None or other is None else one + other


@dataclass(frozen=True)
class Calibration:
    """The bare pass-through, the same spending `burn_us` more CPU a request (its calibration
    arm), and the proxy, at `HEADLINE_CONCURRENCY` in the same rounds: what a microsecond of a
    front's CPU a request costs in throughput on this machine, where the front shares the CPUs
    with llama-server and the load generator."""

    burn_us: float
    runs: dict[str, ThroughputRun]  # "bare", "calibrated", "proxy": each one's runs added up

    def _cpu_above_bare(self, name: str) -> float | None:
        cpu, bare = self.runs[name].cpu_us_per_request, self.runs["bare"].cpu_us_per_request
        return None if cpu is None or bare is None else cpu - bare

    def ratio(self, name: str) -> float:
        return self.runs[name].per_second / self.runs["bare"].per_second

    @property
    def share_lost_per_us(self) -> float | None:
        """Throughput lost, as a share of the bare pass-through's, per microsecond of CPU a
        request above its own (from the calibration arm; None where it measured no cost)."""
        above = self._cpu_above_bare("calibrated")
        lost = 1.0 - self.ratio("calibrated")
        if above is None or above <= 0 or lost <= 0:
            return None
        return lost / above

    @property
    def proxy_as_calibrated(self) -> float | None:
        """The proxy/bare ratio a front spending the proxy's CPU would have, at that rate."""
        rate, above = self.share_lost_per_us, self._cpu_above_bare("proxy")
        return None if rate is None or above is None else 1.0 - rate * above

    def cpu_to_shed(self, target: float) -> float | None:
        """Microseconds of CPU a request the proxy would shed to reach `target`, at that rate."""
        rate, above = self.share_lost_per_us, self._cpu_above_bare("proxy")
        if rate is None or above is None:
            return None
        return max(above - (1.0 - target) / rate, 0.0)


@dataclass(frozen=True)
class OverheadReport:
    command: str
    cpu_count: int | None
    load_average: tuple[float, float, float]
    platform: str
    python: str
    aiohttp: str
    requests: int
    duration: float
    rounds: int
    test_bed: TestBed
    latency: dict[str, dict[str, Percentiles]]
    throughput: dict[int, dict[str, ThroughputRun]]
    stream_cpu: dict[str, StreamCpu]
    # llama-server's CPU in the 50 ms after an answer, with nothing to do, and its time a
    # generated token alone (bench/server_threads.py): what its compute threads' waits cost the
    # fronts, and what they spare its own generation
    server_idle_cpu_ms: float
    server_ms_per_token: float
    # per level, proxy/bare within each round (its arms ran seconds apart): how far the ratio
    # moves with the machine's other load, which the pooled ratio does not show
    round_ratios: dict[int, list[float]] = field(default_factory=dict)
    routes: list[RouteRun] = field(default_factory=list)  # each route at each level
    calibration: Calibration | None = None  # with `--calibrate-us`


THROUGHPUT_RATIOS = (("proxy", "direct"), ("bare", "direct"), ("proxy", "bare"))
ARM_NAMES = ("direct", "bare", "proxy")


def latency_rows(latency: dict[str, dict[str, Percentiles]]) -> Iterator[str]:
    yield table_row(["series", "arm", "p50", "p99", "added p50", "added p99"])
    yield table_row(["---", "---", "---:", "---:", "---:", "---:"])
    for series, by_arm in latency.items():
        direct = by_arm["direct"]
        for name, figures in by_arm.items():
            measured = [f"{figures.p50_ms:.3f}", f"{figures.p99_ms:.3f}"]
            added = (
                ["—", "—"]
                if name == "direct"
                else [
                    f"{figures.p50_ms - direct.p50_ms:+.3f}",
                    f"{figures.p99_ms - direct.p99_ms:+.3f}",
                ]
            )
            yield table_row([series, name, *measured, *added])


def throughput_rows(throughput: dict[int, dict[str, ThroughputRun]]) -> Iterator[str]:
    ratio_names = [f"{top}/{bottom}" for top, bottom in THROUGHPUT_RATIOS]
    cpu_names = ["bare CPU us/req", "proxy CPU us/req", "bare wait us/req", "proxy wait us/req"]
    fill_names = [f"{name} slots/decode" for name in ARM_NAMES]
    server_names = [f"{name} server CPU us/req" for name in ARM_NAMES]
    rate_names = [f"{name} req/s" for name in ARM_NAMES]
    names = [*rate_names, *ratio_names, *cpu_names, *fill_names, *server_names]
    yield table_row(["concurrency", *names])
    yield table_row(["---:"] * (1 + len(names)))
    for concurrency, by_arm in sorted(throughput.items()):
        rates = {name: run.per_second for name, run in by_arm.items()}
        figures = [f"{rates[name]:.1f}" for name in ARM_NAMES]
        ratios = [f"{rates[top] / rates[bottom]:.3f}" for top, bottom in THROUGHPUT_RATIOS]
        cpu = [_us(by_arm[name].cpu_us_per_request) for name in ("bare", "proxy")]
        waits = [_us(by_arm[name].waiting_us_per_request) for name in ("bare", "proxy")]
        fill = [_slots(by_arm[name].busy_slots_per_decode) for name in ARM_NAMES]
        server = [_us(by_arm[name].server_cpu_us_per_request) for name in ARM_NAMES]
        yield table_row([str(concurrency), *figures, *ratios, *cpu, *waits, *fill, *server])


def _slots(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def summary_lines(report: OverheadReport) -> Iterator[str]:
    """The figures the proxy is held to, in one place."""
    level = report.throughput.get(HEADLINE_CONCURRENCY)
    if level is not None:
        ratio = level["proxy"].per_second / level["bare"].per_second
        yield (
            f"- throughput at concurrency {HEADLINE_CONCURRENCY}, proxy/bare: {ratio:.3f}"
            " (target: at least 0.9)"
        )
        rounds = report.round_ratios.get(HEADLINE_CONCURRENCY)
        if rounds:
            yield (
                f"- the same, round by round ({len(rounds)}): median"
                f" {statistics.median(rounds):.3f}, lowest {min(rounds):.3f}, highest"
                f" {max(rounds):.3f}"
            )
        yield (
            f"- CPU per request at concurrency {HEADLINE_CONCURRENCY}: proxy"
            f" {_us(level['proxy'].cpu_us_per_request)} us, bare"
            f" {_us(level['bare'].cpu_us_per_request)} us"
        )
        fill = ", ".join(
            f"{name} {_slots(level[name].busy_slots_per_decode)}" for name in ARM_NAMES
        )
        yield f"- llama-server's busy slots per decode call at the same concurrency: {fill}"
        server = ", ".join(
            f"{name} {_us(level[name].server_cpu_us_per_request)} us" for name in ARM_NAMES
        )
        yield f"- llama-server's CPU per request at the same concurrency: {server}"
    yield (
        f"- llama-server, idle after an answer: {report.server_idle_cpu_ms:.1f} ms of CPU in the"
        f" {1000 * WINDOW_S:.0f} ms that followed (median of {PROBES}), its compute threads"
        " waiting for work on CPUs the fronts would use (OpenMP spins them for a few"
        " milliseconds by default: see docs/drop-in.md); generating alone, it took"
        f" {report.server_ms_per_token:.2f} ms a token ({GENERATED} tokens a request, median of"
        f" {PROBES}, its own timings)"
    )
    calibration = report.calibration
    if calibration is not None and calibration.share_lost_per_us is not None:
        yield (
            f"- each 100 us of a front's CPU a request costs"
            f" {100 * 100 * calibration.share_lost_per_us:.1f}% of throughput here (calibrated):"
            f" the proxy's CPU alone gives {calibration.proxy_as_calibrated:.3f}, and 0.9 needs"
            f" {calibration.cpu_to_shed(0.9):.0f} us less a request"
        )
    for name in ("proxy", "bare"):
        run = report.stream_cpu.get(name)
        if run is not None:
            yield (
                f"- {CPU_STREAMS} concurrent streams through {name}: {run.us_per_request:.0f} us"
                f" CPU per stream, {run.us_per_token:.1f} us per relayed token"
            )


def render_markdown(report: OverheadReport) -> str:
    arms = ", ".join(f"{arm.name} = {arm.base_url}" for arm in report.test_bed.arms)
    lines = [
        "# cacheproxy overhead benchmark",
        "",
        f"- command: `{report.command}`",
        f"- machine: {report.cpu_count} CPUs, {report.platform}; "
        f"Python {report.python}, aiohttp {report.aiohttp}",
        "- load average (1, 5, 15 min) before the run: "
        + ", ".join(f"{load:.2f}" for load in report.load_average),
        f"- llama-server: `{report.test_bed.llama_server_command}`",
        f"- model: {report.test_bed.model_name} (random weights); prompt: 8 fixed token ids",
        f"- arms: {arms} (direct: llama-server itself; bare: the reference aiohttp "
        "pass-through; proxy: `cacheproxy serve`)",
        "- load generator, llama-server and both proxies share this machine's CPUs",
        "- the proxy runs with routing, a tenant (its key on every arm's requests), the disk"
        " tier (archive folder = llama-server's --slot-save-path), the usage ledger, and every"
        " rate limit and budget (set above what the run uses)",
        "",
        "## Summary",
        "",
        *summary_lines(report),
        "",
        f"## Latency, ms ({report.requests} sequential requests per arm after "
        f"{WARMUP_REQUESTS} warm-up, arms interleaved round-robin)",
        "",
        "added = the arm's percentile minus direct's.",
        "",
        *latency_rows(report.latency),
        "",
        f"## Throughput, POST /completion n_predict 1 ({report.rounds} rounds of"
        f" {report.duration:g} s per arm and level, arms alternated, closed loop)",
        "",
        "CPU us/req: the front process's user + system CPU time over its runs, per request."
        " wait us/req: how long its event loop's thread was ready to run but waited for a CPU"
        " (the kernel's run delay), per request. slots/decode: how many of llama-server's"
        " slots its decode calls ran over the arm's runs (a slot handed on late sits idle).",
        "",
        *throughput_rows(report.throughput),
        "",
        f"## CPU per relayed stream, {CPU_STREAMS} concurrent streams of 16 tokens"
        f" ({report.duration:g} s per arm; the process's user + system CPU time)",
        "",
        *stream_cpu_rows(report.stream_cpu),
        "",
        *routes_markdown(report.routes, report.rounds),
        *calibration_lines(report.calibration, report.rounds, report.duration),
    ]
    return "\n".join(lines)


def calibration_lines(
    calibration: Calibration | None, rounds: int, duration: float
) -> Iterator[str]:
    if calibration is None:
        return
    yield from (
        "",
        f"## What a front's CPU costs, concurrency {HEADLINE_CONCURRENCY} ({rounds} rounds of"
        f" {duration:g} s per arm, arms alternated)",
        "",
        f"calibrated: the bare pass-through spinning {calibration.burn_us:g} us of CPU more on"
        " each request (a busy loop on its thread's CPU clock), beside the bare pass-through"
        " and the proxy in the same rounds.",
        "",
        table_row(["arm", "req/s", "/bare", "CPU us/req"]),
        table_row(["---", "---:", "---:", "---:"]),
    )
    for name in ("bare", "calibrated", "proxy"):
        run = calibration.runs[name]
        yield table_row(
            [
                name,
                f"{run.per_second:.1f}",
                f"{calibration.ratio(name):.3f}",
                _us(run.cpu_us_per_request),
            ]
        )
    rate = calibration.share_lost_per_us
    if rate is None:
        yield ""
        yield "- the calibration arm lost no throughput: no rate to tell"
        return
    yield from (
        "",
        f"- each 100 us of a front's CPU per request costs {100 * 100 * rate:.1f}% of the bare"
        " pass-through's throughput here",
        f"- a front spending the proxy's CPU would have proxy/bare"
        f" {calibration.proxy_as_calibrated:.3f} (measured {calibration.ratio('proxy'):.3f})",
        f"- to reach 0.9, the proxy would spend {calibration.cpu_to_shed(0.9):.0f} us less CPU"
        " per request",
    )


def report_as_json(report: OverheadReport) -> dict[str, Any]:
    return {
        "command": report.command,
        "cpu_count": report.cpu_count,
        "load_average_before": list(report.load_average),
        "platform": report.platform,
        "python": report.python,
        "aiohttp": report.aiohttp,
        "requests": report.requests,
        "duration_s": report.duration,
        "rounds": report.rounds,
        "warmup_requests": WARMUP_REQUESTS,
        "llama_server_command": report.test_bed.llama_server_command,
        "model": report.test_bed.model_name,
        "server_idle_cpu_ms": report.server_idle_cpu_ms,
        "server_ms_per_token": report.server_ms_per_token,
        "arms": {arm.name: arm.base_url for arm in report.test_bed.arms},
        "latency_ms": {
            series: {
                name: {
                    "p50": figures.p50_ms,
                    "p99": figures.p99_ms,
                    "added_p50": figures.p50_ms - by_arm["direct"].p50_ms,
                    "added_p99": figures.p99_ms - by_arm["direct"].p99_ms,
                }
                for name, figures in by_arm.items()
            }
            for series, by_arm in report.latency.items()
        },
        "throughput": {
            str(concurrency): {
                "per_arm": {
                    name: {
                        "completed": run.completed,
                        "seconds": run.seconds,
                        "requests_per_s": run.per_second,
                        "cpu_s": run.cpu_s,
                        "cpu_us_per_request": run.cpu_us_per_request,
                        "waiting_s": run.waiting_s,
                        "waiting_us_per_request": run.waiting_us_per_request,
                        "server_decodes": run.decodes,
                        "server_busy_slots_per_decode": run.busy_slots_per_decode,
                        "server_cpu_s": run.server_cpu_s,
                        "server_cpu_us_per_request": run.server_cpu_us_per_request,
                    }
                    for name, run in by_arm.items()
                },
                "ratios": {
                    f"{top}/{bottom}": by_arm[top].per_second / by_arm[bottom].per_second
                    for top, bottom in THROUGHPUT_RATIOS
                },
                "proxy/bare_by_round": report.round_ratios.get(concurrency, []),
            }
            for concurrency, by_arm in sorted(report.throughput.items())
        },
        "stream_cpu": {
            name: {
                "streams": run.requests,
                "tokens": run.tokens,
                "cpu_s": run.cpu_s,
                "cpu_us_per_request": run.us_per_request,
                "cpu_us_per_token": run.us_per_token,
            }
            for name, run in report.stream_cpu.items()
        },
        "routes": routes_as_json(report.routes),
        "calibration": calibration_as_json(report.calibration),
    }


def calibration_as_json(calibration: Calibration | None) -> dict[str, Any] | None:
    if calibration is None:
        return None
    return {
        "concurrency": HEADLINE_CONCURRENCY,
        "burn_us": calibration.burn_us,
        "per_arm": {
            name: {
                "requests_per_s": run.per_second,
                "ratio_to_bare": calibration.ratio(name),
                "cpu_us_per_request": run.cpu_us_per_request,
            }
            for name, run in calibration.runs.items()
        },
        "share_lost_per_us": calibration.share_lost_per_us,
        "proxy_as_calibrated": calibration.proxy_as_calibrated,
        "cpu_to_shed_for_0.9_us": calibration.cpu_to_shed(0.9),
    }
