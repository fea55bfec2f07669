"""Fair share's test material: a proxy with tenants (and an admin key) in front of a real
llama-server, and what its scheduler shows."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from cacheproxy.http.app_keys import CACHE, REGISTRY
from cacheproxy.settings import Settings, load_settings
from cacheproxy.tenancy.registry import Tenant, TenantRegistry
from tests.support import databases
from tests.support.servers import LlamaServer, serving

ADMIN_KEY = "admin-key-for-tests-0123456789"


@dataclass
class Proxy:
    url: str
    app: web.Application
    registry: TenantRegistry
    server: LlamaServer

    @property
    def queued(self) -> int:
        return self.app[CACHE].scheduler.queued

    async def create(self, name: str, **fields: object) -> tuple[Tenant, str]:
        """A tenant the proxy knows before the test sends anything: it re-reads the registry
        file only once its snapshot is `refresh_interval_s` old, so a key made a moment ago
        would still be refused."""
        created = self.registry.create(name, **fields)
        await self.app[REGISTRY].arefresh()
        return created


def proxy_settings(
    server: LlamaServer,
    workdir: Path,
    routing: dict | None = None,
    disk: dict | None = None,
    **scheduling: object,
) -> Settings:
    return load_settings(
        upstreams=[server.url],
        state_dir=workdir / "state",
        tenants={"database": workdir / "tenants.db", "admin_api_key": ADMIN_KEY},
        # a stopped server must not be taken for a dead one while the test holds it
        routing={"health_timeout_s": 60, "health_interval_s": 30, **(routing or {})},
        scheduling=scheduling,
        **({} if disk is None else {"disk": disk}),
    )


@contextlib.asynccontextmanager
async def fair_proxy(
    server: LlamaServer,
    workdir: Path,
    routing: dict | None = None,
    disk: dict | None = None,
    **scheduling: object,
) -> AsyncIterator[Proxy]:
    """A proxy with tenants in front of `server` (`routing`, `disk`: settings of those sections
    besides the test's own bounds; the rest: of `scheduling`)."""
    with TenantRegistry(databases.chosen(workdir / "tenants.db")) as registry:
        settings = proxy_settings(server, workdir, routing, disk, **scheduling)
        async with serving(settings) as (url, app):
            yield Proxy(url, app, registry, server)


def busy_slots(proxy: Proxy) -> int:
    return sum(slot.busy for slot in proxy.app[CACHE].scheduler.tables[0].slots)


class MovedClock:
    """`time.monotonic()`, moved on by `ahead_s`."""

    def __init__(self) -> None:
        self.ahead_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead_s
