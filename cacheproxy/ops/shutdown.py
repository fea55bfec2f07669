"""Stopping within a bound, whatever is stuck.

On SIGTERM or SIGINT the proxy stops accepting, gives the requests in flight the first half of
`shutdown_timeout_s` to finish and then cuts them (aiohttp cancels their handlers), lets the
disk tier archive the live slots until the deadline, names in the log what it had to leave (the
requests cut, the slots not archived) and exits 0. A managed llama-server then gets its own
bounded stop. A second signal exits at once; and should anything still hold the process well
past the deadline (a worker thread stuck in I/O), a timer thread ends it.

The clock lives on the app (`SHUTDOWN`), so the cache layer's drain and an in-process runner's
cleanup (the tests) keep to the same deadline as `cacheproxy serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from cacheproxy.ops.event_loop import LoopFactory
from cacheproxy.settings import is_socket_path

log = logging.getLogger(__name__)

# What the requests cut at the end of the grace get to unwind before aiohttp gives up on them.
# (aiohttp must not time out at the very moment of the cut: a handler ending just as its wait
# expires makes aiohttp 3.14 set a result on a cancelled future and log a traceback.)
UNWIND_S = 1.0
# After the deadline: a managed llama-server's stop (SIGTERM, up to 10 s, then SIGKILL) and
# closing the rest.
CLOSE_MARGIN_S = 12.0
# After that, from a thread: the event loop itself could not finish (a stuck worker thread).
BACKSTOP_MARGIN_S = 15.0


@dataclass
class ShutdownClock:
    """When the stop began, and what was running when it did."""

    timeout_s: float
    started: float | None = None  # time.monotonic() at the signal (or at the runner's cleanup)
    # the requests being handled: id -> (what, since, the task handling it)
    running: dict[int, tuple[str, float, asyncio.Task[Any]]] = field(default_factory=dict)
    cutting: bool = False  # the grace is over: requests ending now were cut
    cut: list[str] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def request_grace_s(self) -> float:
        """How long requests in flight may still run: the first half of the stop."""
        return self.timeout_s / 2

    @property
    def begun(self) -> bool:
        return self.started is not None

    def begin(self, quietly: bool = False) -> None:
        """The stop begins now (`quietly`: a start that failed, which has its own message)."""
        if self.started is None:
            self.started = time.monotonic()
            if quietly:
                return
            log.info(
                "stopping: %d request(s) in flight get up to %.1f s, the disk tier's drain"
                " runs until %.1f s",
                len(self.running),
                self.request_grace_s,
                self.timeout_s,
            )

    def deadline(self) -> float:
        """`time.monotonic()` by which the drain must be over (counted from now if not begun)."""
        return (self.started if self.started is not None else time.monotonic()) + self.timeout_s

    def remaining(self) -> float:
        return max(self.deadline() - time.monotonic(), 0.0)

    def grace_left(self) -> float:
        return max(self.remaining() - (self.timeout_s - self.request_grace_s), 0.0)

    def track(self, what: str, task: asyncio.Task[Any] | None) -> int:
        """Keep a request being handled (`what`: its method and path, never the query: it
        may hold a key), so a stop can cut it and name it; the key to `untrack` it by."""
        assert task is not None  # handlers run in tasks
        key = next(self._ids)
        self.running[key] = (what, time.monotonic(), task)
        return key

    def note_cut(self, what: str, key: int) -> None:
        """The tracked request was cancelled: named in the report if the stop cut it."""
        if self.cutting:
            started = self.running[key][1]
            self.cut.append(f"{what} (running {time.monotonic() - started:.1f} s)")

    def untrack(self, key: int) -> None:
        del self.running[key]

    def cut_requests(self) -> None:
        """Cancel the handlers still running. aiohttp does too, but only after twice its
        shutdown timeout (it first fails their body reads, then waits as long again)."""
        self.cutting = True
        for _, _, task in self.running.values():
            task.cancel()


def add_shutdown(app: web.Application, clock: ShutdownClock) -> None:
    """Start the clock when the app starts stopping, cut the requests at the end of the grace,
    and report them once the runner is done with them (before the cleanup contexts, so before
    the drain)."""
    cutter: list[asyncio.TimerHandle] = []

    async def begin(_app: web.Application) -> None:
        clock.begin()
        loop = asyncio.get_running_loop()
        cutter.append(loop.call_later(clock.grace_left(), clock.cut_requests))

    async def report_cut(_app: web.Application) -> None:
        for handle in cutter:
            handle.cancel()
        now = time.monotonic()
        # and any handler that has not yet run its `finally` after the cancel
        cut = clock.cut + [
            f"{what} (running {now - since:.1f} s)" for what, since, _ in clock.running.values()
        ]
        if cut:
            log.warning(
                "stopping: %d request(s) cut after the %.1f s grace: %s",
                len(cut),
                clock.request_grace_s,
                "; ".join(cut),
            )

    app.on_shutdown.append(begin)
    app.on_cleanup.insert(0, report_cut)


class CannotListen(OSError):
    """The socket could not be bound; the message is one line naming the address."""


def _cannot_listen(host: str, port: int, exc: OSError) -> CannotListen:
    if is_socket_path(host):
        return CannotListen(f"cannot listen on {host}: {exc.strerror or exc}")
    return CannotListen(
        f"cannot listen on {host}:{port}: {exc.strerror or exc} (another process may hold the"
        " port: choose another with --port, or stop that one)"
    )


def check_can_listen(hosts: list[str], port: int) -> None:
    """Bind every address once and let go, so that a port already held stops the start with
    one line before anything else starts (the bind that serves may still fail, and says so).
    A unix socket's path is refused while a process listens there (binding would take the path
    from it: the event loop replaces the file); one nobody listens on is replaced."""
    for host in hosts:
        if is_socket_path(host):
            check_socket_path(host)
            continue
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            for family, kind, proto, _, address in infos:
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind(address)
        except OSError as exc:
            raise _cannot_listen(host, port, exc) from exc


def check_socket_path(path: str, option: str = "--host") -> None:
    """Refuse (CannotListen) a path that is not a unix socket, or one another process listens
    on; nothing, or a socket left by a process that ended, may be bound again (`option`: where
    the path was given, for the message)."""
    if not os.path.exists(path):
        return
    if not stat.S_ISSOCK(os.stat(path).st_mode):
        raise CannotListen(f"cannot listen on {path}: it is a file, not a unix socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return  # left by a process that ended: replaced when the proxy binds
    raise CannotListen(
        f"cannot listen on {path}: another process listens there (stop it, or choose another"
        f" path with {option})"
    )


def run_until_signalled(
    app: web.Application,
    hosts: list[str],
    port: int,
    clock: ShutdownClock,
    listening: Callable[[], None] | None = None,
    runner_class: type[web.AppRunner] = web.AppRunner,
    new_loop: LoopFactory | None = None,
    **runner_kwargs: Any,
) -> None:
    """Serve `app` until SIGTERM or SIGINT, then stop within `clock`'s bound (see the module).
    `listening` is called once every socket is bound; `runner_class`: the app's runner (the
    proxy's answers requests aiohttp cannot parse); `new_loop`: the event loop to run on
    (unset: asyncio's)."""
    backstop: list[threading.Timer] = []
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(
                _serve(app, hosts, port, clock, runner_class, runner_kwargs, backstop, listening)
            )
    finally:
        for timer in backstop:
            timer.cancel()


async def _serve(
    app: web.Application,
    hosts: list[str],
    port: int,
    clock: ShutdownClock,
    runner_class: type[web.AppRunner],
    runner_kwargs: dict[str, Any],
    backstop: list[threading.Timer],
    listening: Callable[[], None] | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    stop = asyncio.Event()
    serving = False

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("second %s: exiting at once; the drain is abandoned", name)
            exit_now(128 + signum)
        log.info("%s received", name)
        clock.begin()
        stop.set()
        timer = threading.Timer(clock.remaining() + CLOSE_MARGIN_S + BACKSTOP_MARGIN_S, _too_late)
        timer.daemon = True
        timer.start()
        backstop.append(timer)
        if not serving and main is not None:
            main.cancel()  # still starting (a managed server may take minutes): stop that

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    runner = runner_class(
        app,
        handle_signals=False,
        shutdown_timeout=clock.request_grace_s + UNWIND_S,  # the clock cuts at the grace
        **runner_kwargs,
    )
    try:
        try:
            await runner.setup()
            for host in hosts:
                site = (
                    web.UnixSite(runner, host)
                    if is_socket_path(host)
                    else web.TCPSite(runner, host, port)
                )
                try:
                    await site.start()
                except OSError as exc:
                    raise _cannot_listen(host, port, exc) from exc
            serving = True
            if listening is not None:
                listening()
            await stop.wait()
        except asyncio.CancelledError:
            if not stop.is_set() or main is None:
                raise
            main.uncancel()  # ours, from the signal: the cleanup below must not see it pending
            log.info("stopped while starting")
        finally:
            clock.begin(quietly=not serving)  # a failed start says why, and no more
            await _cleanup_within_bound(runner, clock)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


async def _cleanup_within_bound(runner: web.AppRunner, clock: ShutdownClock) -> None:
    clock.begin()
    try:
        async with asyncio.timeout(clock.remaining() + CLOSE_MARGIN_S):
            await runner.cleanup()
    except TimeoutError:
        log.error(
            "stopping: still closing %.1f s after the stop began; exiting without the rest",
            time.monotonic() - (clock.started or 0.0),
        )


def _too_late() -> None:
    log.error(
        "stopping: the process is still held %s s past the deadline; exiting now", BACKSTOP_MARGIN_S
    )
    exit_now(0)


def exit_now(code: int) -> None:
    """Leave at once (no cleanup, no waiting for threads), the log written out first."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        sys.stdout.flush()
    os._exit(code)
