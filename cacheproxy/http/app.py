"""The application factory: settings and dependencies in, a ready `web.Application` out."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from cacheproxy.cluster.handoff import HandOff
from cacheproxy.cluster.keeper import LeaseKeeper
from cacheproxy.cluster.leases import LeaseStore
from cacheproxy.cluster.slot_claims import SlotClaimStore
from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.disk.eviction import EvictionPolicy
from cacheproxy.disk.store import ArchiveIndex, ArchiveStore
from cacheproxy.disk.tier import DiskTier
from cacheproxy.disk.usage_gauges import UsageGauges
from cacheproxy.http.admin import add_admin_routes
from cacheproxy.http.app_keys import (
    ARCHIVE_GAUGES,
    ARCHIVES,
    BODY_PARSER,
    CACHE,
    HANDOFF,
    LEASES,
    METER,
    METRICS,
    POOL,
    REGISTRY,
    SESSION,
    SETTINGS,
    SHUTDOWN,
    TRACER,
    UPSTREAM_CONNECTIONS,
    UPSTREAM_METRICS,
    USAGE,
)
from cacheproxy.http.body_parse import BodyParser
from cacheproxy.http.control_routes import add_control_routes
from cacheproxy.http.dashboard import ARCHIVE_USAGE, ArchiveFigures
from cacheproxy.http.front_door import front_door
from cacheproxy.http.routes import add_routes
from cacheproxy.http.spill_budget import SpillBudget
from cacheproxy.http.spill_folder import SpillFolder
from cacheproxy.http.systemd import add_systemd_notify
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.shutdown import ShutdownClock, add_shutdown
from cacheproxy.ops.stage_clock import StageClock
from cacheproxy.ops.tracing import OtelTracer, RequestTracer, tracer_from, tracing_middleware
from cacheproxy.plugins import load_plugin
from cacheproxy.settings import Settings
from cacheproxy.slots.executor import CacheLayer
from cacheproxy.slots.routing import RoutingPolicy
from cacheproxy.tenancy.limits import Limits
from cacheproxy.tenancy.metering import running_meter
from cacheproxy.tenancy.registry import TenantRegistry, UnknownTenant
from cacheproxy.tenancy.shared_meter import LimitSharing, running_shared_meter
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.lenient_http import LenientConnector
from cacheproxy.upstreams.managed import LocalServer
from cacheproxy.upstreams.pool import UpstreamPool
from cacheproxy.upstreams.server_metrics import UpstreamMetrics
from cacheproxy.upstreams.tls import upstream_ssl_context

log = logging.getLogger(__name__)


def create_app(
    settings: Settings, managed: LocalServer | None = None, tracer: RequestTracer | None = None
) -> web.Application:
    """Build the proxy for `settings.upstreams`, or for `managed` when none are configured.

    `managed` (a managed llama-server or the embedded engine's server) is started, and waited
    for, when the app starts, and stopped with it. The routing plugin is loaded here, so an
    unknown name fails before anything starts. `tracer`: where spans go (default: as
    `settings.tracing` says; off, a no-op).
    """
    urls = settings.upstream_urls() or ([managed.base_url] if managed else [])
    if not urls:
        raise ValueError("no upstream: configure `upstreams` or pass a managed llama-server")

    metrics = ProxyMetrics()
    shutdown = ShutdownClock(settings.shutdown_timeout_s)
    if tracer is None:
        clocked = settings.tracing.stage_clock and not settings.tracing.enabled
        tracer = StageClock(metrics) if clocked else tracer_from(settings.tracing)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app.middlewares.append(front_door(app, shutdown, settings.clients, metrics))
    if isinstance(tracer, OtelTracer):  # off, no middleware at all: tracing costs nothing
        app.middlewares.append(tracing_middleware(tracer))
    if isinstance(tracer, StageClock):  # the front door is what the request spends outside
        app.middlewares.insert(0, tracer.middleware("request"))  # the handler
        app.middlewares.append(tracer.middleware("handler"))
    app[SETTINGS] = settings
    app[SHUTDOWN] = shutdown
    add_shutdown(app, shutdown)
    app[POOL] = UpstreamPool(urls)
    app[METRICS] = metrics
    app[TRACER] = tracer
    app.on_cleanup.append(_stop_tracer)

    def usage_of(tenant_id: str) -> dict:
        return app[CACHE].usage_of(tenant_id) if CACHE in app else {}

    app[USAGE] = usage_of
    policy = load_plugin("routing", settings.routing.policy, settings.routing.options)
    app.cleanup_ctx.append(_tenant_registry_ctx)
    app.cleanup_ctx.append(_meter_ctx)  # before the cache layer: stopped after its drain
    app.on_response_prepare.append(_rate_limit_headers(app))
    if settings.disk.enabled:
        eviction = load_plugin("eviction", settings.disk.eviction, settings.disk.eviction_options)
        app.cleanup_ctx.append(_archive_store_ctx(eviction))
    if managed is not None:
        app.cleanup_ctx.append(_managed_server_ctx(managed))
    app.cleanup_ctx.append(_upstream_session_ctx)
    if settings.cluster.enabled:
        # before the cache layer: it inspects only what this proxy holds, and the leases are
        # given up only after its drain
        app.cleanup_ctx.append(_cluster_ctx)
    app.cleanup_ctx.append(_cache_layer_ctx(policy))
    app.cleanup_ctx.append(_upstream_metrics_ctx)
    app.cleanup_ctx.append(_body_parser_ctx)
    add_systemd_notify(app)  # last: READY=1 once all the above started and the socket listens
    add_admin_routes(app)  # a sub-app at /admin: no /admin/ path reaches the pass-through
    add_control_routes(app)  # before the pass-through: answered here once tenants exist
    add_routes(app)
    return app


async def _stop_tracer(app: web.Application) -> None:
    await app[TRACER].aclose()  # the last spans are sent


async def _tenant_registry_ctx(app: web.Application) -> AsyncIterator[None]:
    # opened first, so a database that cannot be opened or migrated stops start-up early;
    # its reads answer from memory, refreshed off the loop by the front door
    registry = await TenantRegistry.aopen(app[SETTINGS].tenant_database())
    try:
        app[REGISTRY] = registry
        yield
    finally:
        await registry.aclose()


async def _meter_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    registry = app[REGISTRY]
    defaults = Limits(**settings.limits.model_dump())

    # asked several times per request; a tenant's own limits are an object of the registry's
    # snapshot, so each is merged with the defaults once (keyed by identity: hashing the
    # dataclass costs more than merging; the entry holds the object, so its id stays its own)
    merged: dict[int, tuple[Limits, Limits]] = {}

    def limits_of(tenant_id: str) -> Limits:
        own = registry.limits(tenant_id)
        entry = merged.get(id(own))
        if entry is None or entry[0] is not own:
            if len(merged) >= 1024:
                merged.clear()  # snapshots come and go: forget the old ones' objects
            entry = merged[id(own)] = (own, own.over(defaults))
        return entry[1]

    path = settings.usage_database()
    if settings.cluster.enabled:  # one meter per tenant across the proxies
        cluster = settings.cluster
        sharing = LimitSharing(
            settings.tenant_database(),
            settings.proxy_id(),
            cluster.renewal_s(),
            cluster.lease_ttl_s,
        )
        running = running_shared_meter(path, settings.usage, limits_of, sharing, app[METRICS])
    else:  # a single proxy meters in memory and pays nothing for sharing
        running = running_meter(path, settings.usage, limits_of)
    async with running as meter:
        tracer = app[TRACER]
        if isinstance(tracer, StageClock):  # its prompt tokens are taken in the `meter` stage
            tracer.instrument(
                meter, {"admit": "meter", "record_request": "meter", "answer_headers": "headers"}
            )
        app[METER] = meter
        yield


def _rate_limit_headers(
    app: web.Application,
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """OpenAI's x-ratelimit-* headers on every answer to an admitted task request, streamed
    ones included (this runs as the headers are sent)."""

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        meter = app.get(METER)  # the app's, not `request.app` (a lookup through the match)
        if meter is not None:
            response.headers.update(meter.answer_headers(request))

    return add_headers


def _archive_store_ctx(
    eviction: EvictionPolicy,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def open_archive_store(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        store = await ArchiveStore.open(lambda: ArchiveIndex.from_settings(settings, eviction))
        try:
            # a crash may have left half-written files or rows without files: mend before use
            try:
                report = await store.recover()
            except (OSError, *DATABASE_ERRORS) as exc:
                if isinstance(exc, sqlite3.DatabaseError) and not isinstance(
                    exc, sqlite3.OperationalError
                ):
                    await store.verify()  # a damaged index stops start-up, naming the file
                # e.g. a read-only folder: the disk tier starts off and mends once it can
                store.recovery_pending = True
                log.warning(
                    "disk tier off: archive recovery in %s could not run (%r); requests run"
                    " without archiving until it can",
                    store.directory,
                    exc,
                )
            else:
                if report.orphan_files:
                    log.warning(
                        "%d archive files have no row in %s: moved to %s (`cacheproxy archives"
                        " quarantine list`, `cacheproxy archives adopt FILE --tenant ID`)",
                        len(report.orphan_files),
                        store.database,
                        store.quarantine_directory,
                    )
                if report.changed:
                    log.warning("archive recovery: %s", report)
            app[ARCHIVES] = store
            app[ARCHIVE_USAGE] = lambda: _archive_figures(store)
            app[ARCHIVE_GAUGES] = UsageGauges(app[METRICS], store)
            yield
        finally:
            await store.close()

    return open_archive_store


async def _archive_figures(store: ArchiveStore) -> dict[str, ArchiveFigures]:
    usage, sharing = await store.usage_and_sharing()
    return {
        tenant_id: ArchiveFigures(
            archive_bytes=used.bytes,
            archive_count=used.count,
            archive_shared_bytes=sharing[tenant_id].shared_bytes if tenant_id in sharing else 0,
        )
        for tenant_id, used in usage.items()
    }


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
                UpstreamClient(
                    app[SESSION], _upstream_auth(settings), connections=app[UPSTREAM_CONNECTIONS]
                ),
                settings.disk,
                app[METRICS],
                quotas=_quotas_from(app[REGISTRY]),
                on_archived=app[METER].record_archived,
                tracer=app[TRACER],
            )
        # whose text each slot holds, kept for the next to hold an upstream (the registry's
        # database: a cluster's proxies share it, as they do the leases)
        claims = await SlotClaimStore.aopen(
            settings.tenant_database(), settings.proxy_id(), settings.cluster.enabled
        )
        try:
            layer = CacheLayer(
                app[POOL].upstreams,
                app[SESSION],
                app[UPSTREAM_CONNECTIONS],
                settings.routing,
                policy,
                app[METRICS],
                upstream_headers=_upstream_auth(settings),
                upstream_api_key=key,
                tenants=app[REGISTRY],
                disk=disk,
                scheduling=settings.scheduling,
                meter=app[METER],
                tracer=app[TRACER],
                claims=claims,
            )
            if LEASES in app:
                app[LEASES].on_change = layer.monitor.follow_leases
                app[LEASES].is_idle = layer.runs_nothing_on
            await layer.start()
            app[CACHE] = layer
            yield
            await layer.stop(deadline=app[SHUTDOWN].deadline())
        finally:
            await claims.aclose()

    return run_cache_layer


async def _cluster_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    cluster = settings.cluster
    store = await LeaseStore.aopen(settings.tenant_database())
    keeper = LeaseKeeper(
        store,
        app[POOL].upstreams,
        settings.proxy_id(),
        settings.advertise_url(),
        cluster.lease_ttl_s,
        cluster.renewal_s(),
        metrics=app[METRICS],
    )
    # a hand-off that cannot connect soon is served here: its own short connect bound
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=cluster.handoff_timeout_s,
        sock_read=settings.upstream_read_timeout_s,
    )
    try:
        async with (
            aiohttp.ClientSession(
                timeout=timeout,
                skip_auto_headers=("User-Agent",),
                cookie_jar=aiohttp.DummyCookieJar(),  # a peer's cookies are no other's
            ) as session,
            keeper.running(),
        ):
            app[LEASES] = keeper
            if cluster.handoff:
                secret = (
                    cluster.secret.get_secret_value().encode()
                    if cluster.secret is not None
                    else await store.asecret()
                )
                app[HANDOFF] = HandOff(
                    keeper,
                    session,
                    cluster.key_prefix_tokens,
                    app[METRICS],
                    secret,
                    cluster.handoff_window_s,
                )
            log.info(
                "cluster: proxy %s holds %s (lease %.0f s, renewed every %.1f s)",
                keeper.proxy_id,
                keeper.held or "no upstream yet",
                cluster.lease_ttl_s,
                cluster.renewal_s(),
            )
            yield
    finally:
        await store.aclose()


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
        app[SESSION],
        app[POOL].upstreams,
        _upstream_auth(settings),
        settings.upstream_metrics_interval_s,
    )
    async with scraper.running():
        app[UPSTREAM_METRICS] = scraper
        yield


async def _body_parser_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    # what a proxy killed here before left is removed before anything is spilled again
    folder = await SpillFolder.aopen(settings.body_spill_dir())
    bodies = settings.bodies
    metrics = app[METRICS]
    budget = SpillBudget(
        bodies.max_spilled_bytes,
        bodies.max_spilled_bytes_per_tenant,
        refused=lambda bound: metrics.body_spill_refusals.labels(bound).inc(),
    )
    metrics.body_spilled_bytes.set_function(lambda: budget.held)
    parser = BodyParser(folder, budget)  # its worker process starts with the first big body
    app[BODY_PARSER] = parser
    try:
        yield
    finally:
        await parser.aclose()
        await folder.aclose()


async def _upstream_session_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    tls = await asyncio.to_thread(upstream_ssl_context, settings.upstream_ca_file)
    # llama-server drops idle keep-alive connections after 5 s: give them up a little sooner
    connector = LenientConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4.0, ssl=tls)
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=settings.upstream_connect_timeout_s,
        sock_read=settings.upstream_read_timeout_s,
    )
    connections = UpstreamConnections(
        settings.upstream_connect_timeout_s, settings.upstream_read_timeout_s, tls=tls
    )
    try:
        # no cookie jar: a cookie an upstream (or a relay before it) sets in one tenant's
        # answer must never be sent with another tenant's request
        async with aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        ) as session:
            app[SESSION] = session
            app[UPSTREAM_CONNECTIONS] = connections
            yield
    finally:
        await connections.close()
