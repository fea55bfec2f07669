"""The admin dashboard: one static page at /admin/dashboard and the JSON it polls, /admin/state.

The page is plain HTML with inline JS and CSS (no build step, no libraries): it fetches
`/admin/state` every 2 s and draws what every slot holds (tenant, conversation, tokens), the
per-tenant figures with their archive quotas, the proxy-wide reuse rate over time as an SVG
polyline, and the usage ledger's last days per tenant (`LEDGER_DAYS`). Prompt text never leaves
the proxy here: the state has ids and counts, never tokens.

Auth is the admin key, like every /admin/ path. A browser cannot put a bearer header on a
navigation, so these two routes (and only these) also take it as `?key=`; the page's script then
sends it to /admin/state as `Authorization: Bearer`. The trade-off: a key in a URL lands in the
browser's history and bookmarks (and would in an access log; the proxy keeps none). For an admin
page the operator opens over loopback that is acceptable, and keeps reload and bookmarks working.
The URL is never passed on (`Referrer-Policy: no-referrer`, and the CSP lets the page load nothing
and talk to nothing but this origin). Reached over a network, /admin wants TLS and a better
scheme (a short-lived signed cookie from a login POST).

Reuse over time: a background task samples the cache layer's counters every `SAMPLE_INTERVAL_S`
into a ring buffer of `SAMPLES_KEPT` points; each point is the share of prompt tokens reused over
that interval alone (None when no prompt ran), so a recent change shows instead of being averaged
away by everything since start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypedDict

import orjson
from aiohttp import web

from cacheproxy.http.app_keys import CACHE, METER, REGISTRY
from cacheproxy.ops.supervise import repeat
from cacheproxy.slots.executor import CacheLayer
from cacheproxy.tenancy.registry import DEFAULT_TENANT, Tenant
from cacheproxy.tenancy.usage import aggregate
from cacheproxy.upstreams.slot_table import SlotState

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 5.0  # read when the app starts: tests shorten it to see a curve sooner
SAMPLES_KEPT = 120  # 10 minutes at 5 s
POLL_INTERVAL_MS = 2000  # the page's refresh, sent to it in the state
NONCE_PLACEHOLDER = "__CSP_NONCE__"
LEDGER_DAYS = 7  # the ledger's days the page shows, today included
DAY_S = 86400


class ArchiveFigures(TypedDict):
    archive_bytes: int  # on disk, each block once
    archive_count: int
    archive_shared_bytes: int  # the part of it more than one archive uses


# The disk tier, once it exists, installs a coroutine function giving every tenant's archive use
# (a tenant with none may be missing); until then the state reports None for both figures and
# the page says "not yet". It reads the archive index off the loop (the store's worker thread)
# and may wait there behind a save.
ArchiveUsage = Callable[[], Awaitable[dict[str, ArchiveFigures]]]
ARCHIVE_USAGE = web.AppKey("dashboard_archive_usage", ArchiveUsage)


@dataclass(frozen=True)
class ReuseSample:
    t: float  # unix seconds at the end of the interval
    prompt_tokens: int  # prompt tokens of the requests that finished within the interval
    reused_tokens: int

    @property
    def ratio(self) -> float | None:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else None


class ReuseHistory:
    """A ring buffer of per-interval reuse samples, fed from cumulative counters."""

    def __init__(self, capacity: int = SAMPLES_KEPT) -> None:
        self.samples: deque[ReuseSample] = deque(maxlen=capacity)
        self._last: tuple[int, int] | None = None  # the counters at the previous sample

    def sample(self, prompt_tokens: int, reused_tokens: int, now: float) -> None:
        if self._last is None:
            # the first reading is only the baseline: what ran before it has no interval
            self._last = (prompt_tokens, reused_tokens)
            return
        last_prompt, last_reused = self._last
        self._last = (prompt_tokens, reused_tokens)
        self.samples.append(
            ReuseSample(
                now, max(prompt_tokens - last_prompt, 0), max(reused_tokens - last_reused, 0)
            )
        )

    def to_json(self, interval_s: float) -> dict[str, Any]:
        return {
            "interval_s": interval_s,
            "capacity": self.samples.maxlen,
            "samples": [
                {
                    "t": s.t,
                    "prompt_tokens": s.prompt_tokens,
                    "reused_tokens": s.reused_tokens,
                    "ratio": s.ratio,
                }
                for s in self.samples
            ],
        }


REUSE_HISTORY = web.AppKey("dashboard_reuse_history", ReuseHistory)
# the interval the running sampler uses, fixed at start-up, for the page's time axis
REUSE_INTERVAL = web.AppKey("dashboard_reuse_interval_s", float)


def add_dashboard(app: web.Application, admin: web.Application) -> None:
    """Register the two routes on the admin sub-app and the reuse sampler on the main `app`.

    The sampler goes on the main app because it reads the main app's cache layer; appended after
    the cache layer's context, it starts after the layer and stops before it.
    """
    admin.router.add_get("/dashboard", dashboard_page)
    admin.router.add_get("/state", dashboard_state)
    # set now, before the app is frozen: the cleanup context only starts the task
    app[REUSE_HISTORY] = ReuseHistory()
    app[REUSE_INTERVAL] = SAMPLE_INTERVAL_S
    app.cleanup_ctx.append(_reuse_sampler_ctx)


def admin_credentials(request: web.Request) -> Mapping[str, str]:
    """The headers the admin-key check should read: the request's own, or for the dashboard's
    two routes, when no header carries a key, `?key=` presented as a bearer header."""
    if request.match_info.route.handler not in (dashboard_page, dashboard_state):
        return request.headers
    if "Authorization" in request.headers or "X-Api-Key" in request.headers:
        return request.headers
    key = request.query.get("key")
    return {"Authorization": f"Bearer {key}"} if key else request.headers


# -- handlers ------------------------------------------------------------------------------


async def dashboard_page(request: web.Request) -> web.Response:
    nonce = secrets.token_urlsafe(16)
    return web.Response(
        text=_page_template().replace(NONCE_PLACEHOLDER, nonce),
        content_type="text/html",
        headers={
            "Cache-Control": "no-store",
            # the URL may carry the key: never send it on as a Referer
            "Referrer-Policy": "no-referrer",
            # only the inline script and style carrying this response's nonce run, and the page
            # can talk to nothing but this origin: injected markup could do nothing
            "Content-Security-Policy": (
                f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                "frame-ancestors 'none'"
            ),
            "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY",
        },
    )


async def dashboard_state(request: web.Request) -> web.Response:
    archive_usage = request.config_dict.get(ARCHIVE_USAGE)
    archives = await archive_usage() if archive_usage is not None else None
    state = build_state(request.config_dict, archives)
    state["ledger_days"] = await _ledger_days(request.config_dict)
    return web.Response(
        body=orjson.dumps(state),
        content_type="application/json",
        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
    )


# -- the state -----------------------------------------------------------------------------


def build_state(
    app: Mapping[Any, Any], archives: dict[str, ArchiveFigures] | None
) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data: ids, names, counts; no prompt content.
    `archives`: each tenant's archive use, None while the disk tier is off. Reads memory only."""
    registry = app[REGISTRY]
    cache: CacheLayer | None = app.get(CACHE)
    tenants = registry.list()
    by_id: dict[str, Tenant] = {t.id: t for t in tenants}
    # the default tenant is who everyone is while no tenant exists, and keeps its figures after
    used = set(cache.usage) if cache is not None else set()
    if not tenants or DEFAULT_TENANT.id in used:
        by_id.setdefault(DEFAULT_TENANT.id, DEFAULT_TENANT)
    # a slot may still hold the default tenant's text after tenants were created
    names = {DEFAULT_TENANT.id: DEFAULT_TENANT, **by_id}
    now = time.monotonic()  # the scheduler's clock

    upstreams = []
    for table in cache.tables if cache is not None else []:
        upstreams.append(
            {
                "url": table.upstream.base_url,
                "healthy": table.healthy,
                "loading": table.loading,
                "ram_cache": table.ram_cache,
                "slots": [_slot_json(slot, names, now) for slot in table.slots],
            }
        )

    rows = []
    totals = {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "decoded_tokens": 0}
    for tenant in by_id.values():
        usage = cache.usage_of(tenant.id) if cache is not None else {}
        for name in totals:
            totals[name] += int(usage.get(name, 0))
        nothing = ArchiveFigures(archive_bytes=0, archive_count=0, archive_shared_bytes=0)
        archive = archives.get(tenant.id, nothing) if archives is not None else None
        rows.append(
            {
                "id": tenant.id,
                "name": tenant.name,
                "disabled": tenant.disabled,
                "usage": usage,
                "quota_bytes": tenant.quota_bytes,
                "quota_archives": tenant.quota_archives,
                # None until the disk tier reports: "not yet", not "nothing archived"
                "archive_bytes": archive["archive_bytes"] if archive else None,
                "archive_count": archive["archive_count"] if archive else None,
                "archive_shared_bytes": archive["archive_shared_bytes"] if archive else None,
            }
        )
    prompt = totals["prompt_tokens"]
    return {
        "generated_at": time.time(),
        "poll_interval_ms": POLL_INTERVAL_MS,
        "archive_available": archives is not None,
        "upstreams": upstreams,
        "tenants": rows,
        "totals": {**totals, "reuse_ratio": totals["reused_tokens"] / prompt if prompt else 0.0},
        "reuse_series": app[REUSE_HISTORY].to_json(app[REUSE_INTERVAL]),
    }


