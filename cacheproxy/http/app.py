"""The application factory: settings and dependencies in, a ready `web.Application` out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from cacheproxy.disk.store import ArchiveStore
from cacheproxy.disk.tier import DiskTier
from cacheproxy.http.app_keys import (
    ARCHIVES,
    BODY_PARSER,
    CACHE,
    METRICS,
    POOL,
    REGISTRY,
    SESSION,
    SETTINGS,
    UPSTREAM_METRICS,
    USAGE,
)
from cacheproxy.http.body_parse import BodyParser
from cacheproxy.http.errors import error_envelope
from cacheproxy.http.routes import add_routes
from cacheproxy.ops.metrics import ProxyMetrics, request_timer
from cacheproxy.ops.systemd import add_systemd_notify
from cacheproxy.ops.upstream_metrics import UpstreamMetrics
from cacheproxy.plugins import load_plugin
from cacheproxy.settings import Settings
from cacheproxy.slots.executor import CacheLayer
from cacheproxy.slots.routing import RoutingPolicy
from cacheproxy.tenancy.admin import add_admin_routes
from cacheproxy.tenancy.dashboard import ARCHIVE_USAGE
from cacheproxy.tenancy.registry import TenantRegistry, UnknownTenant
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.local_server import LocalServer
from cacheproxy.upstreams.pool import UpstreamPool

log = logging.getLogger(__name__)


def create_app(settings: Settings, managed: LocalServer | None = None) -> web.Application:
    """Build the proxy for `settings.upstreams`, or for `managed` when none are configured.

    `managed` (a managed llama-server or the embedded engine's server) is started, and waited
    for, when the app starts, and stopped with it. The routing plugin is loaded here, so an
    unknown name fails before anything starts.
    """
    urls = settings.upstream_urls() or ([managed.base_url] if managed else [])
    if not urls:
        raise ValueError("no upstream: configure `upstreams` or pass a managed llama-server")

    metrics = ProxyMetrics()
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[request_timer(metrics), error_envelope],
    )
    app[SETTINGS] = settings
    app[POOL] = UpstreamPool(urls)
    app[METRICS] = metrics

    def usage_of(tenant_id: str) -> dict:
        return app[CACHE].usage_of(tenant_id) if CACHE in app else {}

    app[USAGE] = usage_of
    policy = load_plugin("routing", settings.routing.policy, settings.routing.options)
    app.cleanup_ctx.append(_tenant_registry_ctx)
    if settings.disk.enabled:
        eviction = load_plugin("eviction", settings.disk.eviction, settings.disk.eviction_options)
        app.cleanup_ctx.append(_archive_store_ctx(eviction))
    if managed is not None:
        app.cleanup_ctx.append(_managed_server_ctx(managed))
    app.cleanup_ctx.append(_upstream_session_ctx)
    app.cleanup_ctx.append(_cache_layer_ctx(policy))
    app.cleanup_ctx.append(_upstream_metrics_ctx)
    app.cleanup_ctx.append(_body_parser_ctx)
    add_systemd_notify(app)  # last: READY=1 once all the above started and the socket listens
    add_admin_routes(app)  # a sub-app at /admin: no /admin/ path reaches the pass-through
    add_routes(app)
    return app


async def _tenant_registry_ctx(app: web.Application) -> AsyncIterator[None]:
    # opened first, so a database that cannot be opened or migrated stops start-up early
    with TenantRegistry(app[SETTINGS].tenant_database()) as registry:
        app[REGISTRY] = registry
        yield


def _archive_store_ctx(eviction: object) -> Callable[[web.Application], AsyncIterator[None]]:
    async def open_archive_store(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        store = await asyncio.to_thread(
            ArchiveStore,
            settings.archive_directory(),
            settings.archive_database(),
            eviction,
            settings.disk.budget_mib * 1024 * 1024,
        )
        try:
            # a crash may have left half-written files or rows without files: mend before use
            report = await asyncio.to_thread(store.recover)
            if report.changed:
                log.warning("archive recovery: %s", report)
            app[ARCHIVES] = store
            app[ARCHIVE_USAGE] = lambda tenant_id: _archive_figures(store, tenant_id)
            yield
        finally:
            store.close()

    return open_archive_store


def _archive_figures(store: ArchiveStore, tenant_id: str) -> dict[str, int]:
    used = store.usage(tenant_id)
    return {"archive_bytes": used.bytes, "archive_count": used.count}


def _managed_server_ctx(
    managed: LocalServer,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def run_managed_server(app: web.Application) -> AsyncIterator[None]:
        await managed.start()
        yield
        await managed.stop()

    return run_managed_server


def _cache_layer_ctx(policy: RoutingPolicy) -> Callable[[web.Application], AsyncIterator[None]]:
    async def run_cache_layer(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        key = settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
        disk = None
        if ARCHIVES in app:
            disk = DiskTier(
                app[ARCHIVES],
                UpstreamClient(app[SESSION], _upstream_auth(settings)),
                settings.disk,
                app[METRICS],
                quotas=_quotas_from(app[REGISTRY]),
            )
            await disk.publish_usage()
        layer = CacheLayer(
            app[POOL].upstreams,
            app[SESSION],
            settings.routing,
            policy,
            app[METRICS],
            upstream_headers=_upstream_auth(settings),
            upstream_api_key=key,
            tenants=app[REGISTRY],
            disk=disk,
        )
        await layer.start()
        app[CACHE] = layer
        yield
        await layer.stop()

    return run_cache_layer


def _quotas_from(registry: TenantRegistry) -> Callable[[str], tuple[int | None, int | None]]:
    def quotas(tenant_id: str) -> tuple[int | None, int | None]:
        try:
            tenant = registry.get(tenant_id)
        except UnknownTenant:
            return None, None  # the single user, before any tenant exists: the budget only
        return tenant.quota_bytes, tenant.quota_archives

    return quotas


def _upstream_auth(settings: Settings) -> dict[str, str]:
    key = settings.upstream_api_key
    return {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}


async def _upstream_metrics_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    scraper = UpstreamMetrics(
        app[SESSION], app[POOL].upstreams, _upstream_auth(settings),
        settings.upstream_metrics_interval_s,
    )  # fmt: skip
    async with scraper.running():
        app[UPSTREAM_METRICS] = scraper
        yield


async def _body_parser_ctx(app: web.Application) -> AsyncIterator[None]:
    parser = BodyParser()  # its worker process starts with the first big body
    app[BODY_PARSER] = parser
    yield
    await parser.aclose()


async def _upstream_session_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    # llama-server drops idle keep-alive connections after 5 s: give them up a little sooner
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4.0)
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=settings.upstream_connect_timeout_s,
        sock_read=settings.upstream_read_timeout_s,
    )
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)
    ) as session:
        app[SESSION] = session
        yield
