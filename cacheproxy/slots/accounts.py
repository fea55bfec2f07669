"""The `account` stage (stages.py): a task counted once it has ended, in its tenant's usage
through the slots, the usage ledger and its limits (the meter), the metrics and the request log.

Its prompt tokens are the mirror's count for a task that answered; for one the server counted
(an opaque prompt, or a task cut before its answer ended, cut_tasks.py), what it reused plus
what it computed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from cacheproxy.ops.logs import REQUEST_LOG, log_request
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.tenancy.metering import Meter
from cacheproxy.upstreams.slot_table import Lease, TaskOutcome

request_log = logging.getLogger(REQUEST_LOG)


def account_task(
    placed: PlacedRequest,
    lease: Lease,
    outcome: TaskOutcome,
    disk_action: str,
    prediction: str,
    usage: Counter[str],
    meter: Meter | None,
    metrics: ProxyMetrics,
) -> None:
    """Count the task in its tenant's `usage`, the ledger (`meter`), the metrics, the log;
    `prediction`: how the table's prediction fared."""
    tenant = placed.tenant
    usage["requests"] += 1
    prompt_tokens = len(lease.prompt)
    if lease.opaque or outcome.cut:  # counted by the server: reused plus decoded
        prompt_tokens = (outcome.cache_n or 0) + (outcome.prompt_n or 0)
    usage["prompt_tokens"] += prompt_tokens
    usage["reused_tokens"] += outcome.cache_n or 0
    usage["decoded_tokens"] += outcome.prompt_n or 0
    if meter is not None:
        meter.record_outcome(
            tenant,
            outcome,
            lease.previous.owner,
            disk_action,
            prompt_taken=not lease.opaque,
            model=lease.table.model_id,
        )
    by_tenant, by_model = (tenant,), (lease.table.model_id or "",)
    metrics.count(
        (metrics.requests, (tenant, "slot"), 1),
        (metrics.prompt_tokens, by_tenant, prompt_tokens),
        (metrics.reused_tokens, by_tenant, outcome.cache_n),
        (metrics.decoded_tokens, by_tenant, outcome.prompt_n),
        (metrics.predictions, (prediction,), 1),
        (metrics.model_requests, by_model, 1),
        (metrics.model_prompt_tokens, by_model, prompt_tokens),
        (metrics.model_reused_tokens, by_model, outcome.cache_n),
    )
    if not request_log.isEnabledFor(logging.INFO):
        return
    log_request(
        request_log,
        tenant=tenant,
        upstream=lease.table.upstream.name,
        slot=lease.slot.slot_id,
        action=disk_action or _action(prompt_tokens, outcome),
        prompt=prompt_tokens,
        reused=outcome.cache_n,
        decoded=outcome.prompt_n,
        queued_ms=round(lease.queued_s * 1000, 1),
        ms=round((time.monotonic() - placed.received) * 1000, 1),
    )


def _action(prompt_length: int, outcome: TaskOutcome) -> str:
    """What the slot did for the request: served it from cache, in part, or not at all."""
    if outcome.cut:
        return "cut"
    if not outcome.ok or outcome.cache_n is None:
        return "failed"
    if outcome.cache_n == 0:
        return "cold"
    return "hit" if outcome.cache_n >= prompt_length - 1 else "partial"
