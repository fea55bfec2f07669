"""The executor: a task request admitted, then dispatched to the shape that serves it.

The stages a request runs are named in stages.py; the request shapes that run them are modules
of their own: single.py (one prompt pinned to a slot), split.py (several prompts or
completions), opaque.py (`/infill`, its prompt ids not known) and unpinned.py (a whole
upstream), with prefill_chunks.py for a prompt computed in chunks. The executor builds them,
with the table's keepers (the upstream monitor, archive-ahead), and picks the shape.

It holds no policy of its own (the routing policy decides, the table remembers); the stages do
the I/O they need and keep the table honest: every prediction is checked against
`timings.cache_n`, every answer rewrites its slot, and `GET /slots` corrects what was missed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import aiohttp
from aiohttp import web

from cacheproxy.cluster.slot_claims import SlotClaimStore
from cacheproxy.disk.tier import DiskTier
from cacheproxy.errors import ApiError
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.stage_clock import StageClock
from cacheproxy.ops.tracing import NO_TRACING, RequestTracer
from cacheproxy.settings import RoutingSettings, SchedulingSettings
from cacheproxy.slots import guards
from cacheproxy.slots.archive_ahead import ArchiveAhead
from cacheproxy.slots.claims_keeper import SlotClaims
from cacheproxy.slots.mirror import NotMirrorable, TokenMirror
from cacheproxy.slots.model_admission import ModelAdmission
from cacheproxy.slots.monitor import UpstreamMonitor
from cacheproxy.slots.opaque import run_opaque
from cacheproxy.slots.prefill_chunks import PrefillInChunks
from cacheproxy.slots.prompt_bounds import PromptLimits
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.routing import RoutingPolicy
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.slots.shapes import MIRRORED_ROUTES, OPAQUE_ROUTES
from cacheproxy.slots.single import run_single
from cacheproxy.slots.slot_learning import SlotLearning
from cacheproxy.slots.slot_views import owner_single_user, owner_with_tenants
from cacheproxy.slots.split import run_split, split_plan
from cacheproxy.slots.stages import Stages
from cacheproxy.slots.unpinned import UnpinnedRequests
from cacheproxy.tenancy.metering import Meter
from cacheproxy.tenancy.registry import DEFAULT_TENANT, TenantRegistry
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import SlotState, UpstreamSlots

log = logging.getLogger(__name__)

MIB = 1 << 20
USAGE_FIGURES = ("requests", "prompt_tokens", "reused_tokens", "decoded_tokens")
# the stage clock's names for the stages that have no span (mirror, queue, upstream have)
CLOCKED_STAGES = {
    "admit": "admit",
    "meter_prompt": "meter",
    "place": "place",
    "prepare": "disk",
    "forward": "forward",
    "record": "record",
    "account": "account",
}


class CacheLayer:
    def __init__(
        self,
        upstreams: list[Upstream],
        session: aiohttp.ClientSession,
        connections: UpstreamConnections,
        settings: RoutingSettings,
        policy: RoutingPolicy,
        metrics: ProxyMetrics,
        upstream_headers: dict[str, str],
        upstream_api_key: str | None,
        tenants: TenantRegistry,
        disk: DiskTier | None = None,
        scheduling: SchedulingSettings | None = None,
        meter: Meter | None = None,
        tracer: RequestTracer = NO_TRACING,
        claims: SlotClaimStore | None = None,
    ) -> None:
        scheduling = scheduling or SchedulingSettings()
        self.disk = disk
        self.meter = meter  # the usage ledger and the tenants' limits
        self.tenants = tenants
        self.client = UpstreamClient(session, upstream_headers, connections=connections)
        self.mirror = TokenMirror(
            session,
            upstream_headers,
            settings.mirror_memo_mib * MIB,
            connections,
            settings.tokenize_in_process,
            metrics,
        )
        self.scheduler = SlotScheduler(
            [],
            policy,
            settings.max_queue,
            open_tenant=DEFAULT_TENANT.id,
            fair_share=scheduling.fair_share,
            batch_factor=scheduling.batch_factor,  # bounds come with each request's limits
            share_window_s=scheduling.share_window_s,
            chunked_prefill=scheduling.prefill_chunk_ms > 0,
            on_waited=metrics.waited_for_slot,
            line_up=settings.line_up,
            on_lined_up=metrics.lined_up.inc,
            archives_from=None if disk is None else disk.archives_from,
        )
        self._prompt_limits = PromptLimits()  # the last `prompt_limits()` answer
        metrics.queue_depth.set_function(lambda: self.scheduler.queued)  # read when scraped
        self.monitor = UpstreamMonitor(
            upstreams,
            self.client,
            settings,
            self.scheduler,
            metrics,
            disk,
            self._owner_of,
            on_new_process=self.mirror.upstream_started,
        )
        self.tables = self.monitor.tables  # the same list: the monitor fills and rebuilds it
        self.models = ModelAdmission(self.tables, self.monitor.routers)
        # whose text each slot holds: recorded for the next holder, learnt from the last one
        self.claims = None if claims is None else SlotClaims(claims, self.tables, metrics)
        if self.claims is not None:
            store = disk.store if disk is not None else None
            self.monitor.learning = SlotLearning(self.claims, self.client, store)
        self.ahead = ArchiveAhead(disk, self.scheduler, self.tables, self._owner_of)
        self.stages = Stages(
            self.scheduler,
            self.monitor,
            self.mirror,
            tenants,
            self.prompt_limits,
            session,
            connections,
            upstream_api_key,
            metrics,
            tracer,
            disk,
            meter,
            self.client.with_timeout(settings.health_timeout_s),
            self.models,
            self.claims,
        )
        if isinstance(tracer, StageClock):  # stages without a span of their own
            tracer.instrument(self.stages, CLOCKED_STAGES)
        self.gate = self.stages.gate  # each tenant's requests in progress
        self.usage = self.stages.usage  # each tenant's requests and tokens through the slots
        self.chunked = PrefillInChunks(
            self.stages, self.client.headers, scheduling.prefill_chunk_ms
        )
        self.unpinned = UnpinnedRequests(
            self.stages, self.client.with_timeout(settings.health_timeout_s)
        )

    # -- life cycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Read every upstream's slots; refuse (raise) a server the table cannot follow."""
        await self.monitor.start()
        self.ahead.start()
        if self.claims is not None:
            self.claims.start()

    async def stop(self, deadline: float | None = None) -> None:
        """Stop watching the upstreams and archive the live slots worth keeping, until
        `deadline` (`time.monotonic()`; None: however long it takes)."""
        await self.ahead.stop()  # a save under way finishes upstream; the drain follows
        await self.mirror.aclose()
        await self.monitor.stop()
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        # their slots are known before the drain
        await self.unpinned.wait_settled(remaining)
        # a cut task's read of its slot gets half of what is left: the drain needs the rest
        await self.stages.cut_tasks.wait_settled(None if remaining is None else remaining / 2)
        if self.disk is not None:
            await self.disk.wait_settled(None if remaining is None else remaining / 4)
        if self.disk is not None and self.disk.settings.drain_on_shutdown:
            # requests have finished or were cut (the server saw to it): keep what the slots hold
            report = await self.disk.drain(self.tables, self._owner_of, deadline)
            log.info("drain: %d slots archived", report.saved)
            if report.left:
                log.warning(
                    "drain: %d slot(s) worth keeping not archived: %s",
                    len(report.left),
                    "; ".join(report.left),
                )
        if self.disk is not None:
            # a clean stop leaves only what is new kept: the drain's archives cut too
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            await self.disk.wait_cut(left)
        if self.claims is not None:
            await self.claims.stop()  # what the slots hold now, for the next to hold them

    def runs_nothing_on(self, upstream: Upstream) -> bool:
        """No request, save or restore of this proxy under way on `upstream`: a cluster lease
        on it may be given up (cluster/keeper.py)."""
        # a router's model instances are upstreams of their own, at its address
        mine = [table for table in self.tables if table.upstream.base_url == upstream.base_url]
        return upstream.in_flight == 0 and not any(
            table.upstream.in_flight or any(slot.busy for slot in table.slots) for table in mine
        )

    def _owner_of(self, slot: SlotState) -> str | None:
        """Whose text a slot holds, for the work no request asked for (archiving ahead, the
        drain): one of unknown origin is the single user's, if no tenants exist. A request
        reads its caller's view instead (`Stages.moves`)."""
        owner = owner_with_tenants if self.tenants.has_tenants() else owner_single_user
        return owner(slot)

    # -- requests ----------------------------------------------------------------------------

    def prompt_limits(self) -> PromptLimits:
        """What every healthy upstream accepts (guards.py); unknown before any answered."""
        self._prompt_limits = guards.prompt_limits(self.tables, self._prompt_limits)
        return self._prompt_limits

    async def handle(self, request: web.Request, placed: PlacedRequest) -> web.StreamResponse:
        """Serve a task request: admitted (counted against its tenant's cap on requests in
        progress until it ends), then run by the shape that serves it."""
        stages = self.stages
        placed = await stages.admit(placed)
        try:
            if placed.path in OPAQUE_ROUTES and placed.single_task():
                return await run_opaque(stages, self.chunked, request, placed)
            route = MIRRORED_ROUTES.get(placed.path)
            try:
                allowed = self.models.allowed(placed)
                plan = None if route is None else split_plan(allowed, placed, route)
                if plan is not None:
                    return await run_split(stages, request, placed, plan)
                if route is not None and placed.single_task():
                    slot_id = self._named_slot(placed)
                    if slot_id is None or _has_slot(allowed, slot_id):
                        return await run_single(
                            stages, self.chunked, request, placed, route, slot_id
                        )
                    # else the server's own answer to a slot it does not have
            except NotMirrorable:  # raised by the mirror, before anything ran
                pass
            return await self.unpinned.run(request, placed)
        finally:
            stages.leave(placed)

    async def unavailable(self, tenants_exist: bool) -> ApiError | None:
        """Why no task can be served now (None: one can): every upstream down or loading, or,
        with tenants, every one refused for its shared RAM cache (`/health`)."""
        down = await self.monitor.unavailable()
        if down is not None:
            return down
        if tenants_exist:
            try:
                guards.require_isolating_upstreams(self.tables)
            except ApiError as refused:
                return refused
        return None

    def _named_slot(self, placed: PlacedRequest) -> int | None:
        """The client's own `id_slot`, honoured when no tenants are configured (a tenant's
        choice could reach another's text); None (or -1): the proxy chooses."""
        slot_id = placed.document.get("id_slot")
        if not isinstance(slot_id, int) or isinstance(slot_id, bool) or slot_id < 0:
            return None
        return None if placed.caller.tenants_exist else slot_id

    def usage_of(self, tenant_id: str) -> dict[str, float]:
        """A tenant's requests and prompt tokens through the slots, and the share reused."""
        usage = self.usage.get(tenant_id, Counter())
        figures = {name: usage[name] for name in USAGE_FIGURES}
        prompt = figures["prompt_tokens"]
        return {**figures, "reuse_ratio": figures["reused_tokens"] / prompt if prompt else 0.0}


def _has_slot(tables: list[UpstreamSlots], slot_id: int) -> bool:
    return any(table.healthy and slot_id < len(table.slots) for table in tables)
