"""systemd: the unit files pass `systemd-analyze verify`, the sd_notify client speaks the
protocol to a real datagram socket, and `cacheproxy serve` notifies READY / WATCHDOG / STOPPING."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from cacheproxy.http.app_keys import SETTINGS
from cacheproxy.http.systemd import add_systemd_notify, listening_tcp_ports
from cacheproxy.ops.notify import SystemdNotifier, socket_address
from cacheproxy.settings import load_settings
from cacheproxy.upstreams.managed import free_port
from tests.support.servers import LlamaServer, StartServer, http_status, wait_for_health

UNITS_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL


# -- the unit files --------------------------------------------------------------------------


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze") or shutil.which("/usr/bin/systemd-analyze")
    if found is None:
        pytest.fail(
            "systemd-analyze is not installed, so the unit files cannot be verified: "
            "install systemd (Debian/Ubuntu: apt-get install systemd)"
        )
    return found


def cacheproxy_script() -> Path:
    """The installed `cacheproxy` console script: the one next to this interpreter, not a shim."""
    beside = Path(sys.executable).parent / "cacheproxy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("cacheproxy")
    assert found, "the `cacheproxy` script is not installed (pip install -e .)"
    return Path(found)


def unit_with_binary(name: str, installed_path: str, binary: Path, into: Path) -> Path:
    """A copy of a unit whose ExecStart runs `binary` instead of `installed_path`.

    `systemd-analyze verify` fails a unit whose ExecStart binary does not exist, and the units
    name where they are installed (/usr/local/bin/...), which is not where this checkout's
    script or the test-bed llama-server live; everything but that path is verified as shipped.
    """
    text = (UNITS_DIR / name).read_text()
    assert f"ExecStart={installed_path} " in text, f"{name} should run {installed_path}"
    copy = into / name
    copy.write_text(text.replace(f"ExecStart={installed_path} ", f"ExecStart={binary} "))
    return copy


def verify(*units: Path) -> list[str]:
    """`systemd-analyze verify`; its diagnostics about these units (an unknown key is only a
    warning, exit status 0, so the output is read too)."""
    result = subprocess.run(
        [systemd_analyze(), "verify", *map(str, units)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = (result.stdout + result.stderr).splitlines()
    mentions = [line for line in output if any(unit.name in line for unit in units)]
    if result.returncode != 0:
        mentions.append(f"exit status {result.returncode}: {result.stderr.strip()}")
    return mentions


def test_units_pass_systemd_analyze_verify(llama_server_binary: Path, tmp_path: Path) -> None:
    proxy = unit_with_binary(
        "cacheproxy.service", "/usr/local/bin/cacheproxy", cacheproxy_script(), tmp_path
    )
    server = unit_with_binary(
        "llama-server.service", "/usr/local/bin/llama-server", llama_server_binary, tmp_path
    )
    assert verify(proxy, server) == []


def test_verify_check_is_not_vacuous(tmp_path: Path) -> None:
    bad = tmp_path / "bad.service"
    bad.write_text("[Service]\nType=notify\nWatchdogSecs=30\nExecStart=/bin/true\n")
    assert any("WatchdogSecs" in line for line in verify(bad))


def unit_settings(name: str) -> dict[str, list[str]]:
    """`Key` -> its values in the order given (systemd keys may repeat)."""
    values: dict[str, list[str]] = {}
    for line in (UNITS_DIR / name).read_text().splitlines():
        match = re.fullmatch(r"(\w+)=(.*)", line.strip())
        if match:
            values.setdefault(match[1], []).append(match[2])
    return values


HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "",
}


@pytest.mark.parametrize("name", ["cacheproxy.service", "llama-server.service"])
def test_units_are_hardened(name: str) -> None:
    unit = unit_settings(name)
    assert {key: unit.get(key, [None])[-1] for key in HARDENING} == HARDENING
    # llama-server's is the proxy's archive folder: it writes the disk tier's files itself
    expected = {"cacheproxy.service": "cacheproxy", "llama-server.service": "cacheproxy/slots"}
    assert unit["StateDirectory"] == [expected[name]]


def test_proxy_unit_is_a_notify_service_with_a_watchdog() -> None:
    unit = unit_settings("cacheproxy.service")
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert unit["WatchdogSec"] == ["30"] and unit["Restart"] == ["on-failure"]
    assert unit["User"] == ["cacheproxy"]
    assert unit["EnvironmentFile"] == ["-/etc/cacheproxy/cacheproxy.env"]
    assert unit["ExecStart"] == [
        "/usr/local/bin/cacheproxy serve --config /etc/cacheproxy/cacheproxy.toml"
    ]
    assert "llama-server.service" in unit["After"][0].split()


def test_llama_server_unit_runs_what_the_proxy_needs() -> None:
    (command,) = unit_settings("llama-server.service")["ExecStart"]
    flags = command.split()
    for expected in (
        ["-np", "4"],
        ["--cache-ram", "0"],
        ["--host", "127.0.0.1"],
        ["--port", "8081"],
    ):
        at = flags.index(expected[0])
        assert flags[at : at + 2] == expected
    # its StateDirectory, the proxy's default archive folder (state_dir/slots)
    assert flags[flags.index("--slot-save-path") + 1] == "%S/cacheproxy/slots"
    assert "--metrics" in flags


# -- the notify client against a real datagram socket -----------------------------------------


@dataclass
class Datagram:
    data: bytes
    pid: int | None  # the sender, from SCM_CREDENTIALS: what NotifyAccess=main checks

    @property
    def fields(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.data.decode().splitlines())


class NotifyListener:
    """What systemd's end of `$NOTIFY_SOCKET` is: an AF_UNIX datagram socket with SO_PASSCRED."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)

    def close(self) -> None:
        self.sock.close()

    def receive(self, timeout: float) -> Datagram | None:
        self.sock.settimeout(timeout)
        credentials_size = struct.calcsize("3i")
        try:
            data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(credentials_size))
        except TimeoutError:
            return None
        pid = None
        for level, kind, payload in ancillary:
            if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS):
                pid = struct.unpack("3i", payload[:credentials_size])[0]
        return Datagram(data, pid)

    def wait_for(self, predicate: Callable[[Datagram], bool], timeout: float) -> list[Datagram]:
        """Every datagram up to and including the first that satisfies `predicate`."""
        seen: list[Datagram] = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            datagram = self.receive(left)
            if datagram is None:
                break
            seen.append(datagram)
            if predicate(datagram):
                return seen
        raise AssertionError(f"no matching datagram within {timeout} s; got {seen}")

    def collect(self, duration: float) -> list[Datagram]:
        seen: list[Datagram] = []
        deadline = time.monotonic() + duration
        while (left := deadline - time.monotonic()) > 0:
            datagram = self.receive(left)
            if datagram is not None:
                seen.append(datagram)
        return seen


