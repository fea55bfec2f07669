"""What the proxy adds to latency and takes from throughput, against the direct path, in one run.

One llama-server is started, with two processes in front of it: the bare aiohttp pass-through
(`cacheproxy.bench.passthrough`, the least any aiohttp proxy costs) and `cacheproxy serve`.
The same requests go to the three arms, interleaved so that machine noise hits all alike, and the
figures are printed as Markdown, with the added latency and the throughput ratios against direct.
It asserts nothing about speed: it measures.

The proxy runs with every feature on: routing, a tenant (its key on every arm's requests), the
disk tier (in llama-server's `--slot-save-path`), the usage ledger and rate limits and budgets
(set far above what a run uses, so every request is metered and none refused). Throughput runs
alternate the arms in `--rounds` rounds, so that the machine's other load falls on all alike;
each front process's CPU time over its runs is divided by the requests it served. Last, 64
streams at once through each front process, whose CPU time is divided by the streams and
tokens relayed (`stream_cpu.py`). On a machine where llama-server and the proxy share the CPUs,
every microsecond of the proxy's CPU per request is taken from the server: the CPU figures are
steadier than throughput when the machine is shared. A fourth front, the bare pass-through
spending `--calibrate-us` (100; 0: none) microseconds more CPU a request, runs at concurrency 8
beside the bare one and the proxy: what a microsecond of a front's CPU costs in throughput here
(`Calibration`). With `--upstream-tls`, llama-server serves https and every arm reaches it there.

`cacheproxy bench overhead --requests 400 --duration 5 --rounds 3 [--json figures.json]`.
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
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp

from cacheproxy.bench.harness import (
    HOST,
    JSON_HEADERS,
    STREAM_HEADERS,
    BenchmarkError,
    ProcessSet,
    fail_on_bad_status,
    invoked_command,
    main_thread_waiting_s,
    process_cpu_s,
    progress,
    rotated,
    run_with_processes,
)
from cacheproxy.bench.overhead_bed import bring_up
from cacheproxy.bench.overhead_report import (
    CPU_STREAMS,
    HEADLINE_CONCURRENCY,
    WARMUP_REQUESTS,
    Arm,
    Calibration,
    OverheadReport,
    Percentiles,
    TestBed,
    ThroughputRun,
    render_markdown,
    report_as_json,
)
from cacheproxy.bench.overhead_routes import measure_routes
from cacheproxy.bench.run_counters import decode_fill, server_counters
from cacheproxy.bench.server_threads import idle_cpu_ms, ms_per_token
from cacheproxy.bench.stream_cpu import StreamCpu, stream_cpu
from cacheproxy.bench.tls_bed import make_tls_files

# Eight fixed ordinary-vocabulary token ids: a real prompt, identical for every request and arm.
PROMPT_TOKENS = (1000, 2345, 4567, 7890, 12000, 15555, 21000, 29000)
COMPLETION_BODY = json.dumps({"prompt": PROMPT_TOKENS, "n_predict": 1, "temperature": 0}).encode()
STREAM_BODY = json.dumps(
    {"prompt": PROMPT_TOKENS, "n_predict": 16, "temperature": 0, "stream": True}
).encode()
CONCURRENCY_LEVELS = (1, 8, 32)
REQUEST_TIMEOUT_S = 60.0


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
    session: aiohttp.ClientSession,
    arm: Arm,
    concurrency: int,
    duration: float,
    pid: int | None,
    server_url: str,
    server_pid: int | None = None,
) -> ThroughputRun:
    """`concurrency` clients in a closed loop for `duration` s; requests started count in full.
    With `pid`, that process's CPU time over the run, and how long its main thread waited for
    a CPU meanwhile. Always, how full llama-server (at `server_url`) kept its batches; with
    `server_pid`, its CPU time over the run too."""
    # One request per client first, so every connection (client and upstream side) is open.
    await asyncio.gather(*(probe_arm(completion_latency, session, arm) for _ in range(concurrency)))
    server_before = await server_counters(session, server_url)
    started = time.perf_counter()
    cpu_before = 0.0 if pid is None else process_cpu_s(pid)
    server_cpu_before = 0.0 if server_pid is None else process_cpu_s(server_pid)
    waiting_before = 0.0 if pid is None else main_thread_waiting_s(pid)
    counts = await asyncio.gather(
        *(completions_until(session, arm, started + duration) for _ in range(concurrency))
    )
    seconds = time.perf_counter() - started
    cpu_s = None if pid is None else process_cpu_s(pid) - cpu_before
    server_cpu_s = None if server_pid is None else process_cpu_s(server_pid) - server_cpu_before
    waiting_s = None if pid is None else main_thread_waiting_s(pid) - waiting_before
    server_after = await server_counters(session, server_url)
    fill = decode_fill(server_before, server_after)  # decode calls, busy slots they ran
    return ThroughputRun(sum(counts), seconds, cpu_s, waiting_s, *fill, server_cpu_s)


async def alternated_runs(
    session: aiohttp.ClientSession,
    arms: Sequence[Arm],
    concurrency: int,
    duration: float,
    rounds: int,
    pids: dict[str, int],
    server_url: str,
    server_pid: int | None = None,
    first_turn: int = 0,
    what: str = "throughput",
) -> tuple[dict[str, ThroughputRun], list[dict[str, float]]]:
    """`rounds` rounds of one run per arm at `concurrency`, the arms in another order each
    round (starting at `first_turn`): each arm's runs added up, and each round's requests a
    second by arm."""
    runs: dict[str, ThroughputRun] = {}
    by_round: list[dict[str, float]] = []
    for round_index in range(rounds):
        this_round: dict[str, float] = {}
        for arm in rotated(arms, first_turn + round_index):
            progress(
                f"{what}: concurrency {concurrency}, round {round_index + 1}/{rounds},"
                f" {arm.name}, {duration:g} s"
            )
            run = await throughput_run(
                session, arm, concurrency, duration, pids.get(arm.name), server_url, server_pid
            )
            this_round[arm.name] = run.per_second
            done = runs.get(arm.name)
            runs[arm.name] = run if done is None else done + run
        by_round.append(this_round)
    return runs, by_round


async def measure_throughput(
    session: aiohttp.ClientSession,
    arms: Sequence[Arm],
    front_pids: dict[str, int],
    duration: float,
    rounds: int,
    server_url: str,
    server_pid: int | None = None,
) -> tuple[dict[int, dict[str, ThroughputRun]], dict[int, list[float]]]:
    """Per level, `rounds` rounds of one run per arm, the arms in another order each round:
    each arm's runs added up, and proxy/bare within each round (llama-server's counters read at
    `server_url`)."""
    results: dict[int, dict[str, ThroughputRun]] = {}
    round_ratios: dict[int, list[float]] = {}
    for level_index, concurrency in enumerate(CONCURRENCY_LEVELS):
        results[concurrency], by_round = await alternated_runs(
            session, arms, concurrency, duration, rounds, front_pids, server_url, server_pid,
            first_turn=level_index,
        )  # fmt: skip
        round_ratios[concurrency] = [rates["proxy"] / rates["bare"] for rates in by_round]
    return results, round_ratios


async def measure_calibration(
    session: aiohttp.ClientSession,
    processes: ProcessSet,
    test_bed: TestBed,
    burn_us: float,
    duration: float,
    rounds: int,
) -> Calibration:
    """The bare pass-through, the calibration arm and the proxy at `HEADLINE_CONCURRENCY`,
    alternated in `rounds` rounds; each arm's runs added up."""
    assert test_bed.calibrated is not None
    by_name = {arm.name: arm for arm in test_bed.arms}
    arms = (by_name["bare"], test_bed.calibrated, by_name["proxy"])
    pids = {arm.name: processes.find(arm.name).process.pid for arm in arms}
    runs, _ = await alternated_runs(
        session, arms, HEADLINE_CONCURRENCY, duration, rounds, pids, test_bed.server_url,
        what="calibration",
    )  # fmt: skip
    return Calibration(burn_us, runs)


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


