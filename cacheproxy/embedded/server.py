"""The embedded engine behind a loopback HTTP port, shaped like `ManagedLlamaServer`.

`create_app(settings, managed=EmbeddedServer(...))` then puts the proxy's routing, tenants and
disk tier in front of it exactly as in front of a llama-server child process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from cacheproxy.embedded.engine import EmbeddedEngine
from cacheproxy.embedded.http_api import create_engine_app
from cacheproxy.embedded.tasks import EngineConfig
from cacheproxy.plugins import load_plugin
from cacheproxy.prompt_cache import PromptCacheDeps
from cacheproxy.settings import EmbeddedSettings
from cacheproxy.upstreams.managed import LocalServerFailed, free_port


def engine_config(settings: EmbeddedSettings, model: Path) -> EngineConfig:
    return EngineConfig(
        model_path=model,
        n_slots=settings.parallel,
        ctx_size=settings.ctx_size,
        n_batch=settings.batch_size,
        n_ubatch=min(settings.batch_size, 512),
        n_threads=settings.threads,
    )


def build_engine(
    settings: EmbeddedSettings,
    model: Path,
    on_loaded: Callable[[BaseException | None], None] | None = None,
) -> EmbeddedEngine:
    """Load the model and the configured prompt-cache plugin (an unknown name fails here);
    with `on_loaded`, as `EmbeddedEngine` says: the worker loads and reports."""

    def policy(deps: PromptCacheDeps) -> object:
        return load_plugin(
            "prompt_cache", settings.prompt_cache, settings.prompt_cache_options, deps
        )

    return EmbeddedEngine(engine_config(settings, model), policy, on_loaded)


class EmbeddedServer:
    """Serves llama-server's API from an in-process engine on 127.0.0.1."""

    def __init__(
        self,
        settings: EmbeddedSettings,
        model: Path,
        state_dir: Path,
        slot_save_path: Path | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        self.host = "127.0.0.1"
        self.port = settings.port or free_port(self.host)
        # the disk tier's archive folder: the engine writes and reads the archives itself
        self.slot_save_path = slot_save_path or state_dir / "slots"
        self.engine: EmbeddedEngine | None = None
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self.slot_save_path.mkdir(parents=True, exist_ok=True, mode=0o700)
        # loading a model takes a while: the engine's worker thread loads it, the loop waits
        loaded = asyncio.get_running_loop().create_future()
        engine = build_engine(self.settings, self.model, on_loaded=_settles(loaded))
        try:
            await loaded
        except asyncio.CancelledError:
            engine.close(on_closed=lambda: None)  # the worker frees it once loaded
            raise
        except Exception as exc:  # a model the engine cannot load: the start is refused
            raise LocalServerFailed(
                f"the embedded engine could not load {self.model}: {exc}"
            ) from exc
        self.engine = engine
        app = create_engine_app(self.engine, self.slot_save_path, self.model.name)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.engine is not None:
            # the worker ends its step, then frees the model: awaited, not joined
            closed = asyncio.get_running_loop().create_future()
            self.engine.close(on_closed=_settles(closed))
            await closed
            self.engine = None


def _settles(future: asyncio.Future[None]) -> Callable[..., None]:
    """A callback for the engine's worker thread that settles `future` on its event loop
    (with the error it is given, if any)."""
    loop = future.get_loop()

    def settle(error: BaseException | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(_settle, future, error)

    return settle


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
