"""What the proxy adds to latency and takes from throughput, against the direct path, in one run.

One llama-server is started, with two processes in front of it: the bare aiohttp pass-through
(`cacheproxy.bench.passthrough`, the least any aiohttp proxy costs) and `cacheproxy serve`.
The same requests go to the three arms, interleaved so that machine noise hits all alike, and the
figures are printed as Markdown, with the added latency and the throughput ratios against direct.
It asserts nothing about speed: it measures.

The proxy runs with every feature on: routing, a tenant (its key on every arm's requests) and the
disk tier (in llama-server's `--slot-save-path`). Last, 64 streams at once through each front
process, whose CPU time is divided by the streams and tokens relayed (`stream_cpu.py`).

`cacheproxy bench overhead --requests 400 --duration 5 [--json figures.json]`.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.bench.harness import (
    HOST,
    JSON_HEADERS,
    STREAM_HEADERS,
    BenchmarkError,
    ProcessSet,
    create_tenant,
    fail_on_bad_status,
    invoked_command,
    progress,
    proxy_command,
    rotated,
    run_with_processes,
    table_row,
    wait_healthy,
)
from cacheproxy.bench.stream_cpu import StreamCpu, stream_cpu, stream_cpu_rows
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.upstreams.managed import free_port, llama_server_args

# Eight fixed ordinary-vocabulary token ids: a real prompt, identical for every request and arm.
PROMPT_TOKENS = (1000, 2345, 4567, 7890, 12000, 15555, 21000, 29000)
COMPLETION_BODY = json.dumps({"prompt": PROMPT_TOKENS, "n_predict": 1, "temperature": 0}).encode()
STREAM_BODY = json.dumps(
    {"prompt": PROMPT_TOKENS, "n_predict": 16, "temperature": 0, "stream": True}
).encode()
WARMUP_REQUESTS = 20
CONCURRENCY_LEVELS = (1, 8, 32)
CPU_STREAMS = 64  # concurrent streams (of STREAM_BODY's 16 tokens) for the CPU per token
LLAMA_SERVER_OPTIONS = {"parallel": 4, "ctx_size": 16384, "cache_ram_mib": 0}
REQUEST_TIMEOUT_S = 60.0


# --- the three processes --------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    name: str
    base_url: str


@dataclass(frozen=True)
class TestBed:
    arms: tuple[Arm, ...]
    llama_server_command: str
    model_name: str


def start_llama_server(processes: ProcessSet) -> tuple[str, list[str], Path]:
    """Start llama-server; return its base URL, its command line and the model it serves."""
    progress("locating llama-server (a build in progress is waited for, never started twice)")
    binary = ensure_llama_server()
    model = ensure_model("small")
    port = free_port(HOST)
    slot_save_path = processes.workdir / "slots"  # the proxy's archive folder too
    slot_save_path.mkdir()
    args = llama_server_args(
        binary, model, host=HOST, port=port, slot_save_path=slot_save_path, **LLAMA_SERVER_OPTIONS
    )
    progress(f"starting llama-server: {shlex.join(args)}")
    processes.start("llama-server", args)
    return f"http://{HOST}:{port}", args, model


def start_front_processes(processes: ProcessSet, upstream: str) -> dict[str, str]:
    """Start the bare pass-through and the proxy in front of `upstream`; return their base URLs."""
    bare_port, proxy_port = free_port(HOST), free_port(HOST)
    processes.start(
        "bare",
        [
            sys.executable,
            "-m",
            "cacheproxy.bench.passthrough",
            "--upstream",
            upstream,
            "--port",
            str(bare_port),
        ],
    )
    # Its own state folder, so a run never touches the user's cacheproxy state.
    proxy_env = {
        **os.environ,
        "CACHEPROXY_STATE_DIR": str(processes.workdir / "proxy-state"),
        "CACHEPROXY_DISK__DIRECTORY": str(processes.workdir / "slots"),
    }
    processes.start("proxy", proxy_command(upstream, proxy_port), env=proxy_env)
    return {"bare": f"http://{HOST}:{bare_port}", "proxy": f"http://{HOST}:{proxy_port}"}


async def bring_up(processes: ProcessSet, session: aiohttp.ClientSession) -> TestBed:
    direct_url, llama_server_command, model = start_llama_server(processes)
    await wait_healthy(session, processes.find("llama-server"), direct_url)
    progress(f"llama-server healthy at {direct_url}; starting the bare pass-through and the proxy")
    api_key = create_tenant(processes.workdir / "proxy-state")
    front_urls = start_front_processes(processes, direct_url)
    await asyncio.gather(
        *(wait_healthy(session, processes.find(name), url) for name, url in front_urls.items())
    )
    arms = (
        Arm("direct", direct_url),
        Arm("bare", front_urls["bare"]),
        Arm("proxy", front_urls["proxy"]),
    )
    session.headers["Authorization"] = f"Bearer {api_key}"  # every arm: the proxy needs it
    return TestBed(arms, shlex.join(llama_server_command), model.name)


# --- requests -------------------------------------------------------------------------------

# A probe sends one request to a base URL and returns the seconds it measured.
Probe = Callable[[aiohttp.ClientSession, str], Awaitable[float]]


async def health_latency(session: aiohttp.ClientSession, base_url: str) -> float:
    started = time.perf_counter()
    async with session.get(base_url + "/health") as response:
        await fail_on_bad_status(response)
        await response.read()
    return time.perf_counter() - started


async def post_latency(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """Seconds from sending a JSON POST to having read its whole (checked) answer."""
    started = time.perf_counter()
    async with session.post(url, data=body, headers=JSON_HEADERS) as response:
        await fail_on_bad_status(response)
        await response.read()
    return time.perf_counter() - started


async def completion_latency(session: aiohttp.ClientSession, base_url: str) -> float:
    return await post_latency(session, base_url + "/completion", COMPLETION_BODY)


async def fresh_chat_latency(session: aiohttp.ClientSession, base_url: str) -> float:
    """A chat request no earlier one matched: the proxy's token mirror must template and
    tokenize it upstream (two extra round trips) before it can choose a slot."""
    question = {"role": "user", "content": f"question {time.perf_counter_ns()}"}
    body = json.dumps({"messages": [question], "n_predict": 1, "temperature": 0}).encode()
    return await post_latency(session, base_url + "/v1/chat/completions", body)


async def first_streamed_byte_latency(session: aiohttp.ClientSession, base_url: str) -> float:
    started = time.perf_counter()
    async with session.post(
        base_url + "/completion", data=STREAM_BODY, headers=STREAM_HEADERS
    ) as response:
        await fail_on_bad_status(response)
        first_chunk = await response.content.readany()
        elapsed = time.perf_counter() - started
        # Read the stream to its end, so llama-server finishes the task, and check its events.
        whole = first_chunk + await response.read()
    if not whole.startswith(b"data: "):
        raise BenchmarkError(f"POST {base_url}/completion streamed no events: {whole[:300]!r}")
    return elapsed


async def probe_arm(probe: Probe, session: aiohttp.ClientSession, arm: Arm) -> float:
    """Run `probe` against `arm`, naming the arm in any transport failure."""
    try:
        return await probe(session, arm.base_url)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchmarkError(f"{arm.name} arm ({arm.base_url}) failed: {exc!r}") from exc


# --- measurements ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Percentiles:
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class ThroughputRun:
    completed: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.completed / self.seconds


LATENCY_SERIES: dict[str, Probe] = {
    "GET /health": health_latency,
    "POST /completion (n_predict 1)": completion_latency,
    "POST /v1/chat/completions, new text (n_predict 1)": fresh_chat_latency,
    "POST /completion stream, first byte (n_predict 16)": first_streamed_byte_latency,
}


def percentiles(seconds: Sequence[float]) -> Percentiles:
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return Percentiles(p50_ms=statistics.median(seconds) * 1000, p99_ms=cuts[98] * 1000)


async def interleaved_samples(
    session: aiohttp.ClientSession, arms: Sequence[Arm], probe: Probe, rounds: int
) -> dict[str, list[float]]:
    """`rounds` sequential requests per arm, one arm after the other, round-robin."""
    samples: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for round_index in range(rounds):
        for arm in rotated(arms, round_index):
            samples[arm.name].append(await probe_arm(probe, session, arm))
    return samples


async def measure_latency(
    session: aiohttp.ClientSession, arms: Sequence[Arm], requests: int
) -> dict[str, dict[str, Percentiles]]:
    results: dict[str, dict[str, Percentiles]] = {}
    for series, probe in LATENCY_SERIES.items():
        progress(f"latency: {series}: {WARMUP_REQUESTS} warm-up + {requests} requests per arm")
        await interleaved_samples(session, arms, probe, WARMUP_REQUESTS)
        samples = await interleaved_samples(session, arms, probe, requests)
        results[series] = {name: percentiles(values) for name, values in samples.items()}
    return results


async def completions_until(session: aiohttp.ClientSession, arm: Arm, deadline: float) -> int:
    completed = 0
    while time.perf_counter() < deadline:
        await probe_arm(completion_latency, session, arm)
        completed += 1
    return completed


async def throughput_run(
    session: aiohttp.ClientSession, arm: Arm, concurrency: int, duration: float
) -> ThroughputRun:
    """`concurrency` clients in a closed loop for `duration` s; requests started count in full."""
    # One request per client first, so every connection (client and upstream side) is open.
    await asyncio.gather(*(probe_arm(completion_latency, session, arm) for _ in range(concurrency)))
    started = time.perf_counter()
    counts = await asyncio.gather(
        *(completions_until(session, arm, started + duration) for _ in range(concurrency))
    )
    return ThroughputRun(completed=sum(counts), seconds=time.perf_counter() - started)


async def measure_throughput(
    session: aiohttp.ClientSession, arms: Sequence[Arm], duration: float
) -> dict[int, dict[str, ThroughputRun]]:
    results: dict[int, dict[str, ThroughputRun]] = {}
    for level_index, concurrency in enumerate(CONCURRENCY_LEVELS):
        results[concurrency] = {}
        for arm in rotated(arms, level_index):
            progress(f"throughput: concurrency {concurrency}, {arm.name}, {duration:g} s")
            run = await throughput_run(session, arm, concurrency, duration)
            results[concurrency][arm.name] = run
    return results


async def measure_stream_cpu(
    session: aiohttp.ClientSession, processes: ProcessSet, arms: Sequence[Arm], duration: float
) -> dict[str, StreamCpu]:
    results = {}
    for arm in (arm for arm in arms if arm.name in ("bare", "proxy")):
        progress(f"CPU: {CPU_STREAMS} concurrent streams through {arm.name}, {duration:g} s")
        pid, url = processes.find(arm.name).process.pid, arm.base_url + "/completion"
        try:
            run = await stream_cpu(session, url, STREAM_BODY, pid, duration, CPU_STREAMS)
            results[arm.name] = run
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchmarkError(f"{arm.name} arm ({arm.base_url}) failed: {exc!r}") from exc
    return results


# --- the report -----------------------------------------------------------------------------


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
    test_bed: TestBed
    latency: dict[str, dict[str, Percentiles]]
    throughput: dict[int, dict[str, ThroughputRun]]
    stream_cpu: dict[str, StreamCpu]


THROUGHPUT_RATIOS = (("proxy", "direct"), ("bare", "direct"), ("proxy", "bare"))


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
    yield table_row(["concurrency", "direct req/s", "bare req/s", "proxy req/s", *ratio_names])
    yield table_row(["---:"] * (4 + len(ratio_names)))
    for concurrency, by_arm in sorted(throughput.items()):
        rates = {name: run.per_second for name, run in by_arm.items()}
        figures = [f"{rates[name]:.1f}" for name in ("direct", "bare", "proxy")]
        ratios = [f"{rates[top] / rates[bottom]:.3f}" for top, bottom in THROUGHPUT_RATIOS]
        yield table_row([str(concurrency), *figures, *ratios])


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
        "- the proxy runs with routing, a tenant (its key on every arm's requests) and the disk"
        " tier (archive folder = llama-server's --slot-save-path)",
        "",
        f"## Latency, ms ({report.requests} sequential requests per arm after "
        f"{WARMUP_REQUESTS} warm-up, arms interleaved round-robin)",
        "",
        "added = the arm's percentile minus direct's.",
        "",
        *latency_rows(report.latency),
        "",
        f"## Throughput, POST /completion n_predict 1 ({report.duration:g} s per arm and level, "
        "closed loop)",
        "",
        *throughput_rows(report.throughput),
        "",
        f"## CPU per relayed stream, {CPU_STREAMS} concurrent streams of 16 tokens"
        f" ({report.duration:g} s per arm; the process's user + system CPU time)",
        "",
        *stream_cpu_rows(report.stream_cpu),
    ]
    return "\n".join(lines)


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
        "warmup_requests": WARMUP_REQUESTS,
        "llama_server_command": report.test_bed.llama_server_command,
        "model": report.test_bed.model_name,
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
                    }
                    for name, run in by_arm.items()
                },
                "ratios": {
                    f"{top}/{bottom}": by_arm[top].per_second / by_arm[bottom].per_second
                    for top, bottom in THROUGHPUT_RATIOS
                },
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
    }


# --- the run --------------------------------------------------------------------------------


async def benchmark(
    processes: ProcessSet, requests: int, duration: float, command: str
) -> OverheadReport:
    # Taken before our own processes start: other work on the machine skews every arm.
    load_average = os.getloadavg()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        test_bed = await bring_up(processes, session)
        latency = await measure_latency(session, test_bed.arms, requests)
        throughput = await measure_throughput(session, test_bed.arms, duration)
        cpu = await measure_stream_cpu(session, processes, test_bed.arms, duration)
    return OverheadReport(
        command=command,
        cpu_count=os.cpu_count(),
        load_average=load_average,
        platform=platform.platform(),
        python=platform.python_version(),
        aiohttp=aiohttp.__version__,
        requests=requests,
        duration=duration,
        test_bed=test_bed,
        latency=latency,
        throughput=throughput,
        stream_cpu=cpu,
    )


def run_overhead_benchmark(requests: int, duration: float, json_path: str | None = None) -> int:
    """Run the whole benchmark, print the figures as Markdown; return an exit code."""
    if requests < 2 or duration <= 0:
        print("--requests must be at least 2 and --duration positive", file=sys.stderr)
        return 2
    command = invoked_command()
    code, report = run_with_processes(
        "cacheproxy-bench-", lambda processes: benchmark(processes, requests, duration, command)
    )
    if report is None:
        return code
    print(render_markdown(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report_as_json(report), indent=2) + "\n")
        progress(f"figures written to {json_path}")
    return 0
