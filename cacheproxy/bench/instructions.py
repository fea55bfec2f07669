"""The instructions a front process executes per request, counted by callgrind: a figure of
the proxy's work that the machine's other load barely moves.

CPU seconds per request (`bench overhead`) follow the machine: on a shared 2-core machine the
same bare pass-through measured 350 to 750 us a request from one run to the next (one client,
llama-server at one thread), so a change of a few percent in the proxy's work cannot show
there. The instructions a process executes follow the work it does, not what else runs (all
but its background loops, which tick by the clock: a run beside the full test suite read up to 2%
more a request than a quiet one, so figures to compare come from quiet runs): each
front process is started under `valgrind --tool=callgrind` with counting off; per route, after
`--warmup` requests, its counters are zeroed and counting turned on for a window of half
`--requests` requests sent one at a time, then the counters are dumped (`callgrind_control`),
window after window until two in a row agree (a front's one-time work, such as the proxy
proving its in-process tokenizer in the background, then no longer shows). Everything the
process runs meanwhile counts: its other threads, and its background loops (which, under
callgrind's slowdown, run more often a request than at full speed). Instructions are not time
(a cache miss costs more than an add); they show a change in the work itself.

Fronts, one after another in front of one llama-server (`overhead_bed.LLAMA_SERVER_OPTIONS`):
the bare aiohttp pass-through, the proxy as `bench overhead` runs it (a tenant, its limits, the
disk tier, the ledger), and the proxy with one feature off each (`--arms`), which gives what
that feature costs a request. Routes: `/completion` of token ids, and a chat of a system prompt
and a fresh question over `/v1/chat/completions` and `/v1/messages` (overhead_routes.py).

`cacheproxy bench instructions --requests 100 [--json figures.json]`; needs valgrind
(`cacheproxy testbed valgrind`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from cacheproxy.bench.bytecodes import Bytecodes, measure_bytecodes
from cacheproxy.bench.bytecodes import render_markdown as render_bytecodes
from cacheproxy.bench.harness import (
    HOST,
    BenchmarkError,
    ProcessSet,
    create_tenant,
    invoked_command,
    progress,
    proxy_command,
    run_with_processes,
    table_row,
    wait_healthy,
)
from cacheproxy.bench.instruction_fronts import (
    FRONT_NAMES,
    FRONTS,
    STEADY_SHARE,
    CountingBed,
    Front,
    count_windows,
    front_env,
    send,
    steady,
    window_size,
)
from cacheproxy.bench.overhead_bed import passthrough_command, start_llama_server
from cacheproxy.bench.overhead_routes import ROUTES
from cacheproxy.provision.valgrind import ValgrindUnavailable, ensure_valgrind
from cacheproxy.upstreams.managed import free_port


@dataclass(frozen=True)
class Counted:
    """Instructions a request in the last two windows of `window` requests each; `steady`:
    they agreed (else the figure still held a front's one-time work)."""

    windows: list[float]
    window: int
    steady: bool

    @property
    def per_request(self) -> float:
        return sum(self.windows) / len(self.windows)

    def __str__(self) -> str:
        shown = ", ".join(f"{count / 1e6:.3f}" for count in self.windows)
        unsteady = "" if self.steady else ", not steady"
        return f"{self.per_request / 1e6:.3f} M instructions a request ({shown}{unsteady})"


@dataclass
class InstructionsReport:
    command: str
    llama_server_command: str
    requests: int
    warmup: int
    fronts: list[Front]
    per_request: dict[str, dict[str, Counted]]  # route -> front name -> its count
    bytecodes: dict[str, Bytecodes]  # route -> the proxy's, by function (none: not counted)
    bytecodes_top: int  # how many files and functions the report shows


def callgrind_control(*args: str) -> None:
    result = subprocess.run(["callgrind_control", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise BenchmarkError(f"callgrind_control {' '.join(args)} failed: {result.stderr[-500:]}")


def dumped_instructions(out_dir: Path, before: set[Path]) -> int:
    """The instructions counted in the dump that appeared in `out_dir` since `before`."""
    dumps = set(out_dir.iterdir()) - before
    if len(dumps) != 1:
        raise BenchmarkError(f"callgrind wrote {len(dumps)} dumps for one window in {out_dir}")
    [dump] = dumps
    for line in dump.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise BenchmarkError(f"{dump} holds no totals line")


async def measure_front(bed: CountingBed, front: Front) -> dict[str, Counted]:
    """Start `front` under callgrind, count each route's requests in windows of half
    `bed.requests` until two in a row agree (`steady`); route -> what the last two counted.
    The front is stopped after."""
    out_dir = bed.processes.workdir / f"callgrind-{front.name}"
    out_dir.mkdir()
    port = free_port(HOST)
    valgrind = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",  # nothing counted, and the start not slowed, until turned on
        f"--callgrind-out-file={out_dir}/callgrind.%p",
    ]
    if front.env_changes is None:
        command, env = passthrough_command(bed.upstream, port), None
    else:
        command, env = proxy_command(bed.upstream, port), front_env(bed.processes, front)
    url = f"http://{HOST}:{port}"

    async def count(pid: int, route: str, indices: range, key: str | None) -> float:
        before = set(out_dir.iterdir())
        callgrind_control("--zero", str(pid))
        callgrind_control("--instr=on", str(pid))
        for index in indices:
            await send(bed.session, url, route, index, key)
        callgrind_control("--dump", str(pid))
        callgrind_control("--instr=off", str(pid))
        return dumped_instructions(out_dir, before) / len(indices)

    progress(f"starting {front.name} ({front.description}) under callgrind")
    windows = await count_windows(
        bed, front, front.name, [*valgrind, *command], env, url, count, float
    )
    window = window_size(bed.requests)
    return {
        route: Counted(counts[-2:], window, steady(counts)) for route, counts in windows.items()
    }


async def benchmark(
    processes: ProcessSet,
    fronts: Sequence[Front],
    routes: Sequence[str],
    requests: int,
    warmup: int,
    command: str,
    bytecodes_top: int,
) -> InstructionsReport:
    upstream, server_command, _ = start_llama_server(processes)
    async with aiohttp.ClientSession() as session:
        await wait_healthy(session, processes.find("llama-server"), upstream)
        api_key = create_tenant(processes.workdir / "proxy-state")
        bed = CountingBed(processes, session, upstream, api_key, routes, requests, warmup)
        per_request: dict[str, dict[str, Counted]] = {route: {} for route in routes}
        for front in fronts:
            for route, count in (await measure_front(bed, front)).items():
                per_request[route][front.name] = count
        bytecodes = {}
        if bytecodes_top > 0:  # the proxy as `bench overhead` runs it
            [proxy] = [front for front in FRONTS if front.name == "proxy"]
            bytecodes = await measure_bytecodes(bed, proxy)
    return InstructionsReport(
        command,
        " ".join(server_command),
        requests,
        warmup,
        list(fronts),
        per_request,
        bytecodes,
        bytecodes_top,
    )


def render_markdown(report: InstructionsReport) -> str:
    names = [front.name for front in report.fronts]
    lines = [
        "# cacheproxy instructions benchmark",
        "",
        f"- command: `{report.command}`",
        f"- llama-server: `{report.llama_server_command}`",
        f"- {report.warmup} requests a route and front uncounted, then windows of"
        f" {window_size(report.requests)}, one request at a time, until two in a row agree"
        f" within {STEADY_SHARE:.0%} (* where none did): millions of instructions a request"
        " in the last two (callgrind), every thread of the front process",
        "",
        table_row(
            ["route", *names, *(["proxy / bare"] if {"proxy", "bare"} <= set(names) else [])]
        ),
        table_row(["---", *(["---:"] * (len(names) + ({"proxy", "bare"} <= set(names))))]),
    ]
    for route, figures in report.per_request.items():
        cells = [
            f"{figures[name].per_request / 1e6:.3f}{'' if figures[name].steady else ' *'}"
            for name in names
        ]
        if "proxy" in figures and "bare" in figures:
            cells.append(f"{figures['proxy'].per_request / figures['bare'].per_request:.2f}")
        lines.append(table_row([route, *cells]))
    variants = [front for front in report.fronts if front.name not in ("bare", "proxy")]
    if "proxy" in names and variants:
        lines += ["", "What a feature costs a request (the proxy less the proxy without it):", ""]
        lines.append(table_row(["route", *(front.description for front in variants)]))
        lines.append(table_row(["---", *(["---:"] * len(variants))]))
        for route, figures in report.per_request.items():
            proxy = figures["proxy"].per_request
            costs = [f"{(proxy - figures[f.name].per_request) / 1e3:+.0f} k" for f in variants]
            lines.append(table_row([route, *costs]))
    lines += ["", "Fronts:", ""]
    lines += [f"- `{front.name}`: {front.description}" for front in report.fronts]
    if report.bytecodes:
        lines += ["", "## Where the proxy's Python work goes (bytecodes.py)"]
        lines += render_bytecodes(report.bytecodes, report.bytecodes_top)
    return "\n".join(lines) + "\n"


def report_as_json(report: InstructionsReport) -> dict:
    return {
        "command": report.command,
        "llama_server_command": report.llama_server_command,
        "requests": report.requests,
        "warmup": report.warmup,
        "fronts": {front.name: front.description for front in report.fronts},
        "instructions_per_request": {
            route: {name: counted.per_request for name, counted in figures.items()}
            for route, figures in report.per_request.items()
        },
        "windows": {
            route: {name: counted.windows for name, counted in figures.items()}
            for route, figures in report.per_request.items()
        },
        "bytecodes": {
            route: {
                "total": counted.total,
                "files": counted.files,
                "functions": counted.functions[: report.bytecodes_top],
            }
            for route, counted in report.bytecodes.items()
        },
        "steady": {
            route: {name: counted.steady for name, counted in figures.items()}
            for route, figures in report.per_request.items()
        },
    }


def run_instructions_benchmark(
    requests: int,
    warmup: int,
    front_names: Sequence[str] = FRONT_NAMES,
    routes: Sequence[str] = tuple(ROUTES),
    json_path: str | None = None,
    bytecodes_top: int = 15,
) -> int:
    """Count, print the figures as Markdown (and write them as JSON); return an exit code.
    `bytecodes_top`: the proxy's bytecodes by file and function, this many of each shown (0:
    not counted)."""
    if requests < 1 or warmup < 0 or bytecodes_top < 0:
        print(
            "--requests must be at least 1, --warmup and --bytecodes not negative",
            file=sys.stderr,
        )
        return 2
    try:
        ensure_valgrind()
    except ValgrindUnavailable as exc:
        print(f"cacheproxy bench instructions: {exc}", file=sys.stderr)
        return 2
    fronts = [front for front in FRONTS if front.name in front_names]
    command = invoked_command()
    code, report = run_with_processes(
        "cacheproxy-instructions-",
        lambda processes: benchmark(
            processes, fronts, routes, requests, warmup, command, bytecodes_top
        ),
    )
    if report is None:
        return code
    print(render_markdown(report), flush=True)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report_as_json(report), indent=2) + "\n")
        progress(f"figures written to {json_path}")
    return 0
