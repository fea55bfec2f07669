"""Python bytecodes a process's main thread executes, by function: `cacheproxy` run with a
counter that signals turn on (SIGUSR1) and off (SIGUSR2, which also writes the counts).

`python -m cacheproxy.bench.bytecodes OUT.json serve --upstream ...` runs `cacheproxy serve`
as usual. Between the two signals every bytecode the main thread (the proxy's event loop)
executes is counted against its function (CPython's opcode tracing, `frame.f_trace_opcodes`);
worker threads (the archive index, the ledger's writes, long tokenizations) are not counted.
What a bytecode costs varies (a call into C counts one), so the counts place the Python work,
and `bench instructions` gives the whole; neither follows the machine's other load as CPU time
does, but background loops tick by the clock (under the load of the full test suite, a
`/v1/messages` request's count read 6% higher than on a quiet machine).
Tracing makes the process many times slower: throughput is measured elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import signal
import sys
import types
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheproxy.bench.harness import (
    HOST,
    BenchmarkError,
    proxy_command,
    table_row,
)
from cacheproxy.bench.instruction_fronts import (
    CountingBed,
    Front,
    count_windows,
    front_env,
    send,
)
from cacheproxy.upstreams.managed import free_port

WRITE_WAIT_S = 60.0  # for the counts of a window to be written once the counter is off
POLL_S = 0.05


class BytecodeCounter:
    """Counts, by code object, the bytecodes executed and the calls made while on."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.bytecodes: Counter[types.CodeType] = Counter()
        self.calls: Counter[types.CodeType] = Counter()

    def _local(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.bytecodes[frame.f_code] += 1
        return self._local

    def _global(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        # "call" also starts each step of a coroutine: it is counted as a call of its own
        frame.f_trace_opcodes = True
        self.calls[frame.f_code] += 1
        return self._local

    def start(self, signum: int, frame: types.FrameType | None) -> None:
        self.bytecodes.clear()
        self.calls.clear()
        sys.settrace(self._global)
        while frame is not None:  # the frames running now are traced from here on too
            frame.f_trace, frame.f_trace_opcodes = self._local, True
            frame = frame.f_back

    def stop(self, signum: int, frame: types.FrameType | None) -> None:
        sys.settrace(None)
        while frame is not None:
            frame.f_trace = None
            frame = frame.f_back
        rows = [
            {
                "function": code.co_qualname,
                "file": code.co_filename,
                "line": code.co_firstlineno,
                "bytecodes": count,
                "calls": self.calls[code],
            }
            for code, count in self.bytecodes.most_common()
        ]
        written = self.out.with_suffix(".part")
        written.write_text(json.dumps(rows))
        written.replace(self.out)  # whole, or not there


@dataclass(frozen=True)
class Bytecodes:
    """A route's bytecodes a request on the proxy's main thread: in all, by function (file,
    line, name) with its calls, and by file."""

    total: float
    functions: list[dict[str, Any]]  # each: function, file, line, bytecodes, calls (a request)
    files: dict[str, float]


def short_file(path: str) -> str:
    """A source file named from its package: `aiohttp/web_protocol.py`, `cacheproxy/slots/...`."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    parts = Path(path).parts
    for package in ("cacheproxy", "plugins"):
        if package in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(package) :])
    return Path(path).name


def per_request(rows: list[dict[str, Any]], requests: int) -> Bytecodes:
    files: Counter[str] = Counter()
    functions = []
    for row in rows:
        name = short_file(row["file"])
        files[name] += row["bytecodes"] / requests
        functions.append(
            {
                **row,
                "file": name,
                "bytecodes": row["bytecodes"] / requests,
                "calls": row["calls"] / requests,
            }
        )
    functions.sort(key=lambda row: -row["bytecodes"])
    return Bytecodes(sum(files.values()), functions, dict(files.most_common()))


def written_counts(out: Path, remove: bool = False) -> list[dict[str, Any]] | None:
    """The counts the process wrote to `out` (renamed into place once whole), or None yet;
    `remove`: and the file gone, for the next window's."""
    if not out.exists():
        return None
    rows = json.loads(out.read_text())
    if remove:
        out.unlink()
    return rows


async def measure_bytecodes(bed: CountingBed, front: Front) -> dict[str, Bytecodes]:
    """Run `front` (a proxy) under the counter; route -> its bytecodes a request, counted in
    windows of half `bed.requests` requests, one at a time, after `bed.warmup` uncounted,
    until two in a row agree (the last is given). The front is stopped after."""
    port = free_port(HOST)
    name = f"bytecodes-{front.name}"
    out = bed.processes.workdir / f"{name}.json"
    command = proxy_command(bed.upstream, port)
    assert command[1:3] == ["-m", "cacheproxy"]
    url = f"http://{HOST}:{port}"

    async def count(pid: int, route: str, indices: range, key: str | None) -> Bytecodes:
        written_counts(out, remove=True)
        os.kill(pid, signal.SIGUSR1)
        for index in indices:
            await send(bed.session, url, route, index, key)
        os.kill(pid, signal.SIGUSR2)
        for _ in range(int(WRITE_WAIT_S / POLL_S)):  # another process writes it: polled
            rows = written_counts(out)
            if rows is not None:
                return per_request(rows, len(indices))
            await asyncio.sleep(POLL_S)
        raise BenchmarkError(f"{name} wrote no counts in {WRITE_WAIT_S:g} s")

    args = [command[0], "-m", "cacheproxy.bench.bytecodes", str(out), *command[3:]]
    env = front_env(bed.processes, front)
    windows = await count_windows(
        bed, front, name, args, env, url, count, lambda counted: counted.total
    )
    return {route: counted[-1] for route, counted in windows.items()}


def render_markdown(figures: dict[str, Bytecodes], top: int) -> list[str]:
    """Each route's bytecodes a request: the files, then the functions, that run the most."""
    lines = []
    for route, counted in figures.items():
        lines += [
            "",
            f"{route}: {counted.total:.0f} bytecodes a request on the proxy's main thread",
            "",
            table_row(["file", "bytecodes a request"]),
            table_row(["---", "---:"]),
        ]
        lines += [table_row([f"`{f}`", f"{n:.0f}"]) for f, n in list(counted.files.items())[:top]]
        lines += ["", table_row(["function", "bytecodes a request", "calls a request"])]
        lines.append(table_row(["---", "---:", "---:"]))
        for row in counted.functions[:top]:
            where = f"`{row['file']}:{row['line']}` {row['function']}"
            lines.append(table_row([where, f"{row['bytecodes']:.0f}", f"{row['calls']:.1f}"]))
    return lines


def main(argv: list[str]) -> None:
    """Run `python -m cacheproxy ARGS` (argv: OUT.json, then ARGS) with the counter set up."""
    counter = BytecodeCounter(Path(argv[0]))
    signal.signal(signal.SIGUSR1, counter.start)
    signal.signal(signal.SIGUSR2, counter.stop)
    sys.argv = ["cacheproxy", *argv[1:]]
    runpy.run_module("cacheproxy", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
