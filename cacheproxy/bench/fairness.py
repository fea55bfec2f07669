"""`cacheproxy bench fairness`: does a heavy tenant delay a light one?

Two tenants on one llama-server with 4 slots (`-np 4`), the proxy in front as a separate
process. Both send the same request shape (a fresh prompt of token ids, so nothing is reused,
and a few generated tokens, streamed); arrivals are open-loop Poisson, the heavy tenant's at
`overload` times what the server can serve (measured first), the light tenant's 20 times
less. The heavy tenant's queue thus grows until a bound refuses it: its own bound with fair
share (429), the whole queue's without (503).

The light tenant's time to first token (TTFT) is measured in five arms: (a) alone, (b) with
the heavy tenant, fair share on (default settings: per-tenant queue bound 64, the slot share
with its 5 s window), (d) the same with the heavy tenant also capped at one request fewer than
the slots (`max_concurrent`), a static form of what the slot share does, (e) fair share with
`share_window_s = 0`: only a tenant with a request in the proxy has a share kept for it, so the
heavy tenant takes every slot while no light request is in, (f) fair share with chunked prefill
off (`prefill_chunk_ms = 0`): the heavy tenant's prompts computed whole, so a light prompt
arriving during one waits for all of it (and what chunking costs the heavy tenant shows in its
completed requests, (b) against (f)), and (c) the proxy as it was before
fair share: `scheduling.fair_share = false` (one FIFO) and no per-tenant bound below the total
one (256).
The target: the light tenant's p99 at most 2x its p99 alone under fair share.

`cacheproxy bench fairness [--duration 30] [--overload 1.5] [--ratio 20] [--json FILE]`
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson

from cacheproxy.bench.harness import (
    HOST,
    STREAM_HEADERS,
    BenchmarkError,
    ProcessSet,
    invoked_command,
    progress,
    proxy_command,
    run_with_processes,
    wait_healthy,
)
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.upstreams.managed import free_port, llama_server_args

SLOTS = 4
MAX_QUEUE = 256  # routing.max_queue's default
TARGET_RATIO = 2.0
CALIBRATION_S = 6.0
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Load:
    duration_s: float
    overload: float
    ratio: float
    prompt_tokens: int
    n_predict: int
    seed: int


@dataclass
class ArmResult:
    name: str
    light_ttft_ms: list[float] = field(default_factory=list)
    light_status: Counter[int] = field(default_factory=Counter)
    heavy_status: Counter[int] = field(default_factory=Counter)

    def quantile(self, q: int) -> float | None:
        """The q-th percentile of the light tenant's TTFT (None: too few answers)."""
        if len(self.light_ttft_ms) < 2:
            return None
        return statistics.quantiles(self.light_ttft_ms, n=100, method="inclusive")[q - 1]


@dataclass
class Report:
    command: str
    capacity_rps: float
    heavy_rps: float
    light_rps: float
    load: Load
    arms: list[ArmResult]


class Tenants:
    def __init__(self, session: aiohttp.ClientSession, keys: dict[str, str], load: Load) -> None:
        self.session = session
        self.keys = keys
        self.load = load
        self.rng = random.Random(load.seed)

    def body(self) -> bytes:
        prompt = [self.rng.randrange(300, 31000) for _ in range(self.load.prompt_tokens)]
        return orjson.dumps(
            {"prompt": prompt, "n_predict": self.load.n_predict, "stream": True, "temperature": 0}
        )

    async def request(self, url: str, tenant: str) -> tuple[int, float | None]:
        """The status and, for a 200, the time to the first streamed token in ms."""
        headers = {**STREAM_HEADERS, "Authorization": f"Bearer {self.keys[tenant]}"}
        started = time.perf_counter()
        first = None
        async with self.session.post(
            url + "/completion", data=self.body(), headers=headers
        ) as response:
            if response.status != 200:
                await response.read()
                return response.status, None
            async for line in response.content:
                if first is None and line.startswith(b"data: "):
                    first = time.perf_counter()
        if first is None:
            raise BenchmarkError("a stream ended without any event")
        return 200, (first - started) * 1000

    async def capacity(self, url: str) -> float:
        """Requests per second the server completes with every slot busy (closed loop)."""
        done = 0
        deadline = time.perf_counter() + CALIBRATION_S

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                status, _ = await self.request(url, "heavy")
                if status != 200:
                    raise BenchmarkError(f"calibration request answered {status}")
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(SLOTS * 2)))
        return done / (time.perf_counter() - started)

    async def arm(
        self, name: str, url: str, light_rps: float, heavy_rps: float | None
    ) -> ArmResult:
        """Open-loop arrivals for `duration_s`, then every answer awaited."""
        result = ArmResult(name)
        tasks: list[asyncio.Task[None]] = []

        async def light() -> None:
            status, ttft = await self.request(url, "light")
            result.light_status[status] += 1
            if ttft is not None:
                result.light_ttft_ms.append(ttft)

        async def heavy() -> None:
            status, _ = await self.request(url, "heavy")
            result.heavy_status[status] += 1

        async def arrivals(rate: float, send) -> None:  # noqa: ANN001 - one of the two above
            rng = random.Random(self.rng.random())
            end = time.perf_counter() + self.load.duration_s
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() >= end:
                    return
                tasks.append(asyncio.ensure_future(send()))

        streams = [arrivals(light_rps, light)]
        if heavy_rps is not None:
            streams.append(arrivals(heavy_rps, heavy))
        await asyncio.gather(*streams)
        await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S)
        return result


