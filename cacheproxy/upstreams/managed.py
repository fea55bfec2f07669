"""A llama-server child process that cacheproxy starts, watches, and restarts when it dies.

It listens on `managed.host`: an address and port, or a unix socket's path (ending in .sock, as
llama-server's --host reads it), which the proxy then reaches as `unix://` and that path
(upstreams/unix_sockets.py). llama-server never removes its socket file and cannot bind over
one, so before each start the proxy removes the file a previous run left (never one another
process listens on), and removes its own once the server has stopped."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Protocol

import aiohttp

from cacheproxy.ops.logs import redact_secrets
from cacheproxy.ops.shutdown import CannotListen, check_socket_path
from cacheproxy.settings import UNIX_SCHEME, ManagedServerSettings, is_socket_path
from cacheproxy.upstreams.model_file import NotGguf, sliding_window

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def llama_server_args(
    binary: Path,
    model: Path | None,
    *,
    host: str,
    port: int,
    parallel: int | None,
    ctx_size: int,
    cache_ram_mib: int | None,
    slot_save_path: Path,
    extra_args: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The command line for a llama-server the cache layer can rely on.

    An explicit `-np` keeps the KV cache per slot (auto mode would unify it, and idle slots would
    then be cleared whenever any task starts); the slot save path enables the disk tier and
    `--metrics` the upstream metrics. `parallel=None` leaves llama-server's automatic choice,
    which the proxy follows (tasks go unpinned): tests and benchmarks ask for it.
    `cache_ram_mib=None` leaves llama-server's default RAM cache (8192 MiB). `model=None`: a
    router, its models named by `extra_args` (`--models-dir`, `--models-preset`); every instance
    it starts takes these flags too (tools/server/server-models.cpp:741-746).
    """
    slots = [] if parallel is None else ["--parallel", str(parallel)]
    cache_ram = [] if cache_ram_mib is None else ["--cache-ram", str(cache_ram_mib)]
    return [
        str(binary),
        *([] if model is None else ["--model", str(model)]),
        "--host",
        host,
        "--port",
        str(port),
        *slots,
        "--ctx-size",
        str(ctx_size),
        *cache_ram,
        "--slot-save-path",
        str(slot_save_path) + "/",
        "--metrics",
        *extra_args,
    ]


def router_args(settings: ManagedServerSettings) -> list[str]:
    """The flags of a router-mode server: where its models are, how many may be loaded."""
    args: list[str] = []
    if settings.models_dir is not None:
        args += ["--models-dir", str(settings.models_dir)]
    if settings.models_preset is not None:
        args += ["--models-preset", str(settings.models_preset)]
    if settings.router and settings.models_max is not None:
        args += ["--models-max", str(settings.models_max)]
    return args


SWA_FULL = "--swa-full"


def with_full_window(
    settings: ManagedServerSettings, model: Path | None, disk_tier: bool
) -> ManagedServerSettings:
    """`--swa-full` added for a model whose attention slides over a window while the disk tier
    runs (for a router: for any of its folder's models, the flag passed on to every instance;
    one without a window ignores it): llama-server otherwise keeps only the window's KV cells of
    those layers, saves only them, and recomputes the whole prompt of every slot restored
    (docs/disk-tier.md). A file that cannot be read is left to llama-server to refuse."""
    if not disk_tier or SWA_FULL in settings.extra_args:
        return settings
    models = [model] if model is not None else folder_models(settings.models_dir)
    windowed = [(path, window) for path in models if (window := _window(path)) > 0]
    if not windowed:
        return settings
    log.info(
        "%s attend over a sliding window: llama-server runs with %s so that restored slots are"
        " reused (it keeps the whole context of those layers)",
        ", ".join(f"{path} ({window} tokens)" for path, window in windowed),
        SWA_FULL,
    )
    return settings.model_copy(update={"extra_args": [*settings.extra_args, SWA_FULL]})


def folder_models(models_dir: Path | None) -> list[Path]:
    """The GGUF files a router's `--models-dir` holds: in it, and in its sub-folders (one a
    model, with its shards, projector or draft: common/preset.cpp `load_from_models_dir`)."""
    if models_dir is None or not models_dir.is_dir():
        return []
    return sorted([*models_dir.glob("*.gguf"), *models_dir.glob("*/*.gguf")])