@pytest.fixture
def path_listener(tmp_path: Path) -> Iterator[tuple[NotifyListener, str]]:
    path = str(tmp_path / "notify.sock")
    assert len(path) <= UNIX_PATH_MAX, f"tmp_path too long for a unix socket: {path}"
    listener = NotifyListener(path)
    yield listener, path
    listener.close()


@pytest.fixture
def abstract_listener() -> Iterator[tuple[NotifyListener, str]]:
    name = f"cacheproxy-test-{uuid.uuid4().hex}"
    listener = NotifyListener(b"\0" + name.encode())
    yield listener, "@" + name
    listener.close()


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest) -> tuple[NotifyListener, str]:
    return request.getfixturevalue(f"{request.param}_listener")


def test_messages_arrive_with_the_exact_bytes(listener: tuple[NotifyListener, str]) -> None:
    receiver, notify_socket = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": notify_socket})
    assert notifier.enabled
    sends: list[tuple[Callable[[], bool], bytes]] = [
        (notifier.ready, b"READY=1"),
        (notifier.watchdog, b"WATCHDOG=1"),
        (notifier.stopping, b"STOPPING=1"),
        (lambda: notifier.ready(status="Serving"), b"READY=1\nSTATUS=Serving"),
        (lambda: notifier.status("two\nlines"), b"STATUS=two lines"),
        (lambda: notifier.stopping(status="Draining"), b"STOPPING=1\nSTATUS=Draining"),
    ]
    for send, expected in sends:
        assert send() is True
        datagram = receiver.receive(timeout=5)
        assert datagram is not None and datagram.data == expected
        assert datagram.pid == os.getpid()


