"""Typed application state: every shared object the handlers use, set up by the app factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from cacheproxy.cluster.handoff import HandOff
from cacheproxy.cluster.keeper import LeaseKeeper
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.disk.usage_gauges import UsageGauges
from cacheproxy.http.body_parse import BodyParser
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.shutdown import ShutdownClock
from cacheproxy.ops.tracing import RequestTracer
from cacheproxy.settings import Settings
from cacheproxy.slots.admission import RequestLimits
from cacheproxy.slots.executor import CacheLayer
from cacheproxy.tenancy.auth import Callers
from cacheproxy.tenancy.metering import Meter
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.pool import UpstreamPool
from cacheproxy.upstreams.server_metrics import UpstreamMetrics

SETTINGS = web.AppKey("settings", Settings)
SESSION = web.AppKey("upstream_session", aiohttp.ClientSession)
# the lean client for plain-http upstreams, streams too (forward.py says which requests take it)
UPSTREAM_CONNECTIONS = web.AppKey("upstream_connections", UpstreamConnections)
POOL = web.AppKey("upstream_pool", UpstreamPool)
METRICS = web.AppKey("metrics", ProxyMetrics)
CACHE = web.AppKey("cache_layer", CacheLayer)
REGISTRY = web.AppKey("tenant_registry", TenantRegistry)
# who each request acts for, resolved once per request by its route (set up at start-up)
CALLERS = web.AppKey("callers", Callers)
ARCHIVES = web.AppKey("archive_store", ArchiveStore)
# the archive gauges, read from the index when /metrics is asked
ARCHIVE_GAUGES = web.AppKey("archive_gauges", UsageGauges)
SHUTDOWN = web.AppKey("shutdown_clock", ShutdownClock)
BODY_PARSER = web.AppKey("body_parser", BodyParser)
METER = web.AppKey("usage_meter", Meter)  # the usage ledger and the tenants' limits
TRACER = web.AppKey("tracer", RequestTracer)  # spans of each request's stages (a no-op when off)
# several proxies (`[cluster]` on): this proxy's leases, and the hand-off to a conversation's owner
LEASES = web.AppKey("lease_keeper", LeaseKeeper)
HANDOFF = web.AppKey("cluster_handoff", HandOff)

# A tenant's usage and reuse figures, by tenant id, for GET /admin/tenants/{id}/usage: whoever
# counts them (the cache layer) installs its own; create_app starts with one that knows nothing.
TenantUsage = Callable[[str], dict[str, Any]]
USAGE = web.AppKey("tenant_usage", TenantUsage)
UPSTREAM_METRICS = web.AppKey("upstream_metrics", UpstreamMetrics)


@dataclass(frozen=True)
class TaskServices:
    """What every task request uses, taken from the app's state once it has started: each
    `app[KEY]` is a Python call, and a task request asked for a dozen."""

    settings: Settings
    callers: Callers
    tracer: RequestTracer
    meter: Meter
    cache: CacheLayer
    body_parser: BodyParser
    handoff: HandOff | None  # several proxies with hand-off on
    request_limits: RequestLimits  # each request's share and bounds, by tenant and header

    @classmethod
    def of(cls, app: web.Application) -> TaskServices:
        settings = app[SETTINGS]
        return cls(
            settings,
            app[CALLERS],
            app[TRACER],
            app[METER],
            app[CACHE],
            app[BODY_PARSER],
            app.get(HANDOFF),
            RequestLimits(settings.scheduling),
        )


TASK_SERVICES = web.AppKey("task_services", TaskServices)
