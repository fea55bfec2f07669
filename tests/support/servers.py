"""Real processes and sockets for the tests: llama-server children and in-process proxies."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from cacheproxy.http.app import create_app
from cacheproxy.http.clients import runner_options
from cacheproxy.http.head_limits import ProxyRunner
from cacheproxy.settings import Settings, load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.upstreams.managed import free_port, llama_server_args

HEALTH_TIMEOUT_S = 60.0


@dataclass
class LlamaServer:
    process: subprocess.Popen[bytes]
    port: int
    slot_save_path: Path
    log_path: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        """Its base URL: `unix://` and the path of its socket when it listens on one."""
        if self.host.endswith(".sock"):
            return f"unix://{self.host}"
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL: the crash the proxy must survive."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_llama_server(
    binary: Path,
    model: Path | str | None,
    workdir: Path,
    *,
    parallel: int | None = 4,
    ctx_size: int = 16384,
    cache_ram_mib: int | None = 0,  # None: llama-server's default (8192 MiB)
    extra_args: tuple[str, ...] = (),
    port: int | None = None,
    wait: bool = True,
    slot_actions: bool = True,
    host: str = "127.0.0.1",
    slot_save_path: Path | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
    metrics: bool = True,
    bare: bool = False,
) -> LlamaServer:
    """A llama-server child; `slot_actions=False` starts it without `--slot-save-path`, as most
    people do (slot save, restore and erase then answer 501), `metrics=False` without
    `--metrics` (its GET /metrics then answers 501). `slot_save_path` defaults to a folder of
    its own; `wrap` turns the command line into another (run it on another "host"). `bare`:
    `llama-server -m MODEL --port PORT` and nothing else, as most people start it (its
    defaults: 4 slots on a unified KV cache, an 8 GiB RAM cache, idle slots emptied into it).
    `model=None` starts a router: its models named in `extra_args` (`--models-dir`)."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    if slot_save_path is None:
        slot_save_path = workdir / f"slots-{port}"
    slot_save_path.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"llama-server-{host.replace('/', '_')}-{port}.log"
    args = llama_server_args(
        binary,
        None if model is None else Path(model),
        host=host,
        port=port,
        parallel=parallel,
        ctx_size=ctx_size,
        cache_ram_mib=cache_ram_mib,
        slot_save_path=slot_save_path,
        extra_args=extra_args,
    )
    if bare:
        args = [str(binary), "-m", str(model), "--port", str(port)]
    if not slot_actions and not bare:
        at = args.index("--slot-save-path")
        del args[at : at + 2]
    if not metrics and not bare:
        args.remove("--metrics")
    if wrap is not None:
        args = wrap(args)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file)
    server = LlamaServer(process, port, slot_save_path, log_path, host)
    if wait:
        wait_for_health(server.url, server)
    return server


StartServer = Callable[..., LlamaServer]


def http_status(url: str, tls: ssl.SSLContext | None = None) -> int | None:
    """The status of a GET, or None when nothing answers (`unix://PATH/route`: over the unix
    socket at PATH, a path ending in .sock; `tls`: what an https server's certificate is
    checked with)."""
    if url.startswith("unix://"):
        return _unix_status(url)
    try:
        with urllib.request.urlopen(url, timeout=2, context=tls) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix socket (the standard library has no such connection)."""

    def __init__(self, path: str, timeout: float = 2.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _unix_status(url: str) -> int | None:
    path, _, route = url[len("unix://") :].rpartition(".sock")
    connection = UnixHTTPConnection(path + ".sock")
    try:
        connection.request("GET", route or "/")
        return connection.getresponse().status
    except (ConnectionError, FileNotFoundError, TimeoutError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def wait_for_health(
    base_url: str, server: LlamaServer | None = None, tls: ssl.SSLContext | None = None
) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if http_status(base_url + "/health", tls) == 200:
            return
        if server is not None and server.process.poll() is not None:
            raise RuntimeError(f"llama-server exited early:\n{server.log_tail()}")
        time.sleep(0.05)
    raise TimeoutError(f"{base_url}/health did not answer 200 within {HEALTH_TIMEOUT_S} s")


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, unix_socket: Path | None = None, **create_kwargs: Any
) -> AsyncIterator[tuple[str, web.Application]]:
    """Serve `create_app(settings)` on a free loopback port, as `cacheproxy serve` does (and on
    `unix_socket` too, as it does for a --host ending in .sock)."""
    app = create_app(settings, **create_kwargs)
    runner = ProxyRunner(
        app, handler_cancellation=True, access_log=None, **runner_options(settings.clients)
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    if unix_socket is not None:
        await web.UnixSite(runner, str(unix_socket)).start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving_tenants(
    upstream_url: str,
    workdir: Path,
    admin_api_key: str | None = None,
    scheduling: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[str, TenantRegistry]]:
    """A proxy with a tenant registry of its own, and that registry, open for the test to fill
    (`scheduling`: settings of that section)."""
    database = workdir / "tenants.db"
    settings = load_settings(
        upstreams=[upstream_url],
        state_dir=workdir / "state",
        tenants={"database": database, "admin_api_key": admin_api_key},
        scheduling=scheduling or {},
    )
    with TenantRegistry(settings.tenant_database()) as registry:
        async with serving(settings) as (url, _):
            yield url, registry


@contextlib.asynccontextmanager
async def running_proxy(settings: Settings, **create_kwargs: Any) -> AsyncIterator[str]:
    async with serving(settings, **create_kwargs) as (url, _):
        yield url


def child_pids(parent: int) -> list[int]:
    """Direct children of a process, read from /proc (no extra dependency for one lookup)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            # the fields after the command name (which may hold spaces) start after the last ')'
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                children.append(int(entry))
    return children
