"""The opaque shape: a route pinned to one slot although its prompt ids are not known
(`/infill`: llama-server lays out the prompt itself, see shapes.py `OPAQUE_ROUTES`).

Nothing to `mirror` or meter before the answer: it is placed near the slot its session (or how
its prompt starts) last used, then runs on the slot as a single request does (single.py); the
slot is recorded as holding the tenant's text, as many tokens as the server reports.
"""

from __future__ import annotations

from aiohttp import web

from cacheproxy.slots.prefill_chunks import PrefillInChunks
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.shapes import infill_affinity_key
from cacheproxy.slots.single import run_on_slot
from cacheproxy.slots.stages import SlotRun, Stages


async def run_opaque(
    stages: Stages, chunked: PrefillInChunks, request: web.Request, placed: PlacedRequest
) -> web.StreamResponse:
    # `place`: the slot whose loss costs least, unless one of the tenant's last served the
    # same session (for infill, a key of how its prompt starts), which the server will reuse
    session = placed.session or infill_affinity_key(placed.document)
    limits = placed.limits
    lease = await stages.queued(
        stages.scheduler.acquire_opaque(
            placed.tenant, session, limits.share, limits.max_queued, placed.tables, placed.lora
        ),
        placed.tenant,
    )
    return await run_on_slot(stages, chunked, request, SlotRun(placed, lease), oai=False)
