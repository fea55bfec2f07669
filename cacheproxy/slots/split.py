"""The split shape: a request of several prompts (a batch) or several completions (`n` > 1),
run as the single tasks llama-server would make of it (fanout.py), each placed through the
table like a single request, their answers merged back (fanout_relay.py).

The stages (stages.py) as this shape runs them: the request's other tasks counted against its
tenant's cap (`more_tasks`: it counts as its tasks), its prompts mirrored (`mirror_parts`) and
metered together; then each prompt's tasks (one, or its `n` completions) take their slots
together, within the tenant's share (`place_group`), and run side by side, as llama-server
runs them; each task on its slot: `prepare`, its own `forward` (`forward_part`: its answer to
the relay) and, whatever happens, `record` and `account` (`finish`). The prompts of a batch
take their slots as they can, as llama-server defers the tasks it has no slot for.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

from aiohttp import web

from cacheproxy.apis.pinned_task import pinned_task
from cacheproxy.ops.tracing import NO_SPAN
from cacheproxy.slots.fanout import FanoutPlan, NotSplittable, SubTask, plan_fanout
from cacheproxy.slots.fanout_relay import (
    TaskOutput,
    completion_id,
    failures_reported,
    relay_fanout,
    run_upstream_task,
)
from cacheproxy.slots.lease_terms import holds_foreign_text
from cacheproxy.slots.mirror import RouteKind
from cacheproxy.slots.prompt_bounds import RequestRejected
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.stages import (
    TOKENIZING_FAILURES,
    SlotRun,
    Stages,
    cut_task,
    tokenizing_failed,
    where,
)
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import UpstreamSlots


def split_plan(
    tables: Sequence[UpstreamSlots], placed: PlacedRequest, route: tuple[RouteKind, bool]
) -> FanoutPlan | None:
    """The single tasks of a request with several prompts or completions (None: it is one),
    refused (400) as llama-server refuses them; `n` is bounded by the largest upstream's
    slot count, as llama-server bounds it by its own."""
    kind, oai = route
    if kind == "responses":  # its several-answer shape is llama-server's alone to make
        return None
    slot_counts = [len(table.slots) for table in tables if table.healthy and table.slots]
    try:
        return plan_fanout(kind, oai, placed.document, max(slot_counts, default=None))
    except RequestRejected as rejected:
        raise rejected.as_api_error() from None
    except NotSplittable:
        return None


async def run_split(
    stages: Stages, request: web.Request, placed: PlacedRequest, plan: FanoutPlan
) -> web.StreamResponse:
    """Serve the request as `plan`'s tasks. Raises `NotMirrorable`, nothing run yet, for a
    prompt only the server can read."""
    # 429 past the cap (in a cluster, the count across its proxies), before any work
    async with stages.more_tasks(placed, len(plan.tasks) - 1):
        prompts = await mirror_parts(stages, placed, plan)
        await stages.meter_prompt(placed, sum(map(len, prompts)))
        shown_id = completion_id()  # the one id the client sees for all the tasks

        async def run(tasks: list[SubTask], outputs: list[TaskOutput]) -> None:
            prompt = prompts[tasks[0].index]
            await _run_prompt(stages, request, placed, plan.oai, prompt, tasks, outputs, shown_id)

        return await relay_fanout(request, plan, run, shown_id)


async def _run_prompt(
    stages: Stages,
    request: web.Request,
    placed: PlacedRequest,
    oai: bool,
    prompt: list[int],
    tasks: list[SubTask],
    outputs: list[TaskOutput],
    shown_id: str,
) -> None:
    """One prompt's tasks, each on a slot of its own, the slots taken together (none is held
    while the others are waited for), from lease to release."""
    leases = await stages.place_group(placed, prompt, len(tasks))
    runs = [SlotRun(placed, lease) for lease in leases]
    try:
        async with asyncio.TaskGroup() as group:
            for run, task, output in zip(runs, tasks, outputs, strict=True):
                group.create_task(
                    _run_task(stages, request, run, task, output, oai, shown_id),
                    name=f"fanout-task-{task.index}",
                )
    finally:
        for run in runs:  # those cancelled before they started (the others are finished)
            await stages.finish(run)


async def _run_task(
    stages: Stages,
    request: web.Request,
    run: SlotRun,
    task: SubTask,
    output: TaskOutput,
    oai: bool,
    shown_id: str,
) -> None:
    """One task of a split request on its leased slot; its failure a message to the relay."""
    try:
        with failures_reported(output):
            await stages.prepare(run)
            await forward_part(stages, request, run, task.body, output, oai, shown_id)
    finally:
        await stages.finish(run)


async def mirror_parts(stages: Stages, placed: PlacedRequest, plan: FanoutPlan) -> list[list[int]]:
    """The `mirror` stage for each task (a child's prompt is its parent's); `NotMirrorable` as
    `Stages.mirror` raises it."""
    upstream = stages.mirror_upstream(placed)
    n_ctx = placed.checked_with.n_ctx
    prompts: list[list[int]] = []
    try:
        for task in plan.tasks:
            prompts.append(
                prompts[-1]
                if task.child
                else await _task_prompt(stages, task, upstream, placed.tenant, n_ctx)
            )
    except TOKENIZING_FAILURES as exc:
        tokenizing_failed(upstream.name, exc)
    return prompts


async def _task_prompt(
    stages: Stages, task: SubTask, upstream: Upstream, tenant: str, n_ctx: int | None
) -> list[int]:
    mirror = stages.token_mirror
    if task.prompt_input is None:
        return await mirror.prompt_tokens("chat", task.body, upstream, tenant, n_ctx)
    return await mirror.mixed_tokens(task.prompt_input, upstream, tenant, n_ctx)


async def forward_part(
    stages: Stages,
    request: web.Request,
    run: SlotRun,
    body: dict,
    output: TaskOutput,
    oai: bool,
    shown_id: str,
) -> None:
    """The `forward` stage for one task (`body`), pinned to its leased slot: its answer goes to
    `output` (the relay merges the tasks', all shown as `shown_id`), its outcome to `run`."""
    placed, lease = run.placed, run.lease
    document, observer = pinned_task(
        body,
        lease,
        placed.stream,
        oai,
        placed.caller.hide_cache_signals,
        foreign_text=holds_foreign_text(lease, placed.tenant),
    )
    if observer.oai and observer.shows_completion_id:
        observer.on_completion_id = functools.partial(
            stages.completion_ids.record, placed.tenant, shown_id, lease.table.upstream
        )
    try:
        tracer = stages.tracer
        span = tracer.span("upstream", **where(lease)) if tracer.enabled else NO_SPAN
        with span:
            await run_upstream_task(
                request,
                stages.session,
                lease.table.upstream,
                placed.upstream_body(document),
                output,
                observer,
                stages.upstream_api_key,
                streams=placed.stream,
                forward_client_key=placed.caller.forward_client_key,
                connections=stages.connections,
                on_sent=observer.sent,
            )
    except BaseException:
        run.sent = cut_task(run, observer)
        raise
    run.outcome = observer.outcome()
    if not run.outcome.ok and output.status == 200:  # broken off before its last event
        run.sent = cut_task(run, observer)
    await stages.saved(run)
