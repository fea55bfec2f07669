"""What every benchmark shares: the child processes it starts and stops, waiting for them to
answer, progress lines, a run in a fresh work folder, and a Markdown table row."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import aiohttp

from cacheproxy.ops.logs import REDACTED, redact_secrets
from cacheproxy.settings import SECRET_NAME_WORDS
from cacheproxy.tenancy.registry import TenantRegistry

HOST = "127.0.0.1"


JSON_HEADERS = {"Content-Type": "application/json"}


# llama-server closes the connection after every streamed response although it announces
# keep-alive, so reusing it would race that close; every arm streams on a fresh connection.
STREAM_HEADERS = {**JSON_HEADERS, "Connection": "close"}


STARTUP_TIMEOUT_S = 120.0


STOP_TIMEOUT_S = 10.0


LOG_TAIL_LINES = 20


ReportT = TypeVar("ReportT")
T = TypeVar("T")


class BenchmarkError(RuntimeError):
    """The benchmark cannot go on: a process did not start, or an arm answered wrongly."""


async def run_clients(clients: dict[str, Coroutine[Any, Any, None]]) -> None:
    """Run the clients at once, each a task named by its key: one request's failure ends the
    arm, raised as itself when it is the benchmark's own error (it says which request, and the
    run prints its processes' log tails before they go), not as a group."""
    try:
        async with asyncio.TaskGroup() as group:
            for name, client in clients.items():
                group.create_task(client, name=name)
    except ExceptionGroup as failed:
        first = failed.exceptions[0]
        if isinstance(first, BenchmarkError):
            raise first from None
        raise


@dataclass
class ChildProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the process has used so far; 0 once it has been reaped
        (read it before stopping it)."""
        try:
            return process_cpu_s(self.process.pid)
        except (OSError, IndexError):
            return 0.0

    def main_thread_waiting_s(self) -> float:
        """`main_thread_waiting_s` of this process. For llama-server the main thread is its
        loop: wall time less its CPU and this waiting is time it had nothing to do."""
        return main_thread_waiting_s(self.process.pid)

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # 12 and 13 after the name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_run_ns(pid: int) -> int:
    """Nanoseconds all the threads of process `pid` have run, to the nanosecond where
    `process_cpu_s` counts clock ticks (`/proc/PID/task/*/schedstat`)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total


def main_thread_waiting_s(pid: int) -> float:
    """Seconds the main thread of process `pid` was ready to run but waited for a CPU (the
    scheduler's run delay, `/proc/PID/task/PID/schedstat`); 0 once it has been reaped."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass
class ProcessSet:
    """The processes this run started; each is stopped, last started first, by `stop_all`."""

    workdir: Path
    children: list[ChildProcess] = field(default_factory=list)

    def start(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                # Own session: a Ctrl-C reaches only the benchmark, which then stops them in order.
                start_new_session=True,
            )
        self.children.append(ChildProcess(name, process, log_path))

    def find(self, name: str) -> ChildProcess:
        return next(child for child in self.children if child.name == name)

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()

    def stop_named(self, prefix: str) -> None:
        """Stop the children whose names start with `prefix` (one benchmark arm's), last first."""
        for child in reversed(self.children):
            if child.name.startswith(prefix):
                child.stop()

    def print_log_tails(self) -> None:
        for child in self.children:
            print(f"--- last lines of {child.name}'s log ---\n{child.log_tail()}", file=sys.stderr)


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def proxy_command(upstream: str, port: int) -> list[str]:
    """`cacheproxy serve` in front of `upstream`, warnings only: as every benchmark runs it."""
    return [
        sys.executable,
        "-m",
        "cacheproxy",
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]


def create_tenant(state_dir: Path, name: str = "bench") -> str:
    """A tenant in the registry of a proxy that will run with `state_dir` (created before it
    starts), so that its requests are authenticated and accounted as with tenants; its key."""
    with TenantRegistry(state_dir / "cacheproxy.db") as registry:
        _, api_key = registry.create(name)
    return api_key


async def wait_healthy(session: aiohttp.ClientSession, child: ChildProcess, base_url: str) -> None:
    """Poll GET /health until 200; fail if the process exits or the timeout passes."""
    deadline = time.perf_counter() + STARTUP_TIMEOUT_S
    while time.perf_counter() < deadline:
        if child.process.poll() is not None:
            raise BenchmarkError(f"{child.name} exited with {child.process.returncode} at startup")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(base_url + "/health") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise BenchmarkError(f"{child.name} did not answer /health with 200 in {STARTUP_TIMEOUT_S} s")


async def fail_on_bad_status(response: aiohttp.ClientResponse) -> None:
    if response.status != 200:
        body = (await response.read())[:300]
        raise BenchmarkError(
            f"{response.method} {response.url} answered {response.status}: {body!r}"
        )


def table_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """A SIGTERM ends the run like Ctrl-C does, so the child processes are still stopped."""

    def interrupt(signum: int, frame: object) -> NoReturn:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# Variables of the environment the processes a benchmark starts inherit, and which change what
# they do: the OpenMP runtime's (how llama-server's CPU threads wait between steps: libgomp
# spins a CPU for milliseconds after each by default), ggml's, llama-server's own flags
# (`LLAMA_ARG_*`) and the proxy's settings.
MEASURED_ENVIRONMENT = ("OMP_", "GOMP_", "KMP_", "GGML_", "LLAMA_ARG_", "CACHEPROXY_")
# what ggml sets in every process that loads it where it is unset (ggml-cpu.c), and so in a
# benchmark that has loaded it (the embedded engine) and in llama-server alike: no choice made
SET_BY_GGML = {"KMP_BLOCKTIME": "200"}


def invoked_command() -> str:
    """The command as one would type it again, behind the variables of the environment that
    change what it measures (`MEASURED_ENVIRONMENT`); keys, tokens and passwords masked, as in
    the logs, for a report is shared. `python -m cacheproxy` leaves __main__.py in argv[0],
    which nobody types."""
    program = Path(sys.argv[0]).name
    if program == "__main__.py":
        program = "python -m cacheproxy"
    settings = [
        f"{name}={shlex.quote(_shown(name, value))}"
        for name, value in sorted(os.environ.items())
        if name.startswith(MEASURED_ENVIRONMENT) and SET_BY_GGML.get(name) != value
    ]
    words = (shlex.quote(redact_secrets(word)) for word in sys.argv[1:])
    return " ".join([*settings, program, *words])


def _shown(name: str, value: str) -> str:
    """A variable's value as a report shows it: masked if its name says it is a secret."""
    if SECRET_NAME_WORDS & set(name.lower().split("_")):
        return REDACTED
    return redact_secrets(value)  # a password in a URL


def run_with_processes(
    prefix: str, body: Callable[[ProcessSet], Coroutine[Any, Any, ReportT]]
) -> tuple[int, ReportT | None]:
    """Run `body` with a fresh work folder and process set; every process is stopped after.

    Returns the exit code and the report (None when the run failed or was interrupted).
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir, sigterm_as_interrupt():
        processes = ProcessSet(Path(workdir))
        try:
            return 0, asyncio.run(body(processes))
        except BenchmarkError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            processes.print_log_tails()
            return 1, None
        except KeyboardInterrupt:
            print("benchmark interrupted", file=sys.stderr)
            return 130, None
        finally:
            progress("stopping every process this run started")
            processes.stop_all()


def rotated(items: Sequence[T], by: int) -> list[T]:
    """The items starting from a different one each time, so no arm always goes first."""
    start = by % len(items)
    return [*items[start:], *items[:start]]
