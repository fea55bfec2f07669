"""Running under systemd (Type=notify): READY=1 once serving, WATCHDOG=1 while healthy,
STOPPING=1 when draining, and STATUS= lines saying what the proxy is doing.

Outside systemd (no `$NOTIFY_SOCKET`) nothing is registered at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from cacheproxy.http.app_keys import CACHE, SETTINGS
from cacheproxy.ops.notify import SystemdNotifier
from cacheproxy.ops.supervise import repeat
from cacheproxy.settings import is_socket_path

log = logging.getLogger(__name__)

LISTEN_POLL_S = 0.02


def add_systemd_notify(app: web.Application, notifier: SystemdNotifier | None = None) -> None:
    """Register the notifications on `app`; call it after every other cleanup context is added.

    aiohttp runs cleanup contexts (and on_startup) inside `runner.setup()`, *before* the site
    binds its socket, so READY=1 cannot simply follow the last context's start: the context below
    starts a task that sends it once this process holds the listening socket (`web.run_app` is
    the caller's, so the runner offers no later hook). STOPPING=1 goes out from on_shutdown,
    which aiohttp runs right after the site stops accepting and before in-flight requests are
    drained (up to the runner's shutdown timeout); a cleanup context's exit would come only after
    the drain.
    """
    notifier = notifier if notifier is not None else SystemdNotifier(os.environ)
    if not notifier.enabled:
        return

    async def starting(_app: web.Application) -> None:
        notifier.status("Starting: opening the tenant registry, reading the upstreams' slots")

    async def stopping(_app: web.Application) -> None:
        notifier.stopping(status="Stopping: draining requests in flight")

    # first of all startup steps (cleanup contexts run from one on_startup entry added earlier)
    app.on_startup.insert(0, starting)
    app.cleanup_ctx.append(_notify_ctx(notifier))
    app.on_shutdown.append(stopping)


def _notify_ctx(notifier: SystemdNotifier) -> Callable[[web.Application], AsyncIterator[None]]:
    async def run_notifications(app: web.Application) -> AsyncIterator[None]:
        # a reference is kept: the loop holds tasks only weakly
        task = asyncio.create_task(_notify_while_serving(app, notifier), name="systemd-notify")
        task.add_done_callback(_log_failure)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # a failure is logged
            await task
        notifier.status("Stopping: closing upstream connections")

    return run_notifications


def _log_failure(task: asyncio.Task[None]) -> None:
    # said at once: without pings, systemd restarts the service after WatchdogSec
    if not task.cancelled() and task.exception() is not None:
        log.error("systemd notifications stopped", exc_info=task.exception())


async def _notify_while_serving(app: web.Application, notifier: SystemdNotifier) -> None:
    settings = app[SETTINGS]
    hosts = settings.listen_hosts()
    await _wait_until_listening(settings.port, hosts)
    where = ", ".join(host if is_socket_path(host) else f"{host}:{settings.port}" for host in hosts)
    ping_s = notifier.watchdog_ping_interval()
    counts = upstreams_answering(app)
    notifier.ready(status=_serving_status(where, *counts, watchdog=ping_s is not None))
    # without a watchdog, still follow the upstreams' health for STATUS=
    period = ping_s if ping_s is not None else settings.routing.health_interval_s
    said = [counts]

    async def one_round() -> None:
        now = upstreams_answering(app)
        if now != said[0]:
            notifier.status(_serving_status(where, *now, watchdog=ping_s is not None))
            said[0] = now
        if now[0] > 0 and ping_s is not None:
            notifier.watchdog()

    await repeat(
        "systemd notifications", one_round, pause_s=period, log=log, after_failure_s=period
    )


def upstreams_answering(app: web.Application) -> tuple[int, int]:
    """How many upstreams answered the cache layer's last health check, out of how many.

    One that answered 503 while it loads its model counts: it is alive, and restarting the
    proxy (what a missed watchdog leads to) would not make it load any faster. So does one
    another proxy of a cluster holds (its health is that proxy's to watch; this one hands it
    requests): a proxy holding no upstream, more proxies than upstreams, is not restarted.
    """
    layer = app.get(CACHE)
    tables = layer.tables if layer is not None else []
    alive = sum(1 for table in tables if table.healthy or table.loading or not table.upstream.held)
    return alive, len(tables)


def _serving_status(where: str, answering: int, total: int, *, watchdog: bool) -> str:
    if answering == 0:
        return f"Serving on {where}; no upstream answering" + (
            " (watchdog paused)" if watchdog else ""
        )
    return f"Serving on {where}; {answering}/{total} upstream(s) answering"


async def _wait_until_listening(port: int, hosts: list[str]) -> None:
    paths = {host for host in hosts if is_socket_path(host)}  # unix sockets (--host x.sock)
    on_tcp = len(paths) < len(hosts)
    while True:
        addresses = listening_addresses()
        if addresses is None:
            return  # no /proc to tell: the sockets are as good as bound
        ports = {address for address in addresses if isinstance(address, int)}
        tcp_bound = not on_tcp or (bool(ports) if port == 0 else port in ports)
        if tcp_bound and paths <= addresses:
            return
        await asyncio.sleep(LISTEN_POLL_S)


def listening_tcp_ports() -> set[int] | None:
    """TCP ports this process listens on, from its own descriptors; None without /proc."""
    addresses = listening_addresses()
    if addresses is None:
        return None
    return {address for address in addresses if isinstance(address, int)}


def listening_addresses() -> set[int | str] | None:
    """TCP ports and unix socket paths this process listens on, from its own descriptors;
    None without /proc.

    Asking the kernel about our own sockets, rather than connecting to the port, cannot be
    fooled by another process that already holds it (our bind would then fail).
    """
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    addresses: set[int | str] = set()
    for name in names:
        address = _listening_address(int(name))
        if address is not None:
            addresses.add(address)
    return addresses


def _listening_address(fd: int) -> int | str | None:
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return None
        duplicate = os.dup(fd)  # a socket object of our own: closing it leaves the server's open
    except OSError:
        return None  # closed meanwhile (e.g. the descriptor listdir itself used)
    try:
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return None
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
            return None
        if sock.type != socket.SOCK_STREAM:
            return None
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return None
        name = sock.getsockname()
        return name if sock.family == socket.AF_UNIX else name[1]
