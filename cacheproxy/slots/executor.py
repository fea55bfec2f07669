"""The executor: token mirror -> routing plan -> slot lease -> forward -> table update -> metrics.

It holds no policy of its own (the routing policy decides, the table remembers); it does the I/O
they need, and keeps the table honest: every prediction is checked against `timings.cache_n`,
every answer rewrites its slot, and `GET /slots` corrects what was missed.

It stays one module (over 500 lines): every request shape (single, split, opaque, whole
upstream) goes through the same admit, lease, disk tier, RAM-cache shadow, forward, release and
account sequence, whose steps share the lease and must all run in its `finally`; split, each
part would pass the lease around.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, replace

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from cacheproxy.apis.observe import TaskObserver, pinned_task
from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.disk.tier import DiskTier, DiskUnavailable, MoveSources, Prepared
from cacheproxy.errors import ApiError
from cacheproxy.ops.logs import REQUEST_LOG, log_request
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.tracing import NO_SPAN, NO_TRACING, RequestTracer
from cacheproxy.settings import RoutingSettings, SchedulingSettings
from cacheproxy.slots.admission import (
    CONCURRENCY_LIMIT_ERROR,
    QUEUE_LIMIT_ERROR,
    ConcurrencyGate,
    ConcurrencyLimited,
)
from cacheproxy.slots.archive_ahead import ArchiveAhead
from cacheproxy.slots.chunked_prefill import chunk_ends, chunk_tokens
from cacheproxy.slots.fanout import FanoutPlan, NotSplittable, SubTask, plan_fanout
from cacheproxy.slots.fanout_relay import TaskOutput, relay_fanout, run_upstream_task
from cacheproxy.slots.mirror import NotMirrorable, RouteKind, TokenMirror
from cacheproxy.slots.monitor import UpstreamMonitor
from cacheproxy.slots.prompt_bounds import PromptLimits, RequestRejected, check_task_body
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.routing import RoutingPolicy
from cacheproxy.slots.scheduler import (
    NoUpstream,
    Overloaded,
    SlotScheduler,
    TenantQueueFull,
    Verdict,
)
from cacheproxy.slots.shapes import (
    AGENT_APIS,
    ANSWER_OBSERVERS,
    CHAT_ROUTE,
    MIRRORED_ROUTES,
    OPAQUE_ROUTES,
    infill_affinity_key,
)
from cacheproxy.slots.unpinned import UnpinnedRequests
from cacheproxy.tenancy.metering import Meter
from cacheproxy.tenancy.registry import DEFAULT_TENANT, TenantRegistry
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.http1 import UpstreamConnections
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.relay import ResponseObserver, forward, send_upstream
from cacheproxy.upstreams.slot_table import UNANSWERED, Lease, ReuseBounds, SlotState, TaskOutcome

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOG)

RETRY_AFTER_S = "1"
MIB = 1 << 20
USAGE_FIGURES = ("requests", "prompt_tokens", "reused_tokens", "decoded_tokens")


@dataclass
class Chunks:
    """What the chunks of one prompt computed so far (see `CacheLayer._prefill_in_chunks`)."""

    end: int  # the slot holds the prompt's first `end` tokens
    count: int = 0
    cache_n: int | None = None  # what the first chunk reused
    prompt_n: int = 0
    prompt_ms: float = 0.0
    running: bool = False  # a chunk is under way: what the slot holds is not known
    failed: bool = False

    def add(self, end: int, outcome: TaskOutcome) -> None:
        if self.count == 0:
            self.cache_n = outcome.cache_n
        self.count += 1
        self.end = end
        self.prompt_n += outcome.prompt_n or 0
        self.prompt_ms += outcome.prompt_ms or 0.0

    def end_known(self) -> bool:
        return self.count > 0 and not self.failed

    def between(self) -> bool:
        """Stopped between two chunks (or after the last): the slot holds exactly `end`."""
        return self.count > 0 and not self.running and not self.failed

    def outcome(self) -> TaskOutcome:
        """The chunks as one task that computed the prompt's first `end` tokens."""
        return TaskOutcome(
            ok=True,
            cache_n=self.cache_n,
            prompt_n=self.prompt_n,
            prompt_ms=self.prompt_ms,
            tokens_cached=self.end,
            generated=[],
            predicted_n=0,
        )

    def merged(self, final: TaskOutcome) -> TaskOutcome:
        """The request's outcome with its chunks: each prompt token computed counted once, as
        computed; reused only what the first chunk reused (when the request reused no more
        than the chunks left, else its own figure, which the prediction check then reports)."""
        if self.count == 0:
            return final
        computed_here = final.cache_n is not None and final.cache_n <= self.end
        reused = self.cache_n if computed_here else final.cache_n
        return replace(
            final,
            cache_n=reused,
            prompt_n=self.prompt_n + (final.prompt_n or 0) if final.prompt_n is not None else None,
            prompt_ms=self.prompt_ms + (final.prompt_ms or 0.0),
        )


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
    ) -> None:
        scheduling = scheduling or SchedulingSettings()
        self.upstreams = upstreams
        self.tracer = tracer
        self.disk = disk
        self.meter = meter  # the usage ledger and the tenants' limits
        self.tenants = tenants
        self.session = session
        self.connections = connections
        self.settings = settings
        self.metrics = metrics
        self.upstream_api_key = upstream_api_key
        self.client = UpstreamClient(session, upstream_headers)
        self.mirror = TokenMirror(session, upstream_headers, settings.mirror_memo_mib * MIB)
        self.scheduler = SlotScheduler(
            [],
            policy,
            settings.max_queue,
            open_tenant=DEFAULT_TENANT.id,
            fair_share=scheduling.fair_share,
            batch_factor=scheduling.batch_factor,  # bounds come with each request's limits
            share_window_s=scheduling.share_window_s,
            chunked_prefill=scheduling.prefill_chunk_ms > 0,
        )
        self.prefill_chunk_ms = scheduling.prefill_chunk_ms
        self._prompt_limits = PromptLimits()  # the last `prompt_limits()` answer
        self.gate = ConcurrencyGate()
        metrics.queue_depth.set_function(lambda: self.scheduler.queued)  # read when scraped
        self.usage: dict[str, Counter[str]] = defaultdict(Counter)
        self.monitor = UpstreamMonitor(
            upstreams, self.client, settings, self.scheduler, metrics, disk
        )
        self.tables = self.monitor.tables  # the same list: the monitor fills and rebuilds it
        # a conversation on a loaded upstream may be moved to the one a request was placed on
        self._move_sources = MoveSources(
            self.tables,
            self._owner_of,
            self.scheduler.lend_for_move,
            self.scheduler.return_from_move,
        )
        self.ahead = ArchiveAhead(disk, self.scheduler, self.tables, self._owner_of)
        self.unpinned = UnpinnedRequests(
            self.scheduler,
            self.client.with_timeout(settings.health_timeout_s),
            session,
            connections,
            metrics,
            upstream_api_key,
            disk,
            meter,
        )

    # -- life cycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Read every upstream's slots; refuse (raise) a server the table cannot follow."""
        await self.monitor.start()
        self.ahead.start()

    async def stop(self, deadline: float | None = None) -> None:
        """Stop watching the upstreams and archive the live slots worth keeping, until
        `deadline` (`time.monotonic()`; None: however long it takes)."""
        await self.ahead.stop()  # a save under way finishes upstream; the drain follows
        await self.monitor.stop()
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        await self.unpinned.wait_settled(remaining)  # their slots are known before the drain
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

    def runs_nothing_on(self, upstream: Upstream) -> bool:
        """No request, save or restore of this proxy under way on `upstream`: a cluster lease
        on it may be given up (cluster/keeper.py)."""
        return upstream.in_flight == 0 and not any(
            slot.busy for table in self.tables if table.upstream is upstream for slot in table.slots
        )

    def _owner_of(self, slot: SlotState) -> str | None:
        """Whose text a slot holds; one of unknown origin is the single user's, if no tenants."""
        if slot.tenant is None and not self.tenants.has_tenants():
            return DEFAULT_TENANT.id
        return slot.tenant

    # -- requests ----------------------------------------------------------------------------

    def prompt_limits(self) -> PromptLimits:
        """What every healthy upstream accepts: ids below the smallest vocabulary, prompts
        shorter than the largest slot context. Unknown (None) before any upstream answered."""
        # plain loops: asked twice a request (generators cost more than the work)
        n_vocab: int | None = None
        n_ctx: int | None = None
        for table in self.tables:
            if not table.healthy or not table.slots:
                continue
            if table.n_vocab and (n_vocab is None or table.n_vocab < n_vocab):
                n_vocab = table.n_vocab
            for slot in table.slots:
                if n_ctx is None or slot.n_ctx > n_ctx:
                    n_ctx = slot.n_ctx
        limits = self._prompt_limits
        if limits.n_vocab != n_vocab or limits.n_ctx != n_ctx:  # else the same (frozen) object
            limits = self._prompt_limits = PromptLimits(n_vocab, n_ctx)
        return limits

    async def handle(self, request: web.Request, placed: PlacedRequest) -> web.StreamResponse:
        """Serve a task request, counted against its tenant's cap on requests in progress."""
        try:
            # entered and left by hand: the gate's context manager costs a generator a request
            self.gate.enter(placed.tenant, placed.limits.max_concurrent)
        except ConcurrencyLimited as exc:
            self.metrics.tenant_refused.labels(placed.tenant, CONCURRENCY_LIMIT_ERROR).inc()
            raise ApiError(
                429,
                str(exc),
                CONCURRENCY_LIMIT_ERROR,
                headers={"Retry-After": str(self.scheduler.retry_after_s(0))},
            ) from None
        try:
            return await self._handle(request, placed)
        finally:
            self.gate.leave(placed.tenant)

    async def _handle(self, request: web.Request, placed: PlacedRequest) -> web.StreamResponse:
        # an idle upstream's check may find it restarted and still loading: then the answer
        # is llama-server's own 503, as `require_an_upstream` gives with none in service
        await self.monitor.recheck_idle()
        await self.monitor.require_an_upstream()
        self._require_isolating_upstreams()
        limits = self.prompt_limits()
        if placed.checked_with != limits:
            # parsed before the upstreams were known (or they changed since): check again
            try:
                check_task_body(placed.path, placed.document, limits)
            except RequestRejected as rejected:
                raise rejected.as_api_error() from None
        api = AGENT_APIS.get(placed.path)
        if api is not None:
            placed = replace(placed, document=api.chat_request(placed.document), api=api)
        if placed.path in OPAQUE_ROUTES and placed.single_task():
            session = placed.session or infill_affinity_key(placed.document)
            lease = await self._acquire(
                self.scheduler.acquire_opaque(
                    placed.tenant, session, placed.limits.share, placed.limits.max_queued
                ),
                placed.tenant,
            )
            return await self._run_on_slot(request, placed, lease, oai=False)
        route = MIRRORED_ROUTES.get(placed.path)
        if route is not None and (plan := self._fanout_plan(placed, route)) is not None:
            return await self._handle_fanout(request, placed, plan, limits.n_ctx)
        if route is None or not placed.single_task():
            return await self._handle_whole_upstream(request, placed)
        kind, oai = route
        named_slot = self._named_slot(placed)
        if named_slot is not None and not self._has_slot(named_slot):
            return await self._handle_whole_upstream(request, placed)  # the server's own answer
        base_url = self._mirror_upstream().base_url
        tracer = self.tracer
        span = tracer.span("mirror", route=kind) if tracer.enabled else NO_SPAN
        try:
            with span as stage:
                prompt = await self.mirror.prompt_tokens(
                    kind, placed.document, base_url, placed.tenant, limits.n_ctx
                )
                if tracer.enabled:
                    stage.set(prompt_tokens=len(prompt))
        except NotMirrorable:
            return await self._handle_whole_upstream(request, placed)
        except TOKENIZING_FAILURES as exc:
            raise _tokenizing_failed(base_url, exc) from _tokenizing_cause(exc)
        self._take_prompt(placed.tenant, len(prompt))
        lease = await self._lease_for(placed, prompt, slot_id=named_slot)
        return await self._run_on_slot(request, placed, lease, oai)

    async def _lease_for(
        self,
        placed: PlacedRequest,
        prompt: list[int],
        patient: bool = True,
        slot_id: int | None = None,
    ) -> Lease:
        """A slot for `prompt`, placed within the tenant's share and bounds."""
        shareable = self._public_prefix_length(prompt) if placed.may_use_public_prefixes else 0
        return await self._acquire(
            self.scheduler.acquire(
                prompt,
                placed.tenant,
                placed.session,
                placed.cache_prompt,
                shareable,
                patient=patient,
                share=placed.limits.share,
                queue_bound=placed.limits.max_queued,
                slot_id=slot_id,
            ),
            placed.tenant,
        )

    def _take_prompt(self, tenant: str, n_tokens: int) -> None:
        if self.meter is not None:  # 429 when over the tenant's prompt tokens per minute
            self.meter.take_prompt(tenant, n_tokens)

    def _named_slot(self, placed: PlacedRequest) -> int | None:
        """The client's own `id_slot`, honoured when no tenants are configured (a tenant's
        choice could reach another's text); None (or -1): the proxy chooses."""
        slot_id = placed.document.get("id_slot")
        if not isinstance(slot_id, int) or isinstance(slot_id, bool) or slot_id < 0:
            return None
        return None if self.tenants.has_tenants() else slot_id

    def _has_slot(self, slot_id: int) -> bool:
        return any(table.healthy and slot_id < len(table.slots) for table in self.tables)

    def _public_prefix_length(self, prompt: list[int]) -> int:
        """The longest admin-marked public prefix the prompt starts with (0: none)."""
        if not self.tenants.has_public_prefixes():
            return 0
        return max(
            (
                len(prefix.tokens)
                for prefix in self.tenants.public_prefixes()
                if prompt[: len(prefix.tokens)] == prefix.tokens
            ),
            default=0,
        )

    async def _run_on_slot(
        self, request: web.Request, placed: PlacedRequest, lease: Lease, oai: bool
    ) -> web.StreamResponse:
        outcome = UNANSWERED
        disk_action = ""  # what the disk tier did to the slot (nothing, should it fail first)
        chunks: Chunks | None = None
        try:
            prepared = await self._prepare_slot(lease, placed)
            disk_action = prepared.action
            lease = self.scheduler.prepared(
                lease, prepared.predicted, prepared.isolate, prepared.branch
            )
            lease.table.shadow_dispatch(
                lease.slot.slot_id, _held(lease, prepared), lease.prompt, not lease.unpinned
            )
            if lease.chunked:
                chunks = Chunks(lease.predicted.low)
                lease = await self._prefill_in_chunks(lease, chunks)
            response, outcome = await self._forward_on_slot(request, placed, lease, oai)
            if chunks is not None:
                outcome = chunks.merged(outcome)
            return response
        finally:
            if chunks is not None and not outcome.ok and chunks.between():
                # the client left between two chunks: the slot holds exactly what they computed
                lease, outcome = replace(lease, prompt=lease.prompt[: chunks.end]), chunks.outcome()
            verdict = self.scheduler.release(lease, outcome)
            self._account(placed, lease, outcome, verdict, disk_action)

    async def _prefill_in_chunks(self, lease: Lease, chunks: Chunks) -> Lease:
        """Compute the leased prompt but its last piece in chunks (chunked_prefill.py), each a
        request pinned to the slot with a prefix of the prompt and nothing generated, the
        scheduler letting other tenants' prompts go first between them. Returns the lease for
        the request itself, which reuses what the chunks computed. A chunk that fails or leaves
        the slot other than expected ends the chunking: the request then goes out as leased."""
        if lease.predicted.low != lease.predicted.high:
            return lease  # where the chunks would start is not known
        tokens = chunk_tokens(lease.table.prefill_ms_per_token.value, self.prefill_chunk_ms)
        ends = chunk_ends(len(lease.prompt), lease.predicted.low, tokens)
        isolate = lease.isolate
        for end in ends:
            await self.scheduler.chunk_turn(lease, len(lease.prompt) - chunks.end)
            chunks.running = True
            outcome = await self._compute_chunk(lease, lease.prompt[:end], isolate)
            chunks.running = False
            if not outcome.ok or outcome.tokens_cached != end:
                # what the slot holds now is not known; after a chunk that ended, only this
                # tenant's text (or less): the request reuses what is left of it
                chunks.failed = True
                return self.scheduler.chunks_done(lease) if chunks.count else lease
            chunks.add(end, outcome)
            self.scheduler.chunk_done(lease, end)
            isolate = False  # the slot holds this tenant's text now
        if not chunks.end_known():
            return lease
        # the last piece, computed by the request itself, yields like a chunk
        await self.scheduler.chunk_turn(lease, len(lease.prompt) - chunks.end)
        return self.scheduler.chunks_done(lease)

    async def _compute_chunk(self, lease: Lease, prefix: list[int], isolate: bool) -> TaskOutcome:
        """One chunk: `prefix` computed into the leased slot, one token sampled and not kept
        (`n_predict` 0 still samples one; the slot then holds exactly the prompt). Streamed, so
        the server notices at once if the client leaves (the request is cancelled with it)."""
        body = {
            "prompt": prefix,
            "n_predict": 0,
            "id_slot": lease.slot.slot_id,
            "cache_prompt": not isolate,
            "stream": True,
        }
        upstream = lease.table.upstream
        last = b""
        try:
            with self.tracer.span("chunk", **_where(lease)):
                response = await send_upstream(
                    self.session,
                    "POST",
                    upstream.url("/completion"),
                    orjson.dumps(body),
                    CIMultiDict(self.client.headers),
                )
                async with response:
                    if response.status != 200:
                        await response.read()
                        return TaskOutcome(ok=False)
                    async for line in response.content:
                        if line.startswith(b"data: "):
                            last = line
        except (aiohttp.ClientError, TimeoutError) as exc:
            # the request itself will meet the upstream's failure and report it
            log.warning("a prefill chunk on %s failed: %r", upstream.base_url, exc)
            return TaskOutcome(ok=False)
        try:
            final = orjson.loads(last[len(b"data: ") :])
        except orjson.JSONDecodeError:
            return TaskOutcome(ok=False)
        timings = final.get("timings") or {}
        if final.get("stop") is not True or "error" in final:
            return TaskOutcome(ok=False)
        return TaskOutcome(
            ok=True,
            cache_n=timings.get("cache_n"),
            prompt_n=timings.get("prompt_n"),
            prompt_ms=timings.get("prompt_ms"),
            tokens_cached=final.get("tokens_cached"),
            predicted_ms=timings.get("predicted_ms"),
        )

    async def _prepare_slot(self, lease: Lease, placed: PlacedRequest) -> Prepared:
        """Let the disk tier archive what the slot held and restore a better state into it."""
        if self.disk is None:
            return Prepared.as_leased(lease)
        try:
            return await self.disk.prepare(
                lease, placed.tenant, placed.cache_prompt, self._move_sources
            )
        except (
            aiohttp.ClientError,
            TimeoutError,
            OSError,
            *DATABASE_ERRORS,
            DiskUnavailable,
        ) as exc:
            # the slot may hold anything now: reuse none of it; the request itself will tell
            # whether the upstream is still there. A disk fault never fails the request (the
            # tier turns itself off on the ones it sees; this catches any it did not).
            log.warning("disk tier on %s failed: %r", lease.table.upstream.base_url, exc)
            return Prepared(ReuseBounds(0, 0), isolate=True, action="")

    async def _forward_on_slot(
        self, request: web.Request, placed: PlacedRequest, lease: Lease, oai: bool
    ) -> tuple[web.StreamResponse, TaskOutcome]:
        stream = placed.stream
        document, observer = pinned_task(
            placed.document,
            lease,
            stream,
            oai,
            placed.hide_cache_signals and placed.api is None,
            ANSWER_OBSERVERS.get(placed.path, TaskObserver),
            shown_as_sent=placed.api is None,
        )
        if stream:  # its first event ends its prefill: the scheduler need not guess
            observer.on_first_event = functools.partial(self.scheduler.prefill_ended, lease)
        shown: ResponseObserver = observer
        if placed.api is not None:  # the chat answer, shown in the agent API's form
            shown = placed.api.observer(observer, placed.hide_cache_signals)
        tracer = self.tracer
        try:
            # off: the shared no-op span, no attributes gathered for it
            span = tracer.span("upstream", **_where(lease)) if tracer.enabled else NO_SPAN
            with span as stage:
                response = await forward(
                    request,
                    self.session,
                    lease.table.upstream,
                    orjson.dumps(document),
                    self.upstream_api_key,
                    streams=stream,
                    observer=shown,
                    forward_client_key=placed.forward_client_key,
                    target=CHAT_ROUTE if placed.api is not None else None,
                    connections=self.connections,
                )
                outcome = observer.outcome()
                if tracer.enabled:
                    stage.set(
                        status=response.status, cache_n=outcome.cache_n, prompt_n=outcome.prompt_n
                    )
        except BaseException:
            self._charge_cut(placed.tenant, observer)
            raise
        return response, outcome

    def _charge_cut(self, tenant: str, observer: TaskObserver) -> None:
        """A task cut before its end (the client left, the upstream broke off): the tokens
        it streamed were generated all the same, and are counted and charged."""
        seen = observer.outcome().predicted_n
        if self.meter is not None and seen:
            cut = TaskOutcome(ok=False, predicted_n=seen)
            self.meter.record_outcome(tenant, cut, None, "", prompt_taken=True)

    def _fanout_plan(
        self, placed: PlacedRequest, route: tuple[RouteKind, bool]
    ) -> FanoutPlan | None:
        """The single tasks of a request with several prompts or completions (None: it is one),
        refused (400) as llama-server refuses them; `n` is bounded by the largest upstream's
        slot count, as llama-server bounds it by its own."""
        kind, oai = route
        if kind == "responses":  # its several-answer shape is llama-server's alone to make
            return None
        slot_counts = [len(table.slots) for table in self.tables if table.healthy and table.slots]
        try:
            return plan_fanout(kind, oai, placed.document, max(slot_counts, default=None))
        except RequestRejected as rejected:
            raise rejected.as_api_error() from None
        except NotSplittable:
            return None

    async def _handle_fanout(
        self, request: web.Request, placed: PlacedRequest, plan: FanoutPlan, n_ctx: int | None
    ) -> web.StreamResponse:
        """Each task placed through the table like a single request (a slot of its own, or the
        queue; the disk tier prepares each), all run at once, their answers merged back."""
        base_url = self._mirror_upstream().base_url
        prompts: list[list[int]] = []
        try:
            for task in plan.tasks:  # a child's prompt is its parent's
                prompts.append(
                    prompts[-1]
                    if task.child
                    else await self._task_prompt(task, base_url, placed.tenant, n_ctx)
                )
        except NotMirrorable:
            return await self._handle_whole_upstream(request, placed)
        except TOKENIZING_FAILURES as exc:
            raise _tokenizing_failed(base_url, exc) from _tokenizing_cause(exc)
        self._take_prompt(placed.tenant, sum(map(len, prompts)))

        async def run(task: SubTask, output: TaskOutput) -> None:
            await self._run_task(request, placed, plan.oai, prompts[task.index], task, output)

        return await relay_fanout(request, plan, run)

    async def _task_prompt(
        self, task: SubTask, base_url: str, tenant: str, n_ctx: int | None
    ) -> list[int]:
        if task.prompt_input is None:
            return await self.mirror.prompt_tokens("chat", task.body, base_url, tenant, n_ctx)
        return await self.mirror.mixed_tokens(task.prompt_input, base_url, tenant, n_ctx)

    async def _run_task(
        self,
        request: web.Request,
        placed: PlacedRequest,
        oai: bool,
        prompt: list[int],
        task: SubTask,
        output: TaskOutput,
    ) -> None:
        """One task of a split request on a slot of its own, from lease to release."""
        # the others would wait for their siblings' slots
        lease = await self._lease_for(placed, prompt, patient=task.index == 0)
        outcome = UNANSWERED
        disk_action = ""  # what the disk tier did to the slot (nothing, should it fail first)
        try:
            prepared = await self._prepare_slot(lease, placed)
            disk_action = prepared.action
            lease = self.scheduler.prepared(
                lease, prepared.predicted, prepared.isolate, prepared.branch
            )
            lease.table.shadow_dispatch(
                lease.slot.slot_id, _held(lease, prepared), lease.prompt, not lease.unpinned
            )
            document, observer = pinned_task(
                task.body, lease, placed.stream, oai, placed.hide_cache_signals
            )
            try:
                tracer = self.tracer
                span = tracer.span("upstream", **_where(lease)) if tracer.enabled else NO_SPAN
                with span:
                    await run_upstream_task(
                        request,
                        self.session,
                        lease.table.upstream,
                        orjson.dumps(document),
                        output,
                        observer,
                        self.upstream_api_key,
                        streams=placed.stream,
                        forward_client_key=placed.forward_client_key,
                        connections=self.connections,
                    )
            except BaseException:
                self._charge_cut(placed.tenant, observer)
                raise
            outcome = observer.outcome()
        finally:
            verdict = self.scheduler.release(lease, outcome)
            self._account(placed, lease, outcome, verdict, disk_action)

    async def _handle_whole_upstream(
        self, request: web.Request, placed: PlacedRequest
    ) -> web.StreamResponse:
        """A request that may use any slot (a batch, n > 1, a route that ignores id_slot):
        it gets a whole upstream, see `UnpinnedRequests`."""
        return await self.unpinned.run(request, placed, self._acquire)

    async def _acquire(self, waiting, tenant: str):  # noqa: ANN001, ANN202 - a scheduler coroutine and its lease
        try:
            with self.tracer.span("queue") as stage:
                lease = await waiting
                # off: the shared no-op span, and no attributes gathered for it
                if self.tracer.enabled and isinstance(lease, Lease):
                    stage.set(**_where(lease))
        except TenantQueueFull as exc:
            self.metrics.tenant_refused.labels(tenant, QUEUE_LIMIT_ERROR).inc()
            raise ApiError(
                429, str(exc), QUEUE_LIMIT_ERROR, headers={"Retry-After": str(exc.retry_after_s)}
            ) from exc
        except Overloaded as exc:
            self.metrics.rejected.inc()
            raise ApiError(
                503, f"server busy: {exc}", headers={"Retry-After": RETRY_AFTER_S}
            ) from exc
        except NoUpstream as exc:
            raise ApiError(502, str(exc)) from exc
        self.metrics.queue_wait.observe(lease.queued_s)
        return lease

    async def unavailable(self) -> ApiError | None:
        """Why no task can be served now (None: one can): every upstream down or loading, or
        every one refused for tenants (`/health`)."""
        down = await self.monitor.unavailable()
        if down is not None:
            return down
        try:
            self._require_isolating_upstreams()
        except ApiError as refused:
            return refused
        return None

    def _require_isolating_upstreams(self) -> None:
        """With tenants, a server RAM cache (shared by all slots, hence all tenants) could hand
        one tenant's state to another: refuse to serve rather than risk it, also while the
        probe could not yet tell whether there is one."""
        if not self.tenants.has_tenants():
            return
        for table in self.tables:
            if table.healthy and table.ram_cache:
                break
        else:
            return  # the common case, without building the list below
        shared = [t for t in self.tables if t.healthy and t.ram_cache]
        if shared:
            names = ", ".join(
                f"{t.upstream.base_url} (RAM cache {t.ram_cache_state})" for t in shared
            )
            raise ApiError(
                503,
                f"upstream {names}: a server RAM prompt cache is shared by all tenants, and an"
                " unknown one is treated as shared (the probe needs an idle slot and is retried)."
                " Run llama-server with --cache-ram 0 to serve tenants (and, if the probe cannot"
                ' run, declare that with the setting routing.server_ram_cache = "off")',
            )

    def _mirror_upstream(self) -> Upstream:
        for table in self.tables:
            if table.healthy:
                return table.upstream
        return self.upstreams[0]

    def _account(
        self,
        placed: PlacedRequest,
        lease: Lease,
        outcome: TaskOutcome,
        verdict: Verdict,
        disk_action: str,
    ) -> None:
        tenant = placed.tenant
        usage = self.usage[tenant]
        usage["requests"] += 1
        prompt_tokens = len(lease.prompt)
        if lease.opaque:  # the server counted it: what it reused plus what it decoded
            prompt_tokens = (outcome.cache_n or 0) + (outcome.prompt_n or 0)
        usage["prompt_tokens"] += prompt_tokens
        usage["reused_tokens"] += outcome.cache_n or 0
        usage["decoded_tokens"] += outcome.prompt_n or 0
        if self.meter is not None:
            self.meter.record_outcome(
                tenant, outcome, lease.previous.owner, disk_action, prompt_taken=not lease.opaque
            )
        metrics = self.metrics
        by_tenant = (tenant,)
        metrics.count(
            (metrics.requests, (tenant, "slot"), 1),
            (metrics.prompt_tokens, by_tenant, prompt_tokens),
            (metrics.reused_tokens, by_tenant, outcome.cache_n),
            (metrics.decoded_tokens, by_tenant, outcome.prompt_n),
            (metrics.predictions, (self._judge(lease, verdict),), 1),
        )
        if not request_log.isEnabledFor(logging.INFO):
            return
        log_request(
            request_log,
            tenant=tenant,
            upstream=lease.table.upstream.base_url,
            slot=lease.slot.slot_id,
            action=disk_action or _action(prompt_tokens, outcome),
            prompt=prompt_tokens,
            reused=outcome.cache_n,
            decoded=outcome.prompt_n,
            queued_ms=round(lease.queued_s * 1000, 1),
            ms=round((time.monotonic() - placed.received) * 1000, 1),
        )

    def _judge(self, lease: Lease, verdict: Verdict) -> str:
        if not verdict.checked:
            return "unchecked"
        lease.table.task_answered(lease.slot.slot_id)  # it ran: the server gave it a task id
        if verdict.matched:
            return "match"
        if (shadow := lease.table.ram_shadow) is not None and not lease.opaque:
            # the slot's row is rewritten from the answer (release); the shadow drops what the
            # server moved out of its RAM cache
            shadow.observed(
                lease.prompt, verdict.predicted.high, verdict.cache_n or 0, lease.slot.slot_id
            )
            base_url = lease.table.upstream.base_url
            self.metrics.shadow_mispredictions.labels(base_url).inc()
            self.metrics.shadow_budget.labels(base_url).set(shadow.budget_bytes)
        if lease.table.ram_cache and verdict.cache_n > verdict.predicted.high:
            return "ram_load"
        log.warning(
            "reuse misprediction on %s slot %d: predicted %s, server reused %d",
            lease.table.upstream.base_url,
            lease.slot.slot_id,
            verdict.predicted,
            verdict.cache_n,
        )
        if verdict.cache_n < verdict.predicted.low:
            self.monitor.wake()  # the server holds less than we thought: did it restart?
        return "mismatch"

    def usage_of(self, tenant_id: str) -> dict[str, float]:
        """A tenant's requests and prompt tokens through the slots, and the share reused."""
        usage = self.usage.get(tenant_id, Counter())
        figures = {name: usage[name] for name in USAGE_FIGURES}
        prompt = figures["prompt_tokens"]
        return {**figures, "reuse_ratio": figures["reused_tokens"] / prompt if prompt else 0.0}