# --- the run --------------------------------------------------------------------------------


async def benchmark(
    processes: ProcessSet,
    requests: int,
    duration: float,
    rounds: int,
    command: str,
    server_args: tuple[str, ...] = (),
    route_requests: int = 150,
    chat_tokens: bool = False,
    calibrate_us: float = 0.0,
    upstream_tls: bool = False,
) -> OverheadReport:
    # Taken before our own processes start: other work on the machine skews every arm.
    load_average = os.getloadavg()
    tls = make_tls_files(processes.workdir / "tls", HOST) if upstream_tls else None
    # llama-server drops a connection idle for 5 s: the direct arm's would be dead after the
    # other arms' runs, so the load generator gives them up sooner
    connector = aiohttp.TCPConnector(
        limit=0, keepalive_timeout=4.0, ssl=tls.client_context() if tls else True
    )
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        test_bed = await bring_up(processes, session, server_args, chat_tokens, calibrate_us, tls)
        server_pid, server_url = processes.find("llama-server").process.pid, test_bed.server_url
        progress("llama-server's CPU while idle after an answer, and its time a generated token")
        idle_ms = await idle_cpu_ms(session, server_url, server_pid, list(PROMPT_TOKENS))
        token_ms = await ms_per_token(session, server_url, list(PROMPT_TOKENS))
        latency = await measure_latency(session, test_bed.arms, requests)
        front_pids = {name: processes.find(name).process.pid for name in ("bare", "proxy")}
        throughput, round_ratios = await measure_throughput(
            session, test_bed.arms, front_pids, duration, rounds, server_url, server_pid
        )
        cpu = await measure_stream_cpu(session, processes, test_bed.arms, duration)
        routes = await measure_routes(
            session,
            (*test_bed.arms, test_bed.timed),
            {name: processes.find(name).process.pid for name in ("bare", "proxy", "timed")},
            {"Authorization": f"Bearer {test_bed.admin_key}"},
            route_requests,
            rounds,
        )
        calibration = None
        if calibrate_us > 0:
            calibration = await measure_calibration(
                session, processes, test_bed, calibrate_us, duration, rounds
            )
    return OverheadReport(
        command=command,
        cpu_count=os.cpu_count(),
        load_average=load_average,
        platform=platform.platform(),
        python=platform.python_version(),
        aiohttp=aiohttp.__version__,
        requests=requests,
        duration=duration,
        rounds=rounds,
        test_bed=test_bed,
        latency=latency,
        throughput=throughput,
        stream_cpu=cpu,
        round_ratios=round_ratios,
        routes=routes,
        calibration=calibration,
        server_idle_cpu_ms=idle_ms,
        server_ms_per_token=token_ms,
    )