async def _ledger_days(app: Mapping[Any, Any]) -> list[dict[str, Any]]:
    """The ledger's last `LEDGER_DAYS` UTC days, per tenant (with its name) and day."""
    meter = app.get(METER)
    if meter is None:
        return []
    since = int(time.time() // DAY_S * DAY_S) - (LEDGER_DAYS - 1) * DAY_S
    names = {tenant.id: tenant.name for tenant in app[REGISTRY].list()}
    names.setdefault(DEFAULT_TENANT.id, DEFAULT_TENANT.name)
    rows = aggregate(await meter.rows(None, since, None), "day")
    return [{**row, "tenant_name": names.get(row["tenant_id"])} for row in rows]


def _slot_json(slot: SlotState, tenants: Mapping[str, Tenant], now: float) -> dict[str, Any]:
    tenant = tenants.get(slot.tenant) if slot.tenant is not None else None
    return {
        "id": slot.slot_id,
        "busy": slot.busy,
        "tenant_id": slot.tenant,
        "tenant_name": tenant.name if tenant is not None else None,
        "session": slot.session,
        "n_tokens": slot.n_tokens,  # None: it holds tokens we could not count
        "n_ctx": slot.n_ctx,
        "last_used_age_s": now - slot.last_used if slot.last_used else None,  # 0: never used
    }


# -- the sampler ---------------------------------------------------------------------------


def _token_totals(cache: CacheLayer) -> tuple[int, int]:
    prompt = reused = 0
    for tenant_id in list(cache.usage):
        usage = cache.usage_of(tenant_id)
        prompt += int(usage["prompt_tokens"])
        reused += int(usage["reused_tokens"])
    return prompt, reused


async def _sample_reuse(app: web.Application, interval_s: float) -> None:
    history = app[REUSE_HISTORY]

    async def one_round() -> None:
        cache = app.get(CACHE)
        if cache is not None:
            history.sample(*_token_totals(cache), now=time.time())

    await repeat("dashboard reuse sampler", one_round, pause_s=interval_s, log=log)


async def _reuse_sampler_ctx(app: web.Application) -> AsyncIterator[None]:
    # the reference is kept here for the app's lifetime: the loop holds tasks only weakly
    task = asyncio.create_task(
        _sample_reuse(app, app[REUSE_INTERVAL]), name="dashboard-reuse-sampler"
    )
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


_template: str | None = None


def _page_template() -> str:
    global _template  # read once: the page never changes while the process runs
    if _template is None:
        _template = (
            resources.files("cacheproxy.http").joinpath("static/dashboard.html").read_text("utf-8")
        )
    return _template
