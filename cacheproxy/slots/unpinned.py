"""The whole-upstream shape: requests the proxy cannot pin to one slot get a whole upstream,
safely.

llama-server picks the slot itself for these (embeddings and rerank never read `id_slot`:
tools/server/server-context.cpp `handle_embeddings_impl` and `post_rerank` create their tasks
without it; and whatever else is not yet placed through the table). Three rules keep the slot
table and tenant isolation right:

- Never reuse another tenant's text. The upstream chosen is, where there is one, an upstream
  whose slots hold only the tenant's text or nothing. Otherwise the slots holding anyone else's
  text are archived by the disk tier (if worth it) and erased, so the tenant still reuses its
  own. A server without slot actions cannot erase: a route whose body llama-server reads
  `cache_prompt` from then goes with `cache_prompt: false` (server-context.cpp: no prefix is
  reused, on whatever slot the server picks), and any other (the Anthropic converter drops
  `cache_prompt`) gets 503. Embeddings and rerank reuse nothing anyway (`is_stateless_task`).
- Relabel only the slots the request may have written: `GET /slots` before and after; a slot
  showing another `id_task` or another length was written (the tenant's now, as many tokens as
  it holds), an unchanged one keeps its owner and content, one that cannot be told is nobody's.
- No lease outlives its request. The report after and the release run in a task of their own,
  which the handler's cancellation (the client left) cannot interrupt, each read bounded.
- A request cut once the server had it all (its client left, its answer broke off) is charged
  what the server computed: its slots are read once the server let go of them (whole_cuts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from aiohttp import web

from cacheproxy.apis.observe import TaskObserver
from cacheproxy.apis.response_fields import fields_asked
from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.disk.tier import DiskUnavailable
from cacheproxy.errors import ApiError
from cacheproxy.ops.held_tasks import HeldTasks
from cacheproxy.ops.logs import REQUEST_LOG, log_request
from cacheproxy.slots.cut_tasks import READ_AGAIN_S, settle_s
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.shapes import CACHE_PROMPT_ROUTES, STATELESS_ROUTES
from cacheproxy.slots.stages import Stages
from cacheproxy.slots.waiter import UpstreamLease
from cacheproxy.slots.whole_cuts import reuse_while_running, whole_upstream_cut
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.relay import forward
from cacheproxy.upstreams.slot_table import TaskOutcome

log = logging.getLogger(__name__)
request_log = logging.getLogger(REQUEST_LOG)


class UnpinnedRequests:
    """Runs requests on a whole upstream; the scheduler records what they did to its slots.

    The stages (stages.py) as this shape runs them: `place` takes a whole upstream; to prepare
    it, the slots holding other tenants' text are archived and erased; `forward` relays the
    answer as it is; `account` counts what the answer reports in the ledger (the prompt was not
    known before), and `record` (`_settle`) relabels the slots the request may have written."""

    def __init__(self, stages: Stages, client: UpstreamClient) -> None:
        self.stages = stages
        self.client = client  # its calls bounded: a stopped server is not waited for
        self._settling = HeldTasks()  # releases under way

    async def run(self, request: web.Request, placed: PlacedRequest) -> web.StreamResponse:
        stages = self.stages
        limits = placed.limits
        lease = await stages.queued(
            stages.scheduler.acquire_upstream(
                placed.tenant, limits.share, limits.max_queued, placed.tables, placed.lora
            ),
            placed.tenant,
        )
        stages.metrics.requests.labels(placed.tenant, "whole_upstream").inc()
        before: list[dict] | None = None
        erased: list[int] = []
        caller = placed.caller
        # the answer read whole, projected here as the server would have (apis/response_fields.py)
        document = placed.document
        fields = fields_asked(document.get("response_fields"))
        if fields is not None:
            document = {key: value for key, value in document.items() if key != "response_fields"}
        observer = TaskObserver(
            0,
            placed.stream,
            oai=False,
            hide_cache_signals=caller.hide_cache_signals,
            fields=fields,
        )
        response: web.StreamResponse | None = None
        try:
            body = placed.body if fields is None else placed.upstream_body(document)
            if not lease.clean and placed.path not in STATELESS_ROUTES:
                if not await self._archive_and_erase(lease, erased):
                    if placed.path not in CACHE_PROMPT_ROUTES:
                        raise ApiError(
                            503,
                            f"upstream {lease.table.upstream.base_url} holds other tenants'"
                            " text that this route could reuse, and has no slot actions to"
                            " erase it (start llama-server with --slot-save-path)",
                        )
                    body = placed.upstream_body({**document, "cache_prompt": False})
            before = await self._read_slots(lease)
            response = await forward(
                request,
                stages.session,
                lease.table.upstream,
                body,
                stages.upstream_api_key,
                streams=placed.stream,
                observer=observer,
                forward_client_key=caller.forward_client_key,
                connections=stages.connections,
                on_sent=observer.sent,
            )
            return response
        finally:
            shown = observer.outcome()
            # the server had it all, and its answer did not end with its figures: cut
            cut = observer.delivered and not shown.ok
            if cut and response is not None and response.status != 200:
                cut = False  # refused: the server computed nothing
            if not cut:
                self._account(placed, shown)
            settle = self._settling.start(
                self._settle(lease, before, erased, placed, shown if cut else None),
                "settle-whole-upstream",
            )
            # the answer is complete once the table knows what the request did; a handler
            # cancelled meanwhile leaves, and the release still happens
            await asyncio.shield(settle)

    async def _settle(
        self,
        lease: UpstreamLease,
        before: list[dict] | None,
        erased: list[int],
        placed: PlacedRequest,
        cut: TaskOutcome | None,
    ) -> None:
        """Read the slots after the request (for a `cut` one, what its answer showed: once the
        server let go of them, whole_cuts.py) and give the upstream back; a cut request is
        charged what its slots show."""
        after = None
        try:
            if before is not None and cut is None:
                after = await self._read_slots(lease)
            elif before is not None:
                reused: dict[int, int] = {}
                after = await self._let_go(lease, reused)
                cut = whole_upstream_cut(before, after, reused, cut)
        finally:
            self.stages.scheduler.release_upstream(lease, before, after, erased)
            if cut is not None:
                self._account(placed, cut)
            log_request(
                request_log,
                tenant=placed.tenant,
                upstream=lease.table.upstream.base_url,
                slot="all",
                action="whole_upstream",
                queued_ms=round(lease.queued_s * 1000, 1),
                ms=round((time.monotonic() - placed.received) * 1000, 1),
            )

    async def _let_go(self, lease: UpstreamLease, reused: dict[int, int]) -> list[dict] | None:
        """The upstream's slots once the server let go of all of them (None: not read), what
        each reused noted in `reused` while it ran; read no more often than the server's own
        check for a closed connection allows (cut_tasks.py), at most until a deadline that
        lets it compute a whole context at its measured rate."""
        table = lease.table
        context = max((slot.n_ctx for slot in table.slots), default=0)
        deadline = time.monotonic() + settle_s(table, context)
        while True:
            report = await self._read_slots(lease)
            if report is None:
                return None
            reuse_while_running(report, reused)
            if not any(entry.get("is_processing") for entry in report):
                return report
            if time.monotonic() + READ_AGAIN_S > deadline:
                log.warning(
                    "%s still runs a cut request: charged what its slots show",
                    table.upstream.base_url,
                )
                return report
            await asyncio.sleep(READ_AGAIN_S)

    def _account(self, placed: PlacedRequest, outcome: TaskOutcome) -> None:
        """Count what the request's answer (or its slots, once cut) showed: the ledger and
        the tenant's limits (its prompt could not be taken before), the metrics."""
        stages = self.stages
        if stages.meter is not None:
            stages.meter.record_outcome(placed.tenant, outcome, None, "", prompt_taken=False)
        metrics, by_tenant = stages.metrics, (placed.tenant,)
        reused = outcome.cache_n
        prompt = None if outcome.prompt_n is None else (reused or 0) + outcome.prompt_n
        metrics.count(
            (metrics.prompt_tokens, by_tenant, prompt),
            (metrics.reused_tokens, by_tenant, reused),
            (metrics.decoded_tokens, by_tenant, outcome.prompt_n),
        )

    async def _read_slots(self, lease: UpstreamLease) -> list[dict] | None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            return await self.client.slots(lease.table.upstream)
        return None

    async def _archive_and_erase(self, lease: UpstreamLease, erased: list[int]) -> bool:
        """Empty the slots holding other tenants' text, adding their ids to `erased` (the disk
        tier archives first what is worth keeping); False when the server has no slot actions."""
        disk = self.stages.disk
        for foreign in lease.foreign:
            if disk is not None:
                try:
                    await disk.prepare(foreign, lease.tenant, cache_prompt=False)
                except (aiohttp.ClientError, TimeoutError, OSError, *DATABASE_ERRORS) as exc:
                    log.warning("archiving before an erase failed: %r", exc)
                except DiskUnavailable:
                    pass
            slot_id = foreign.slot.slot_id
            try:
                if not await self.client.erase(lease.table.upstream, slot_id):
                    return False
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise ApiError(
                    502, f"upstream {lease.table.upstream.base_url} failed to erase: {exc!r}"
                ) from exc
            erased.append(slot_id)
        return True

    async def wait_settled(self, timeout_s: float | None) -> None:
        """Let the releases under way finish (at a stop, before the drain)."""
        await self._settling.wait(timeout_s)
