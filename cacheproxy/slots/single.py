"""The single shape: one prompt, one completion, pinned to the slot the table chooses for it.

It runs every stage (stages.py): `mirror`, `meter_prompt`, `place`, then, on the slot, `prepare`,
the chunks when its prompt is computed in chunks (prefill_chunks.py), `forward`, and whatever
happens `record` and `account` (`finish`: a task cut before its answer ended first has its
slot read, to charge what the server computed). An opaque request (opaque.py) runs the same
from its lease on.
"""

from __future__ import annotations

from aiohttp import web

from cacheproxy.slots.mirror import RouteKind
from cacheproxy.slots.prefill_chunks import PrefillInChunks, cut_between_chunks
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.stages import SlotRun, Stages


async def run_single(
    stages: Stages,
    chunked: PrefillInChunks,
    request: web.Request,
    placed: PlacedRequest,
    route: tuple[RouteKind, bool],
    slot_id: int | None,
) -> web.StreamResponse:
    """Serve a request of one prompt on one slot (`slot_id`: the client's choice, honoured).
    Raises `NotMirrorable`, nothing run yet, for a prompt only the server can read."""
    kind, oai = route
    prompt = await stages.mirror(placed, kind, placed.checked_with.n_ctx)
    await stages.meter_prompt(placed, len(prompt))
    lease = await stages.place(placed, prompt, slot_id=slot_id)
    return await run_on_slot(stages, chunked, request, SlotRun(placed, lease), oai)


async def run_on_slot(
    stages: Stages, chunked: PrefillInChunks, request: web.Request, run: SlotRun, oai: bool
) -> web.StreamResponse:
    """The leased task from its slot's preparation to its release, which always happens."""
    try:
        await stages.prepare(run)
        if run.lease.chunked:
            await chunked.run(run)
        response = await stages.forward(request, run, oai)
        if run.chunks is not None and run.sent is None:
            run.outcome = run.chunks.merged(run.outcome)
        return response
    finally:
        if run.chunks is not None and run.sent is None:
            cut_between_chunks(run)  # cut between two chunks: the slot holds what they computed
        await stages.finish(run)
