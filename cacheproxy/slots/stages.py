"""The stages a task request runs, named in one place (as SGLang's gateway lists its pipeline),
in the order they run. Until a slot is leased each reads the request (`PlacedRequest`: its
caller, body and limits), from then on one `SlotRun` (the request, its tokens and lease, the
outcome):

1. `admit`         within the tenant's cap on requests in progress (429; in a cluster, across
                   its proxies), an upstream in service, none whose RAM cache tenants would
                   share, the prompt within what the upstreams accept
2. `mirror`        the prompt's token ids, exactly as the server will cache them (mirror.py)
3. `meter_prompt`  its tokens taken from the tenant's prompt tokens per minute (429 past them)
4. `place`         a slot from the scheduler, within the tenant's share and bounds: the lease
5. `prepare`       the disk tier archives what the slot held and restores a better state there
6. `forward`       the task pinned to the slot, its answer relayed as it comes
7. `record`        the lease given back with the outcome: the table rewrites the slot, and the
                   prediction is checked against the server's `cache_n`
8. `account`       the tenant's usage, the ledger, the metrics, the request log

Before them the route resolves the caller once (http/routes.py, tenancy/auth.py `Callers`) and
admits the request to the ledger. The request shapes run the stages, each in a module of its
own: single.py (one prompt pinned to a slot), split.py (several prompts or completions, a task
each), opaque.py (`/infill`: prompt ids not known), unpinned.py (a whole upstream); chunks
(prefill_chunks.py) run between `prepare` and `forward`. From `place` on, a shape's `finally`
runs `record` and `account` whatever happens (`finish`); a task cut before its answer ended
first has its slot read, to charge what the server computed and know what it holds
(cut_tasks.py). A split request's tasks count against its tenant's cap (`more_tasks`) and
take a prompt's slots together (`place_group`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import NoReturn, TypeVar

import aiohttp
from aiohttp import web

from cacheproxy.apis.observe import TaskObserver
from cacheproxy.apis.pinned_task import pinned_task
from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.disk.attached import Saving
from cacheproxy.disk.tier import DiskTier, DiskUnavailable, MoveSources, Prepared
from cacheproxy.errors import ApiError
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.tracing import NO_SPAN, RequestTracer
from cacheproxy.slots.accounts import account_task
from cacheproxy.slots.admission import (
    CONCURRENCY_LIMIT_ERROR,
    QUEUE_LIMIT_ERROR,
    ConcurrencyGate,
    ConcurrencyLimited,
)
from cacheproxy.slots.chunked_prefill import Chunks
from cacheproxy.slots.claims_keeper import SlotClaims
from cacheproxy.slots.completion_ids import CompletionIds
from cacheproxy.slots.cut_tasks import CutTasks
from cacheproxy.slots.guards import require_isolating_upstreams, reuse_by_default
from cacheproxy.slots.lease_outcome import Verdict
from cacheproxy.slots.lease_terms import holds_foreign_text
from cacheproxy.slots.mirror import RouteKind, TokenMirror
from cacheproxy.slots.model_admission import ModelAdmission
from cacheproxy.slots.monitor import UpstreamMonitor
from cacheproxy.slots.prompt_bounds import PromptLimits, RequestRejected, check_task_body
from cacheproxy.slots.queue_bounds import Overloaded, TenantQueueFull
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.scheduler import NoUpstream, SlotScheduler
from cacheproxy.slots.sent_tasks import SentTask
from cacheproxy.slots.server_picked import unplaced_outcome
from cacheproxy.slots.shapes import AGENT_APIS, ANSWER_OBSERVERS, CHAT_ROUTE
from cacheproxy.slots.slot_views import owner_single_user, owner_with_tenants
from cacheproxy.slots.waiter import FindRestorable, UpstreamLease
from cacheproxy.tenancy.metering import Meter
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.tokens import common_prefix_length, reuse_with_shifts
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.http1 import UpstreamClosed, UpstreamUnreachable
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.relay import ResponseObserver, forward
from cacheproxy.upstreams.slot_table import UNANSWERED, Lease, ReuseBounds, TaskOutcome

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
Leased = TypeVar("Leased", Lease, list[Lease], UpstreamLease)


class SlotRun:
    """One task on one slot, from its lease to its release: what the stages after `place` read
    and write (a split request has one per task)."""

    __slots__ = (
        "chunks", "disk_action", "finished", "handover", "lease", "outcome", "placed", "saving",
        "sent",
    )  # fmt: skip

    def __init__(self, placed: PlacedRequest, lease: Lease) -> None:
        self.placed = placed  # the request: its caller, body and limits
        self.lease = lease  # the slot, and the prompt's tokens; the last one given is released
        self.outcome: TaskOutcome = UNANSWERED  # what the server answered, once it has
        self.disk_action = ""  # what the disk tier did to the slot (nothing, should it fail first)
        self.saving: Saving | None = None  # the commit of what the slot held, under way
        self.chunks: Chunks | None = None  # what its chunks computed, when in chunks
        self.sent: SentTask | None = None  # sent, and cut before its answer ended
        self.finished = False  # recorded and accounted (`Stages.finish`)
        # lined up behind the slot's running request (line_up.py): the lease it runs on once
        # that one is given back, the one it is recorded with
        self.handover: asyncio.Future[Lease] | None = None


class Stages:
    """The stages, with what they use: the scheduler, the mirror, the disk tier, the upstreams,
    the ledger and the metrics. Holds the tenants' usage through the slots (`usage`) and their
    requests in progress (`gate`)."""

    def __init__(
        self,
        scheduler: SlotScheduler,
        monitor: UpstreamMonitor,
        token_mirror: TokenMirror,
        tenants: TenantRegistry,
        prompt_limits: Callable[[], PromptLimits],
        session: aiohttp.ClientSession,
        connections: UpstreamConnections,
        upstream_api_key: str | None,
        metrics: ProxyMetrics,
        tracer: RequestTracer,
        disk: DiskTier | None,
        meter: Meter | None,
        client: UpstreamClient,
        models: ModelAdmission,
        claims: SlotClaims | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.monitor = monitor
        self.models = models  # the upstreams each request's model may be placed on
        self.tables = monitor.tables  # the same list: the monitor fills and rebuilds it
        self.token_mirror = token_mirror
        self.tenants = tenants  # the public prefixes (who a request acts for is its caller's)
        self.prompt_limits = prompt_limits
        self.session = session
        self.connections = connections
        self.upstream_api_key = upstream_api_key
        self.metrics = metrics
        self.tracer = tracer
        self.disk = disk
        self.meter = meter  # the usage ledger and the tenants' limits
        self.claims = claims  # whose text each slot holds, kept for the next holder
        self.gate = ConcurrencyGate(meter.across if meter is not None else None)
        self.cut_tasks = CutTasks(client)
        self.completion_ids = CompletionIds()  # what each tenant may name on the control routes
        self.usage: dict[str, Counter[str]] = defaultdict(Counter)
        # a conversation on a loaded upstream may be moved to the one a request was placed on;
        # whose text a slot holds follows the caller's view of whether tenants exist
        self.moves = {
            tenants_exist: MoveSources(
                self.tables, owner, scheduler.lend_for_move, scheduler.return_from_move
            )
            for tenants_exist, owner in ((True, owner_with_tenants), (False, owner_single_user))
        }

    # -- 1. admit ------------------------------------------------------------------------

    async def admit(self, placed: PlacedRequest) -> PlacedRequest:
        """Count the request against its tenant's cap on requests in progress (429 at it; given
        back by `leave`), check what would refuse it, and return it as it will run (an agent
        API's body converted to its chat request)."""
        cap = placed.limits.max_concurrent
        # entered and left by hand: the gate's context manager costs a generator a request
        await self._enter(placed, 1)
        admitted: PlacedRequest | None = None
        try:
            # an idle upstream's check may find it restarted and still loading: then the
            # answer is llama-server's own 503, as `require_an_upstream` gives with none
            await self.monitor.recheck_idle()
            await self.monitor.require_an_upstream()
            if placed.caller.tenants_exist:
                require_isolating_upstreams(self.tables)
            limits = self.prompt_limits()
            if placed.checked_with != limits:
                # parsed before the upstreams were known (or they changed since): check again
                try:
                    check_task_body(placed.path, placed.document, limits)
                except RequestRejected as rejected:
                    raise rejected.as_api_error() from None
                placed.checked_with = limits
            # the upstreams serving its model (a router's instance of it loaded if need be)
            placed = admitted = await self.models.admit(placed)
            if not reuse_by_default(self.tables, placed.tables):  # --no-cache-prompt
                placed = replace(placed, reuse_by_default=False)
            api = AGENT_APIS.get(placed.path)
            if api is not None:
                placed = replace(placed, document=api.chat_request(placed.document), api=api)
        except BaseException:
            if admitted is not None:
                self.models.leave(admitted)
            self.gate.leave(placed.tenant, cap)
            raise
        return placed

    def leave(self, placed: PlacedRequest) -> None:
        self.models.leave(placed)
        self.gate.leave(placed.tenant, placed.limits.max_concurrent)

    @contextlib.asynccontextmanager
    async def more_tasks(self, placed: PlacedRequest, count: int) -> AsyncIterator[None]:
        """A split request's `count` other tasks, each a request in progress for its tenant's
        cap (in a cluster, across its proxies: all taken at once or none), for the duration
        (429 past it: one that passes it alone never fits)."""
        if not count:
            yield
            return
        await self._enter(placed, count)
        try:
            yield
        finally:
            self.gate.leave(placed.tenant, placed.limits.max_concurrent, count)

    async def _enter(self, placed: PlacedRequest, count: int) -> None:
        cap = placed.limits.max_concurrent
        try:
            if not self.gate.enter(placed.tenant, cap, count):
                assert cap is not None  # only a capped tenant is counted across proxies
                await self.gate.enter_across(placed.tenant, cap, count)  # 503 if unreadable
        except ConcurrencyLimited as exc:
            self.metrics.tenant_refused.labels(placed.tenant, CONCURRENCY_LIMIT_ERROR).inc()
            headers = {"Retry-After": str(self.scheduler.retry_after_s(0))}
            raise ApiError(429, str(exc), CONCURRENCY_LIMIT_ERROR, headers=headers) from None

    # -- 2. mirror -----------------------------------------------------------------------

    async def mirror(self, placed: PlacedRequest, kind: RouteKind, n_ctx: int | None) -> list[int]:
        """The prompt's ids as the server will cache them. Raises `NotMirrorable` (nothing run
        yet) for a prompt only the server can read: a whole upstream serves it."""
        upstream = self.mirror_upstream(placed)
        tracer = self.tracer
        span = tracer.span("mirror", route=kind) if tracer.enabled else NO_SPAN
        try:
            with span as stage:
                prompt = await self.token_mirror.prompt_tokens(
                    kind, placed.document, upstream, placed.tenant, n_ctx
                )
                if tracer.enabled:
                    stage.set(prompt_tokens=len(prompt))
        except TOKENIZING_FAILURES as exc:
            tokenizing_failed(upstream.name, exc)
        return prompt

    def mirror_upstream(self, placed: PlacedRequest) -> Upstream:
        """Where the request's prompts are tokenized: the first healthy upstream it may be
        placed on (each model tokenizes its own way)."""
        for table in self.tables:
            if table.healthy and (placed.tables is None or table.index in placed.tables):
                return table.upstream
        return self.monitor.upstreams[0]

    # -- 3. meter ------------------------------------------------------------------------

    async def meter_prompt(self, placed: PlacedRequest, n_tokens: int) -> None:
        """Take the prompt's tokens from the tenant's tokens per minute (429 past them); with
        limits shared between proxies, this proxy's allowance is topped up when short."""
        meter = self.meter
        if meter is not None and not meter.take_prompt(placed.tenant, n_tokens):
            await meter.take_prompt_topped_up(placed.tenant, n_tokens)

    # -- 4. place ------------------------------------------------------------------------

    async def place(
        self, placed: PlacedRequest, prompt: list[int], slot_id: int | None = None
    ) -> Lease:
        """A slot for `prompt`, within the tenant's share and bounds; `slot_id`: the client's
        own choice, where it may make one."""
        limits = placed.limits
        return await self.queued(
            self.scheduler.acquire(
                prompt,
                placed.tenant,
                placed.session,
                placed.cache_prompt,
                self._shareable(placed, prompt),
                share=limits.share,
                queue_bound=limits.max_queued,
                slot_id=slot_id,
                tables=placed.tables,
                restorable=self._archive_lookup(placed, prompt),
                generates_at_most=placed.generates_at_most,
                lora=placed.lora,
            ),
            placed.tenant,
        )

    def _archive_lookup(self, placed: PlacedRequest, prompt: list[int]) -> FindRestorable | None:
        """The disk tier's lookup of the tenant's archive for `prompt`, for the scheduler to ask
        if the request would wait for a busy slot (the archive restored into an idle one may
        beat that wait)."""
        disk = self.disk
        if disk is None or not placed.cache_prompt:
            return None
        return functools.partial(disk.restorable, placed.tenant, prompt, self.tables, placed.lora)

    async def place_group(
        self, placed: PlacedRequest, prompt: list[int], count: int
    ) -> list[Lease]:
        """`count` slots for `prompt` at once (a split request's tasks of one prompt, which run
        side by side), within the tenant's share and bounds for all of them."""
        limits = placed.limits
        return await self.queued(
            self.scheduler.acquire_group(
                prompt,
                placed.tenant,
                count,
                placed.session,
                placed.cache_prompt,
                self._shareable(placed, prompt),
                share=limits.share,
                queue_bound=limits.max_queued,
                tables=placed.tables,
                lora=placed.lora,
            ),
            placed.tenant,
        )

    async def queued(self, waiting: Awaitable[Leased], tenant: str) -> Leased:
        """The lease the scheduler gives once `waiting` ends; its refusals as answers."""
        try:
            with self.tracer.span("queue") as stage:
                lease = await waiting
                # off: the shared no-op span, and no attributes gathered for it
                if self.tracer.enabled and isinstance(lease, Lease):
                    stage.set(**where(lease))
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
        leases = lease if isinstance(lease, list) else [lease]
        for each in leases:
            self.metrics.queue_wait.observe(each.queued_s)
        if self.claims is not None:
            # nothing may be sent before the slots' claims allow it: else given back unused
            for at, each in enumerate(leases):
                try:
                    await self.claims.before_use(each, tenant, self.scheduler)
                except BaseException:
                    for other in leases[:at] + leases[at + 1 :]:  # its own given back there
                        self.scheduler.release(other, UNANSWERED)
                    raise
        return lease

    def _shareable(self, placed: PlacedRequest, prompt: list[int]) -> int:
        """The longest admin-marked public prefix the prompt starts with, where its caller may
        reuse one (0: none)."""
        if not placed.caller.may_use_public_prefixes or not self.tenants.has_public_prefixes():
            return 0
        return max(
            (
                len(prefix.tokens)
                for prefix in self.tenants.public_prefixes()
                if prompt[: len(prefix.tokens)] == prefix.tokens
            ),
            default=0,
        )

    # -- 5. prepare ----------------------------------------------------------------------

    async def prepare(self, run: SlotRun) -> None:
        """Let the disk tier archive what the slot held and restore a better state into it;
        the scheduler and the RAM-cache shadow learn what the slot holds as the task goes.
        A request lined up behind the slot's running one keeps what that one leaves: nothing
        to prepare (line_up.py)."""
        run.handover = self.scheduler.take_handover(run.lease)
        if run.handover is not None:
            return
        prepared = await self._disk_prepared(run)
        run.disk_action, run.saving = prepared.action, prepared.saving
        lease = run.lease = self.scheduler.prepared(
            run.lease, prepared.predicted, prepared.isolate, prepared.branch
        )
        held, pinned = _held(lease, prepared), not lease.unpinned
        lease.table.shadow_dispatch(lease.slot.slot_id, held, lease.prompt, pinned)

    async def _disk_prepared(self, run: SlotRun) -> Prepared:
        lease, placed = run.lease, run.placed
        if self.disk is None:
            return Prepared.as_leased(lease)
        try:
            return await self.disk.prepare(
                lease, placed.tenant, placed.cache_prompt, self.moves[placed.caller.tenants_exist]
            )
        except DISK_FAILURES as exc:
            # the slot may hold anything now: reuse none of it; the request itself will tell
            # whether the upstream is still there. A disk fault never fails the request (the
            # tier turns itself off on the ones it sees; this catches any it did not).
            log.warning("disk tier on %s failed: %r", lease.table.upstream.base_url, exc)
            return Prepared(ReuseBounds(0, 0), isolate=True, action="")

    # -- 6. forward ----------------------------------------------------------------------

    async def forward(self, request: web.Request, run: SlotRun, oai: bool) -> web.StreamResponse:
        """Send the task pinned to the leased slot and relay its answer to the client; its
        outcome goes to `run` once the answer is complete."""
        placed, lease = run.placed, run.lease
        stream = placed.stream
        hide = placed.caller.hide_cache_signals
        # a prompt computed in chunks shows what it reused before them, as unchunked
        reuse = None if run.chunks is None else run.chunks.shown()
        document, observer = pinned_task(
            placed.document,
            lease,
            stream,
            oai,
            hide and placed.api is None,
            ANSWER_OBSERVERS.get(placed.path, TaskObserver),
            shown_as_sent=placed.api is None,
            shown=None if placed.api is not None else reuse,
            foreign_text=holds_foreign_text(lease, placed.tenant),
        )
        if stream and run.handover is None:  # its first event ends its prefill: no guess
            observer.on_first_event = functools.partial(self._prefill_ended, lease)
        if observer.oai and observer.shows_completion_id:
            observer.on_completion_id = functools.partial(
                self.completion_ids.record, placed.tenant, None, lease.table.upstream
            )
        shown: ResponseObserver = observer
        if placed.api is not None:  # the chat answer, shown in the agent API's form
            shown = placed.api.observer(observer, hide, reuse)
        tracer = self.tracer
        try:
            # off: the shared no-op span, no attributes gathered for it
            span = tracer.span("upstream", **where(lease)) if tracer.enabled else NO_SPAN
            with span as stage:
                response = await forward(
                    request,
                    self.session,
                    lease.table.upstream,
                    placed.upstream_body(document),
                    self.upstream_api_key,
                    streams=stream,
                    observer=shown,
                    forward_client_key=placed.caller.forward_client_key,
                    target=CHAT_ROUTE if placed.api is not None else None,
                    connections=self.connections,
                    on_sent=functools.partial(self._sent, observer, lease),
                )
                outcome = observer.outcome()
                if tracer.enabled:
                    stage.set(
                        status=response.status, cache_n=outcome.cache_n, prompt_n=outcome.prompt_n
                    )
        except BaseException:
            run.sent = cut_task(run, observer)
            raise
        if not outcome.ok and response.status == 200:  # broken off before its last event
            run.sent = cut_task(run, observer)
        run.outcome = outcome
        if run.saving is not None:
            await self.saved(run)
        return response

    def _sent(self, observer: TaskObserver, lease: Lease) -> None:
        """The whole task is on its way: charged what the server computed if cut from now on,
        and others of its tenant may be lined up behind it (line_up.py)."""
        observer.sent()
        self.scheduler.sent(lease)

    @staticmethod
    async def saved(run: SlotRun) -> None:
        """An answer given whole waits for the commit of what its slot held (it ran beside
        the request, disk/saves.py, and has nearly always ended): once a client has its
        answer, what the request evicted is archived or known not to be. A stream's last
        event is sent already."""
        if run.saving is not None and not run.placed.stream:
            await asyncio.wait((run.saving,))  # its outcome is the tier's to count

    def _prefill_ended(self, lease: Lease) -> None:
        self.scheduler.prefill_ended(lease)
        if self.claims is not None:
            self.claims.prefill_ended(lease)  # the slot holds the tenant's prompt: claimed

    # -- 7 and 8: `finish`, whatever happened ------------------------------------------------
    async def finish(self, run: SlotRun) -> None:
        """`record` and `account`, once. A task cut before its answer ended has its slot read
        first, once the server let go of it (cut_tasks.py), in a task of its own that the
        handler's cancellation does not interrupt (its lease is given back all the same)."""
        if run.finished:
            return
        run.finished = True
        if run.handover is not None:
            if not run.handover.done():
                # the running one's answer may still be relayed to its client: this answer is
                # not held for it (recorded once the proxy gives that lease back)
                self.cut_tasks.start(self._handed_over(run, run.handover))
                return
            _took_the_slot(run, run.handover.result())
        await self._finish_on_slot(run)

    async def _handed_over(self, run: SlotRun, handover: asyncio.Future[Lease]) -> None:
        """Finish a request lined up behind a running one once it has the slot."""
        _took_the_slot(run, await handover)
        await self._finish_on_slot(run)

    async def _finish_on_slot(self, run: SlotRun) -> None:
        if run.sent is None:
            self.account(run, self.record(run))
        else:
            followed = self.scheduler.cut(run.lease)
            await self.cut_tasks.run(self._settle(run, run.sent, followed))

    async def _settle(self, run: SlotRun, sent: SentTask, followed: bool) -> None:
        """`followed`: a request is lined up behind the cut one, and takes its slot as soon as
        the server lets go: the slot cannot be read for the cut one, charged its prompt."""
        try:
            if followed:
                outcome = unplaced_outcome(sent)
            else:
                outcome = await self.cut_tasks.outcome(run.lease, sent)
            run.outcome = outcome if run.chunks is None else run.chunks.merged(outcome)
        finally:
            self.account(run, self.record(run))

    # -- 7. record -----------------------------------------------------------------------

    def record(self, run: SlotRun) -> str:
        """Give the slot back with what the task did (the table rewrites it from the answer);
        how the prediction fared: "match", "mismatch", "ram_load" or "unchecked"."""
        lease, outcome = run.lease, run.outcome
        verdict = self.scheduler.release(lease, outcome)
        if self.claims is not None:
            self.claims.changed(lease)  # what the slot holds now, for the next holder
        if not verdict.checked:
            return "unchecked"
        if run.disk_action == "restore" and self.disk is not None:
            self.disk.restore_answered(lease.table, verdict.cache_n or 0)
        if run.chunks is None and not lease.opaque and outcome.prompt_n is not None:
            # the server's count of the prompt's tokens: what the mirror made must agree
            counted = (outcome.cache_n or 0) + outcome.prompt_n
            upstream = self.mirror_upstream(run.placed)
            if not self.token_mirror.answered(upstream, len(lease.prompt), counted):
                lease.table.lost(lease.slot.slot_id)  # it holds the server's ids, not these
        lease.table.task_answered(lease.slot.slot_id)  # it ran: the server gave it a task id
        self._shadow_observes(lease, verdict)
        if verdict.matched:
            return "match"
        if verdict.cache_n and run.placed.relies_on_no_reuse_default():
            # a body that did not say was reused: the server's default is to reuse after all
            # (the probe was misled: a slot emptied under it by a task launched beside it)
            lease.table.reuses_by_default = True
            log.info("upstream %s reuses by default", lease.table.upstream.base_url)
        return self._mispredicted(lease, verdict)

    def _shadow_observes(self, lease: Lease, verdict: Verdict) -> None:
        """The RAM-cache shadow learns from every answer: one within the bounds may still show
        a load it predicted as a chance not made (or made: its budget proven that far)."""
        if (shadow := lease.table.ram_shadow) is None or lease.opaque:
            return
        # the slot's row is rewritten from the answer (release); the shadow drops what the
        # server moved out of its RAM cache
        wrong = shadow.observed(
            lease.prompt, verdict.predicted.high, verdict.cache_n or 0, lease.slot.slot_id
        )
        if wrong or not verdict.matched:
            name = lease.table.upstream.name
            self.metrics.shadow_mispredictions.labels(name).inc()
            self.metrics.shadow_budget.labels(name).set(shadow.budget_bytes)

    def _mispredicted(self, lease: Lease, verdict: Verdict) -> str:
        if lease.table.ram_cache and verdict.cache_n > verdict.predicted.high:
            return "ram_load"
        if verdict.cache_n > verdict.predicted.high and _shifted(lease, verdict):
            return "shifted"
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

    # -- 8. account ----------------------------------------------------------------------

    def account(self, run: SlotRun, prediction: str) -> None:
        """Count the task: the tenant's usage, the ledger, the metrics, the request log."""
        usage = self.usage[run.placed.tenant]
        account_task(
            run.placed, run.lease, run.outcome, run.disk_action, prediction, usage, self.meter,
            self.metrics,
        )  # fmt: skip


def _shifted(lease: Lease, verdict: Verdict) -> bool:
    """Whether the server reused more than the slot's text shared with the prompt by shifting
    chunks of that text into place (llama-server started with `--cache-reuse`, or the body's
    `n_cache_reuse`): no more than that walk could reuse of the text the slot was known to hold
    (the table rewrites the slot from the answer all the same)."""
    previous = lease.previous
    if lease.isolate or previous.unknown_tail != 0:
        return False
    # only reuse past the common prefix is shifted: up to it, the prediction was simply wrong
    common = common_prefix_length(previous.known, lease.prompt)
    return common < verdict.cache_n <= reuse_with_shifts(previous.known, lease.prompt, common)


def where(lease: Lease) -> dict[str, str | int]:
    """A leased slot as span attributes."""
    return {"upstream": lease.table.upstream.base_url, "slot": lease.slot.slot_id}


# what the disk tier may raise preparing a slot: the request goes on without it
DISK_FAILURES = (aiohttp.ClientError, TimeoutError, OSError, *DATABASE_ERRORS, DiskUnavailable)
# what the mirror raises for a prompt it could not tokenize (nothing was run yet)
TOKENIZING_FAILURES = (RequestRejected, aiohttp.ClientError, TimeoutError)
TOKENIZING_FAILURES += (UpstreamUnreachable, UpstreamClosed)  # the lean client's own


def tokenizing_failed(base_url: str, exc: Exception) -> NoReturn:
    """Raise the proxy's answer to a prompt the mirror could not tokenize."""
    if isinstance(exc, RequestRejected):  # tokenized, over the context: the client's refusal,
        raise exc.as_api_error() from None  # its traceback of no use
    raise ApiError(502, f"upstream {base_url} failed to tokenize: {exc!r}") from exc


def _took_the_slot(run: SlotRun, lease: Lease) -> None:
    """The request lined up behind a running one was handed `lease` as that one was given back:
    recorded on it; cut, over what the running one left there."""
    run.lease, run.handover = lease, None
    if run.sent is not None:
        sent = run.sent
        run.sent = SentTask.of(lease, sent.generated_seen, run.chunks, delivered=sent.delivered)


def cut_task(run: SlotRun, observer: TaskObserver) -> SentTask:
    """The task `run` sent and `observer` read, cut before its answer ended."""
    seen = observer.outcome().predicted_n or 0
    return SentTask.of(run.lease, seen, run.chunks, delivered=observer.delivered)


def _held(lease: Lease, prepared: Prepared) -> list[int] | None:
    """What the slot held as the task goes out, when all of it is known (not after a restore)."""
    exact = lease.previous.unknown_tail == 0 and prepared.action != "restore" and not lease.opaque
    return lease.previous.known if exact else None