def test_reloading_carries_the_monotonic_time(path_listener: tuple[NotifyListener, str]) -> None:
    receiver, notify_socket = path_listener
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert SystemdNotifier({"NOTIFY_SOCKET": notify_socket}).reloading()
    datagram = receiver.receive(timeout=5)
    assert datagram is not None
    fields = datagram.fields
    assert fields["RELOADING"] == "1"
    assert before <= int(fields["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert not notifier.ready() and not notifier.watchdog() and not notifier.stopping()


def test_unreachable_or_unusable_notify_socket_is_not_fatal(tmp_path: Path) -> None:
    assert SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).ready() is False
    assert socket_address("vsock:2:1234") is None and socket_address("@") is None
    assert socket_address("@name") == b"\0name" and socket_address("/run/n") == "/run/n"


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "4242"}, 0.4),
        ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "4243"}, None),  # another process's
        ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_PID": "4242"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], interval: float | None) -> None:
    notifier = SystemdNotifier(environ, pid=4242)
    assert notifier.watchdog_interval() == interval
    assert notifier.watchdog_ping_interval() == (None if interval is None else interval / 2)


def test_watchdog_pid_defaults_to_this_process() -> None:
    environ = {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier(environ).watchdog_interval() == 1.0


def test_nothing_is_registered_outside_systemd() -> None:
    app = web.Application()
    contexts, startups = len(app.cleanup_ctx), len(app.on_startup)
    add_systemd_notify(app, SystemdNotifier({}))
    assert (len(app.cleanup_ctx), len(app.on_startup), len(app.on_shutdown)) == (
        contexts,
        startups,
        0,
    )


async def test_listening_ports_are_this_process_own() -> None:
    server = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert port in (listening_tcp_ports() or set())
    finally:
        server.close()
        await server.wait_closed()
    assert port not in (listening_tcp_ports() or set())


async def test_ready_waits_for_the_listening_socket_and_stopping_comes_first(
    path_listener: tuple[NotifyListener, str], tmp_path: Path
) -> None:
    """aiohttp starts the app (every cleanup context) before the site binds: READY=1 must wait
    for the bind, and STOPPING=1 must precede the contexts' teardown."""
    receiver, notify_socket = path_listener
    port = free_port()
    app = web.Application()
    app[SETTINGS] = load_settings(port=port, state_dir=tmp_path / "state")
    add_systemd_notify(app, SystemdNotifier({"NOTIFY_SOCKET": notify_socket}))
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await asyncio.sleep(0.3)  # started, not yet listening: only the "Starting" status
        assert [d.fields for d in receiver.collect(0.01)] == [
            {"STATUS": "Starting: opening the tenant registry, reading the upstreams' slots"}
        ]
        await web.TCPSite(runner, "127.0.0.1", port).start()
        (ready,) = await asyncio.to_thread(receiver.wait_for, is_ready, 5)
        assert ready.fields["STATUS"] == f"Serving on 127.0.0.1:{port}; no upstream answering"
    finally:
        await runner.cleanup()
    stopping, closing = receiver.collect(0.1)
    assert stopping.data == b"STOPPING=1\nSTATUS=Stopping: draining requests in flight"
    assert closing.data == b"STATUS=Stopping: closing upstream connections"


# -- `cacheproxy serve` under a (stand-in) systemd --------------------------------------------

WATCHDOG_USEC = 400_000  # pings every 0.2 s


@dataclass
class NotifiedProxy:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])


def start_notified_proxy(
    upstream: str, notify_socket: str, workdir: Path, unix_socket: Path | None = None
) -> NotifiedProxy:
    """`cacheproxy serve` under a notify socket, on a free port (or on `unix_socket` alone)."""
    port = free_port()
    inherited = {
        key: value
        for key, value in os.environ.items()
        if key not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    }
    env = {
        **inherited,
        "NOTIFY_SOCKET": notify_socket,
        "WATCHDOG_USEC": str(WATCHDOG_USEC),
        "CACHEPROXY_ROUTING__HEALTH_INTERVAL_S": "0.2",
        "CACHEPROXY_STATE_DIR": str(workdir / "state"),
    }
    log_path = workdir / f"serve-{port}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cacheproxy",
                "serve",
                "--upstream",
                upstream,
                "--port",
                str(port),
                *(() if unix_socket is None else ("--host", str(unix_socket))),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}" if unix_socket is None else f"unix://{unix_socket}"
    return NotifiedProxy(process, url, log_path)


def is_ready(datagram: Datagram) -> bool:
    return datagram.fields.get("READY") == "1"


def is_stopping(datagram: Datagram) -> bool:
    return datagram.fields.get("STOPPING") == "1"


def watchdog_pings(datagrams: list[Datagram]) -> int:
    return sum(1 for d in datagrams if d.data == b"WATCHDOG=1")


