"""What serves when no upstream is configured: a managed llama-server or the embedded engine."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from cacheproxy.settings import Settings
from cacheproxy.upstreams.managed import LocalServer, ManagedLlamaServer, with_full_window

log = logging.getLogger(__name__)


def embedded_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def chosen_backend(settings: Settings) -> str:
    """`auto` picks the embedded engine when a model is given, no llama-server binary is, and
    llama-cpp-python is installed; otherwise a managed llama-server."""
    if settings.backend != "auto":
        return settings.backend
    model_given = settings.embedded.model is not None or settings.managed.model is not None
    if settings.managed.router:  # several models: only llama-server's router mode serves them
        return "llama-server"
    if model_given and settings.managed.binary is None and embedded_available():
        return "embedded"
    return "llama-server"


def local_server(settings: Settings) -> LocalServer:
    """A `ManagedLlamaServer` or an `EmbeddedServer`: both have base_url, start() and stop()."""
    from cacheproxy.provision.make_model import ensure_model

    if chosen_backend(settings) == "embedded":
        from cacheproxy.embedded.server import EmbeddedServer

        model = settings.embedded.model or settings.managed.model
        if model is None:
            log.info("no model given: serving the small random-weight demo model (output is noise)")
            model = ensure_model("small")
        return EmbeddedServer(
            settings.embedded, Path(model), settings.state_dir, settings.archive_directory()
        )
    from cacheproxy.provision.build_server import ensure_llama_server

    binary = settings.managed.binary
    if binary is None:
        log.info("no upstream and no llama-server binary given: using the pinned test-bed build")
        binary = ensure_llama_server()
    model = settings.managed.model
    if model is None and not settings.managed.router:  # a router serves its folder's models
        log.info("no model given: serving the small random-weight demo model (output is noise)")
        model = ensure_model("small")
    # the disk tier's archive folder is the server's slot save path: it writes the files itself
    managed = with_full_window(settings.managed_settings(), model, settings.disk.enabled)
    return ManagedLlamaServer(
        managed, binary, model, settings.state_dir, settings.archive_directory()
    )
