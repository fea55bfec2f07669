"""Does a flood of huge request bodies stall the proxy? `/health` latency and memory, measured.

One llama-server and `cacheproxy serve` (a subprocess, as deployed) are started. `/health` is
probed through the proxy every 10 ms, from a process of its own, first with nothing else going
on (the baseline), then while N clients each send a ~90 MB body at once: an id-array prompt,
then a string prompt. Printed: `/health` latency p50/p99/max per phase with its ratio to the
baseline, how the big requests were answered, and the proxy's peak memory (VmHWM of its main
process, and the sampled peak of its whole process tree: a body parser worker is a child).
It asserts nothing: it measures.

`cacheproxy bench bodies --clients 4 --mb 90`, or `python -m cacheproxy.bench.bodies`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from cacheproxy.bench.harness import HOST, ProcessSet, progress, proxy_command, wait_healthy
from cacheproxy.bench.overhead_bed import start_llama_server
from cacheproxy.upstreams.managed import free_port

PROBE_INTERVAL_S = 0.010
BASELINE_S = 5.0
REQUEST_TIMEOUT_S = 600.0
SAMPLE_INTERVAL_S = 0.05


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def id_array_body(megabytes: int) -> bytes:
    """A completion whose prompt is an id array of about `megabytes` MB (ordinary ids)."""
    count = megabytes * 1_000_000 // 6  # "12345," is six bytes
    return orjson.dumps({"prompt": [10000 + i % 20000 for i in range(count)], "n_predict": 1})


def string_body(megabytes: int) -> bytes:
    return orjson.dumps({"prompt": "hello world " * (megabytes * 1_000_000 // 12), "n_predict": 1})


BODY_KINDS = {"ids": ("id-array prompts", id_array_body), "text": ("string prompts", string_body)}


def tree_rss_kib(pid: int) -> int:
    """Resident memory of a process and its descendants, from /proc."""
    total = 0
    for entry in [pid, *descendants(pid)]:
        total += status_kib(entry, "VmRSS")
    return total


def status_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


async def probe_until_stdin_closes(url: str) -> dict:
    """GET /health every 10 ms until stdin closes (a late probe is measured, not repeated).

    It runs in a process of its own: the load generator copying 90 MB bodies into sockets
    would otherwise delay the probes it times."""
    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, sys.stdin.buffer.read)
    latencies: list[float] = []
    failures = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        print("ready", flush=True)
        while not stop.done():
            started = time.perf_counter()
            try:
                async with session.get(url + "/health") as response:
                    await response.read()
                    failures += response.status != 200
            except (aiohttp.ClientError, TimeoutError):
                failures += 1
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(PROBE_INTERVAL_S)
    return {"latencies": latencies, "failures": failures}


async def start_prober(url: str) -> asyncio.subprocess.Process:
    prober = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cacheproxy.bench.bodies",
        "--probe",
        url,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert prober.stdout is not None
    await prober.stdout.readline()  # "ready"
    return prober


async def finish_prober(prober: asyncio.subprocess.Process, phase: Phase) -> None:
    output, _ = await prober.communicate(b"")  # closing stdin ends the probing
    figures = orjson.loads(output.splitlines()[-1])
    phase.latencies, phase.failures = figures["latencies"], figures["failures"]


async def sample_memory(pid: int, peak: list[int], until: asyncio.Event) -> None:
    while not until.is_set():
        peak[0] = max(peak[0], tree_rss_kib(pid))
        await asyncio.sleep(SAMPLE_INTERVAL_S)


async def send_big(session: aiohttp.ClientSession, url: str, body: bytes, phase: Phase) -> None:
    try:
        async with session.post(
            url + "/completion", data=body, headers={"Content-Type": "application/json"}
        ) as response:
            payload = await response.read()
            kind = ""
            with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError):
                kind = orjson.loads(payload)["error"]["type"]
            phase.answers[f"{response.status} {kind}".strip()] += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        phase.answers[type(exc).__name__] += 1


async def run_phase(
    session: aiohttp.ClientSession,
    url: str,
    name: str,
    bodies: list[bytes],
    proxy_pid: int,
    peak: list[int],
) -> Phase:
    phase = Phase(name)
    done = asyncio.Event()
    prober = await start_prober(url)
    sampling = asyncio.create_task(sample_memory(proxy_pid, peak, done), name="memory-sampler")
    started = time.perf_counter()
    if bodies:
        await asyncio.gather(*(send_big(session, url, body, phase) for body in bodies))
    else:
        await asyncio.sleep(BASELINE_S)
    phase.seconds = time.perf_counter() - started
    done.set()
    await asyncio.gather(finish_prober(prober, phase), sampling)
    return phase


def render(phases: list[Phase], hwm_kib: int, tree_peak_kib: int, clients: int, mb: int) -> str:
    baseline = phases[0]
    lines = [
        f"## /health under {clients} concurrent ~{mb} MB bodies",
        "",
        "| phase | probes | p50 ms | p99 ms | max ms | p99 / baseline | failed | big answers"
        " | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in phases:
        p99 = phase.quantile(0.99)
        answers = ", ".join(f"{count}x {what}" for what, count in sorted(phase.answers.items()))
        p50 = statistics.median(phase.latencies)
        lines.append(
            f"| {phase.name} | {len(phase.latencies)} | {p50 * 1e3:.1f}"
            f" | {p99 * 1e3:.1f} | {max(phase.latencies) * 1e3:.1f}"
            f" | {p99 / baseline.quantile(0.99):.1f} | {phase.failures} | {answers or '-'}"
            f" | {phase.seconds:.1f} |"
        )
    lines += [
        "",
        f"- proxy main process peak RSS (VmHWM): {hwm_kib / 1024:.0f} MiB",
        f"- proxy process tree peak RSS (sampled every {SAMPLE_INTERVAL_S * 1000:.0f} ms,"
        f" body parser worker included): {tree_peak_kib / 1024:.0f} MiB",
    ]
    return "\n".join(lines)


async def measure(clients: int, megabytes: int, kinds: list[str], workdir: Path) -> str:
    processes = ProcessSet(workdir)
    try:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            upstream, _, _ = start_llama_server(processes)
            await wait_healthy(session, processes.find("llama-server"), upstream)
            port = free_port(HOST)
            env = {**os.environ, "CACHEPROXY_STATE_DIR": str(workdir / "proxy-state")}
            processes.start("proxy", proxy_command(upstream, port), env=env)
            url = f"http://{HOST}:{port}"
            await wait_healthy(session, processes.find("proxy"), url)
            pid = processes.find("proxy").process.pid
            peak = [0]
            progress("baseline: /health alone")
            phases = [await run_phase(session, url, "baseline", [], pid, peak)]
            for kind in kinds:
                name, make = BODY_KINDS[kind]
                body = make(megabytes)
                progress(f"{name}: {clients} x {len(body) / 1e6:.0f} MB")
                phases.append(await run_phase(session, url, name, [body] * clients, pid, peak))
                del body
            hwm = status_kib(pid, "VmHWM")
            return render(phases, hwm, peak[0], clients, megabytes)
    except BaseException:
        processes.print_log_tails()
        raise
    finally:
        processes.stop_all()


def run_bodies_benchmark(
    clients: int = 4, megabytes: int = 90, kinds: list[str] | None = None
) -> int:
    with tempfile.TemporaryDirectory(prefix="cacheproxy-bench-bodies-") as workdir:
        print(asyncio.run(measure(clients, megabytes, kinds or list(BODY_KINDS), Path(workdir))))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4, help="big bodies sent at once")
    parser.add_argument("--mb", type=int, default=90, help="size of each body, MB")
    parser.add_argument("--kinds", nargs="+", choices=sorted(BODY_KINDS), default=list(BODY_KINDS))
    parser.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)  # the prober's mode
    args = parser.parse_args(argv)
    if args.probe:
        print(orjson.dumps(asyncio.run(probe_until_stdin_closes(args.probe))).decode())
        return 0
    return run_bodies_benchmark(args.clients, args.mb, args.kinds)


if __name__ == "__main__":
    sys.exit(main())