def run_overhead_benchmark(
    requests: int,
    duration: float,
    json_path: str | None = None,
    rounds: int = 3,
    server_args: str | Sequence[str] = "",
    route_requests: int = 150,
    chat_tokens: bool = False,
    calibrate_us: float = 0.0,
    upstream_tls: bool = False,
) -> int:
    """Run the whole benchmark, print the figures as Markdown; return an exit code.
    `server_args`: extra llama-server flags, as a shell would split them; several: the whole
    benchmark once with each (a fresh llama-server and front processes), one report each.
    `upstream_tls`: llama-server over https (bench/tls_bed.py)."""
    if requests < 2 or duration <= 0 or rounds < 1 or route_requests < 2 or calibrate_us < 0:
        print(
            "--requests and --route-requests must be at least 2, --duration positive,"
            " --rounds at least 1 and --calibrate-us not negative",
            file=sys.stderr,
        )
        return 2
    command = invoked_command()
    settings = [server_args] if isinstance(server_args, str) else list(server_args)
    reports = []
    for flags in settings:
        code, report = run_with_processes(
            "cacheproxy-bench-",
            lambda processes, flags=flags: benchmark(
                processes,
                requests,
                duration,
                rounds,
                command,
                tuple(shlex.split(flags)),
                route_requests,
                chat_tokens,
                calibrate_us,
                upstream_tls,
            ),
        )
        if report is None:
            return code
        print(render_markdown(report), flush=True)
        reports.append(report)
    if json_path is not None:
        figures = [report_as_json(report) for report in reports]
        Path(json_path).write_text(
            json.dumps(figures[0] if len(figures) == 1 else figures, indent=2) + "\n"
        )
        progress(f"figures written to {json_path}")
    return 0