def start_server(processes: ProcessSet) -> str:
    port = free_port(HOST)
    (processes.workdir / "slots").mkdir()
    args = llama_server_args(
        ensure_llama_server(),
        ensure_model("small"),
        host=HOST,
        port=port,
        parallel=SLOTS,
        ctx_size=SLOTS * 2048,
        cache_ram_mib=0,
        slot_save_path=processes.workdir / "slots",
        # one thread: on a shared machine, threads that wait for each other are descheduled
        # and a 100-token prefill takes seconds; one thread keeps the timings about the queue
        extra_args=("--threads", "1", "--threads-batch", "1"),
    )
    processes.start("llama-server", args)
    return f"http://{HOST}:{port}"


def start_proxy(
    processes: ProcessSet,
    name: str,
    upstream: str,
    fair_share: bool,
    share_window_s: float | None = None,
    prefill_chunk_ms: float | None = None,
) -> str:
    port = free_port(HOST)
    env = {
        **os.environ,
        "CACHEPROXY_STATE_DIR": str(processes.workdir / f"state-{name}"),
        "CACHEPROXY_TENANTS__DATABASE": str(processes.workdir / "tenants.db"),
        # the scheduler is measured, not the disk tier: fresh prompts are worth no archive
        "CACHEPROXY_DISK__ENABLED": "false",
        "CACHEPROXY_SCHEDULING__FAIR_SHARE": "true" if fair_share else "false",
    }
    if not fair_share:  # the proxy as it was before fair share: one FIFO, one bound for all
        env["CACHEPROXY_SCHEDULING__MAX_QUEUE_PER_TENANT"] = str(MAX_QUEUE)
    if share_window_s is not None:
        env["CACHEPROXY_SCHEDULING__SHARE_WINDOW_S"] = str(share_window_s)
    if prefill_chunk_ms is not None:
        env["CACHEPROXY_SCHEDULING__PREFILL_CHUNK_MS"] = str(prefill_chunk_ms)
    processes.start(f"proxy-{name}", proxy_command(upstream, port), env=env)
    return f"http://{HOST}:{port}"


async def run(processes: ProcessSet, load: Load) -> Report:
    upstream = start_server(processes)
    with TenantRegistry(processes.workdir / "tenants.db") as registry:
        keys = {name: registry.create(name)[1] for name in ("light", "heavy")}
        heavy_id = registry.list()[1].id
    connector = aiohttp.TCPConnector(limit=0)  # the client must not queue what the proxy should
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await wait_healthy(session, processes.find("llama-server"), upstream)
        tenants = Tenants(session, keys, load)
        fair_url = start_proxy(processes, "fair", upstream, fair_share=True)
        await wait_healthy(session, processes.find("proxy-fair"), fair_url)
        progress(f"measuring what {SLOTS} slots serve ({CALIBRATION_S:.0f} s)")
        capacity = await tenants.capacity(fair_url)
        heavy_rps = capacity * load.overload
        light_rps = heavy_rps / load.ratio
        progress(
            f"capacity {capacity:.1f} req/s; heavy {heavy_rps:.1f} req/s, light {light_rps:.2f}"
            f" req/s, {load.duration_s:.0f} s per arm"
        )
        arms = []
        progress("(a) the light tenant alone")
        arms.append(await tenants.arm("(a) light alone", fair_url, light_rps, None))
        progress("(b) with the heavy tenant, fair share")
        arms.append(await tenants.arm("(b) + heavy, fair share", fair_url, light_rps, heavy_rps))
        with TenantRegistry(processes.workdir / "tenants.db") as registry:
            registry.update(heavy_id, max_concurrent=SLOTS - 1)
        await asyncio.sleep(1.0)  # the proxy re-reads the registry within 0.25 s
        progress(f"(d) fair share, heavy capped at {SLOTS - 1} concurrent requests")
        arms.append(
            await tenants.arm(
                f"(d) + heavy, fair share, heavy max_concurrent {SLOTS - 1}",
                fair_url,
                light_rps,
                heavy_rps,
            )
        )
        processes.stop_named("proxy-fair")
        with TenantRegistry(processes.workdir / "tenants.db") as registry:
            registry.update(heavy_id, max_concurrent=None)
        # the other arms, each on a proxy of its own: (name, label, start_proxy's settings)
        others: list[tuple[str, str, dict]] = [
            ("no-window", "(e) + heavy, fair share, share_window_s 0", {"share_window_s": 0}),
            ("whole", "(f) + heavy, fair share, prefill_chunk_ms 0", {"prefill_chunk_ms": 0}),
            ("fifo", "(c) + heavy, global FIFO", {"fair_share": False}),
        ]
        for name, label, settings in others:
            url = start_proxy(processes, name, upstream, **{"fair_share": True, **settings})
            await wait_healthy(session, processes.find(f"proxy-{name}"), url)
            progress(label)
            arms.append(await tenants.arm(label, url, light_rps, heavy_rps))
            processes.stop_named(f"proxy-{name}")
    return Report(invoked_command(), capacity, heavy_rps, light_rps, load, arms)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def _statuses(counts: Counter[int]) -> str:
    return ", ".join(f"{status}: {n}" for status, n in sorted(counts.items())) or "-"


