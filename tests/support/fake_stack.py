"""The proxy, built by its app factory and served on a loopback socket, in front of a fake
llama-server (tests/support/fake_llama_server.py): the cache layer's wiring without a build."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from cacheproxy.settings import load_settings
from tests.support.fake_llama_server import FakeLlamaServer
from tests.support.servers import serving


@contextlib.asynccontextmanager
async def proxy_before(
    fake: FakeLlamaServer, workdir: Path, disk: dict | None = None, **overrides: Any
) -> AsyncIterator[tuple[str, web.Application]]:
    """The proxy's URL and app. Its disk tier archives into the fake's slot save path when the
    fake has one (states of 128 tokens or more), and is off otherwise."""
    folder = fake.options.slot_save_path
    if folder is not None:
        disk = {
            "directory": folder,
            "database": workdir / "archive.db",
            "min_tokens": 128,
            **(disk or {}),
        }
    else:
        disk = {"enabled": False, **(disk or {})}
    settings = load_settings(
        upstreams=[fake.url], state_dir=workdir / "state", disk=disk, **overrides
    )
    async with serving(settings) as served:
        yield served