def await_pings(receiver: NotifyListener, count: int, timeout: float = 15.0) -> list[Datagram]:
    """Every datagram until `count` watchdog pings came (one per 0.2 s; a loaded machine
    sends them later, never fewer)."""
    seen = 0

    def enough(datagram: Datagram) -> bool:
        nonlocal seen
        seen += datagram.data == b"WATCHDOG=1"
        return seen >= count

    return receiver.wait_for(enough, timeout)


def status_says(text: str) -> Callable[[Datagram], bool]:
    return lambda datagram: text in datagram.fields.get("STATUS", "")


def await_ready(receiver: NotifyListener, proxy: NotifiedProxy) -> list[Datagram]:
    """READY=1, and at that moment the proxy already serves /health (no retry here)."""
    try:
        before = receiver.wait_for(is_ready, timeout=60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nproxy log:\n{proxy.log_tail()}") from exc
    assert http_status(proxy.url + "/health") == 200
    assert before[0].fields.get("STATUS", "").startswith("Starting")  # said before anything else
    return before


def stop_and_expect_stopping(receiver: NotifyListener, proxy: NotifiedProxy) -> None:
    proxy.process.send_signal(signal.SIGTERM)
    receiver.wait_for(is_stopping, timeout=15)
    assert proxy.process.wait(timeout=30) == 0, proxy.log_tail()


@pytest.fixture
def stop_proxies() -> Iterator[list[NotifiedProxy]]:
    proxies: list[NotifiedProxy] = []
    yield proxies
    for proxy in proxies:
        if proxy.process.poll() is None:
            proxy.process.kill()
            proxy.process.wait()


def test_serve_notifies_ready_watchdog_and_stopping(
    llama_server: LlamaServer,
    path_listener: tuple[NotifyListener, str],
    tmp_path: Path,
    stop_proxies: list[NotifiedProxy],
) -> None:
    receiver, notify_socket = path_listener
    proxy = start_notified_proxy(llama_server.url, notify_socket, tmp_path)
    stop_proxies.append(proxy)

    ready = await_ready(receiver, proxy)[-1]
    assert ready.pid == proxy.process.pid  # the main PID, as NotifyAccess=main requires
    assert "1/1 upstream(s) answering" in ready.fields["STATUS"]

    pings = await_pings(receiver, 3)
    assert {d.pid for d in pings} == {proxy.process.pid}

    stop_and_expect_stopping(receiver, proxy)


def test_a_proxy_on_a_unix_socket_is_ready_once_it_listens_there(
    start_server: StartServer,
    path_listener: tuple[NotifyListener, str],
    tmp_path: Path,
    stop_proxies: list[NotifiedProxy],
) -> None:
    """`--host /path/proxy.sock` in front of a llama-server on its own socket: READY=1 once
    the proxy listens on the socket (no TCP port to wait for), its status naming it."""
    receiver, notify_socket = path_listener
    with tempfile.TemporaryDirectory(prefix="cp-") as folder:  # a socket path's 107 bytes
        upstream = start_server(parallel=1, host=f"{folder}/llama.sock")
        listening = Path(folder) / "proxy.sock"
        proxy = start_notified_proxy(upstream.url, notify_socket, tmp_path, listening)
        stop_proxies.append(proxy)
        ready = await_ready(receiver, proxy)[-1]
        assert f"on {listening}" in ready.fields["STATUS"], ready.fields
        assert "1/1 upstream(s) answering" in ready.fields["STATUS"]
        assert http_status(proxy.url + "/v1/models") == 200
        stop_and_expect_stopping(receiver, proxy)


def test_watchdog_pings_stop_while_no_upstream_answers(
    start_server: StartServer,
    path_listener: tuple[NotifyListener, str],
    tmp_path: Path,
    stop_proxies: list[NotifiedProxy],
) -> None:
    receiver, notify_socket = path_listener
    upstream = start_server(ctx_size=4096)
    proxy = start_notified_proxy(upstream.url, notify_socket, tmp_path)
    stop_proxies.append(proxy)
    await_ready(receiver, proxy)
    await_pings(receiver, 2)

    upstream.kill()
    # the health check (every 0.2 s) notices, and the proxy says so before the next ping
    receiver.wait_for(status_says("no upstream answering"), timeout=10)
    assert watchdog_pings(receiver.collect(1.2)) == 0  # systemd would restart it after 30 s

    back = start_server(ctx_size=4096, port=upstream.port)
    wait_for_health(back.url, back)
    receiver.wait_for(status_says("1/1 upstream(s) answering"), timeout=15)
    await_pings(receiver, 2)

    stop_and_expect_stopping(receiver, proxy)