def render(report: Report) -> str:
    load = report.load
    alone = report.arms[0]
    lines = [
        "# cacheproxy fairness benchmark",
        "",
        f"- command: `{report.command}`",
        f"- machine: {os.cpu_count()} CPUs; one llama-server, -np {SLOTS}, the small test"
        f" model, one thread; prompts of {load.prompt_tokens} fresh token ids,"
        f" {load.n_predict} tokens generated, streamed; disk tier off",
        f"- capacity measured {report.capacity_rps:.1f} req/s; heavy tenant"
        f" {report.heavy_rps:.1f} req/s ({load.overload}x capacity), light tenant"
        f" {report.light_rps:.2f} req/s (1/{load.ratio:g}), Poisson, {load.duration_s:.0f} s"
        " per arm",
        "",
        "| arm | light answers | light TTFT p50 ms | p99 ms | p50 vs alone | p99 vs alone"
        " | heavy answers |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for arm in report.arms:
        lines.append(
            f"| {arm.name} | {_statuses(arm.light_status)} | {_ms(arm.quantile(50))} |"
            f" {_ms(arm.quantile(99))} | {_ratio(arm.quantile(50), alone.quantile(50))} |"
            f" {_ratio(arm.quantile(99), alone.quantile(99))} | {_statuses(arm.heavy_status)} |"
        )
    fair = report.arms[1]
    fifo = report.arms[-1]
    grown = None
    if fair.quantile(99) and alone.quantile(99):
        grown = fair.quantile(99) / alone.quantile(99)
    verdict = "-" if grown is None else ("met" if grown <= TARGET_RATIO else "MISSED")
    lines += [
        "",
        f"- target: light p99 with the heavy tenant under fair share at most {TARGET_RATIO:g}x"
        f" alone: {_ratio(fair.quantile(99), alone.quantile(99))}, {verdict}",
        f"- fair share against the global FIFO, light p99:"
        f" {_ms(fair.quantile(99))} ms vs {_ms(fifo.quantile(99))} ms"
        f" ({_ratio(fifo.quantile(99), fair.quantile(99))} slower under FIFO)",
    ]
    return "\n".join(lines)


def as_json(report: Report) -> dict:
    """The report as JSON: statuses by code (asdict would rebuild a Counter from its pairs),
    and each arm's percentiles beside its samples."""
    arms = [
        {
            "name": arm.name,
            "light_ttft_ms": arm.light_ttft_ms,
            "light_ttft_p50_ms": arm.quantile(50),
            "light_ttft_p99_ms": arm.quantile(99),
            "light_status": {str(code): n for code, n in arm.light_status.items()},
            "heavy_status": {str(code): n for code, n in arm.heavy_status.items()},
        }
        for arm in report.arms
    ]
    return {
        "command": report.command,
        "capacity_rps": report.capacity_rps,
        "heavy_rps": report.heavy_rps,
        "light_rps": report.light_rps,
        "load": asdict(report.load),
        "arms": arms,
    }


def run_fairness_benchmark(
    duration_s: float,
    overload: float,
    ratio: float,
    prompt_tokens: int,
    n_predict: int,
    seed: int,
    json_path: Path | None,
) -> int:
    load = Load(duration_s, overload, ratio, prompt_tokens, n_predict, seed)
    code, report = run_with_processes(
        "cacheproxy-fairness-", lambda processes: run(processes, load)
    )
    if report is None:
        return code
    print(render(report))
    if json_path is not None:
        json_path.write_text(json.dumps(as_json(report), indent=2))
    return 0