def _where(lease: Lease) -> dict[str, str | int]:
    """A leased slot as span attributes."""
    return {"upstream": lease.table.upstream.base_url, "slot": lease.slot.slot_id}


# what the mirror raises for a prompt it could not tokenize (nothing was run yet)
TOKENIZING_FAILURES = (RequestRejected, aiohttp.ClientError, TimeoutError)


def _tokenizing_failed(base_url: str, exc: Exception) -> ApiError:
    """The proxy's answer to a prompt the mirror could not tokenize."""
    if isinstance(exc, RequestRejected):  # tokenized, over the context
        return exc.as_api_error()
    return ApiError(502, f"upstream {base_url} failed to tokenize: {exc!r}")


def _tokenizing_cause(exc: Exception) -> Exception | None:
    # a refusal is the client's, its traceback of no use; an upstream failure is the cause
    return None if isinstance(exc, RequestRejected) else exc


def _held(lease: Lease, prepared: Prepared) -> list[int] | None:
    """What the slot held as the task goes out, when all of it is known (not after a restore)."""
    exact = lease.previous.unknown_tail == 0 and prepared.action != "restore" and not lease.opaque
    return lease.previous.known if exact else None


def _action(prompt_length: int, outcome: TaskOutcome) -> str:
    """What the slot did for the request: served it from cache, in part, or not at all."""
    if not outcome.ok or outcome.cache_n is None:
        return "failed"
    if outcome.cache_n == 0:
        return "cold"
    return "hit" if outcome.cache_n >= prompt_length - 1 else "partial"