def _window(model: Path) -> int:
    try:
        return sliding_window(model)
    except (OSError, NotGguf):
        return 0


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: have Linux kill it if the proxy dies, even by SIGKILL, so a
    crashed proxy never leaves an orphan server holding the port and the memory.

    SIGKILL, not SIGTERM: an orphan has nobody to drain for, and llama-server's graceful
    shutdown was seen to hang here (main thread parked in a futex, SIGTERM then blocked).
    """
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalServerFailed(RuntimeError):
    """The server the proxy starts itself did not come up; the message says why, in a line."""


class LocalServer(Protocol):
    """A server the proxy starts and stops with itself and reaches at `base_url`: a
    `ManagedLlamaServer`, or the embedded engine's server (cacheproxy/embedded/server.py)."""

    @property
    def base_url(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ManagedLlamaServer:
    """Runs one llama-server and restarts it, with backoff, whenever it exits unasked."""

    def __init__(
        self,
        settings: ManagedServerSettings,
        binary: Path,
        model: Path | None,
        state_dir: Path,
        slot_save_path: Path | None = None,
    ) -> None:
        self.settings = settings
        self.binary = binary
        self.model = model
        # a unix socket's path (absolute: the server starts in the proxy's folder all the same)
        self.socket = os.path.abspath(settings.host) if is_socket_path(settings.host) else None
        self._bound_socket = False  # the socket file is this server's (so removed as it stops)
        self.port = settings.port or (0 if self.socket else free_port(settings.host))
        # the disk tier's archive folder: llama-server writes and reads the archives itself
        self.slot_save_path = slot_save_path or state_dir / "slots"
        self.log_path = state_dir / "llama-server.log"
        self.restarts = 0
        self._process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    @property
    def base_url(self) -> str:
        if self.socket is not None:
            return UNIX_SCHEME + self.socket
        return f"http://{self.settings.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def start(self) -> None:
        """Start the server and its supervisor; return once it answers /health."""
        self.slot_save_path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._supervisor = asyncio.create_task(self._supervise(), name="llama-server-supervisor")
        ready = asyncio.create_task(self._ready.wait(), name="llama-server-ready")
        done, _ = await asyncio.wait(
            {ready, self._supervisor},
            timeout=self.settings.startup_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if ready not in done:
            ready.cancel()
            failed = self._supervisor.exception() if self._supervisor in done else None
            await self.stop()
            if failed is not None:
                raise LocalServerFailed(f"llama-server could not be started: {failed}")
            raise LocalServerFailed(
                f"llama-server did not become healthy within {self.settings.startup_timeout_s} s;"
                f" see {self.log_path}"
            )

    async def stop(self) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            # one that failed (a binary that cannot run) was reported by `start`
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
        await self._terminate()

    async def _supervise(self) -> None:
        backoff = self.settings.restart_backoff_s
        while not self._stopping:
            await self._launch()
            healthy = await self._wait_healthy()
            if healthy:
                self._ready.set()
                backoff = self.settings.restart_backoff_s
                log.info("llama-server ready at %s (pid %s)", self.base_url, self.pid)
            assert self._process is not None
            code = await self._process.wait()
            if self._stopping:
                return
            self.restarts += 1
            log.warning(
                "llama-server (pid %s) exited with %s; restarting in %.1f s",
                self._process.pid,
                code,
                backoff,
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.restart_backoff_max_s)

    async def _launch(self) -> None:
        if self.socket is not None:
            self._clear_socket()
        args = llama_server_args(
            self.binary,
            self.model,
            host=self.socket or self.settings.host,
            port=self.port,
            parallel=self.settings.parallel,
            ctx_size=self.settings.ctx_size,
            cache_ram_mib=self.settings.cache_ram_mib,
            slot_save_path=self.slot_save_path,
            extra_args=[*router_args(self.settings), *self.settings.extra_args],
        )
        # extra_args may carry --api-key: masked, like every logged secret
        log.info("starting llama-server: %s", redact_secrets(" ".join(args)))
        with open(self.log_path, "ab") as log_file:  # noqa: ASYNC230 - opening a log is instant
            try:
                self._process = await asyncio.create_subprocess_exec(
                    *args,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                    start_new_session=True,  # a Ctrl-C meant for the proxy does not kill it
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                # the file that could not run, named on every loop (uvloop's error leaves it out)
                if exc.filename is None:
                    exc.filename = str(self.binary)
                raise
        self._bound_socket = self.socket is not None

    def _clear_socket(self) -> None:
        """Remove the socket file a previous run left; refuse one another process listens on."""
        assert self.socket is not None
        try:
            check_socket_path(self.socket, "managed.host")
        except CannotListen as exc:
            self._bound_socket = False  # another process's now: never removed here
            raise LocalServerFailed(str(exc)) from None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)

    async def _wait_healthy(self) -> bool:
        """Poll /health until 200; False if the process exits first."""
        assert self._process is not None
        timeout = aiohttp.ClientTimeout(total=2)
        # on a unix socket: its path, the URL's host a mere name
        connector = None if self.socket is None else aiohttp.UnixConnector(path=self.socket)
        url = "http://localhost" if self.socket is not None else self.base_url
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while self._process.returncode is None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url + "/health") as response:
                        if response.status == 200:
                            return True
                await asyncio.sleep(0.1)
        return False

    async def _terminate(self) -> None:
        process = self._process
        if process is None:
            return
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self.socket is not None and self._bound_socket:  # nobody listens there any more
            self._bound_socket = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket)
