"""A prompt computed in chunks before its request goes out, between the `prepare` and `forward`
stages of a task pinned to a slot (whether and where the chunks end: chunked_prefill.py).

Each chunk is a request pinned to the slot with a prefix of the prompt and nothing generated,
the scheduler letting other tenants' prompts go first between two chunks. The request itself
then reuses what the chunks computed. A chunk that fails, or leaves the slot other than
expected, ends the chunking: the request then goes out as leased.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import aiohttp
import orjson
from multidict import CIMultiDict

from cacheproxy.apis.observe import is_final
from cacheproxy.apis.task_totals import of_timings
from cacheproxy.slots.chunked_prefill import Chunks, chunk_ends, chunk_tokens
from cacheproxy.slots.lease_terms import holds_foreign_text
from cacheproxy.slots.sent_tasks import SentTask
from cacheproxy.slots.stages import SlotRun, Stages, where
from cacheproxy.upstreams.adapters import naming
from cacheproxy.upstreams.relay import send_upstream
from cacheproxy.upstreams.slot_table import Lease, TaskOutcome

log = logging.getLogger(__name__)


class PrefillInChunks:
    """Sends the chunks of leased prompts to their slots."""

    def __init__(self, stages: Stages, headers: dict[str, str], chunk_ms: float) -> None:
        self.stages = stages
        self.headers = headers  # the upstream client's: the proxy's key, a JSON body
        self.chunk_ms = chunk_ms  # about how much prefill a chunk is (0: chunking is off)

    async def run(self, run: SlotRun) -> None:
        """Compute the leased prompt but its last piece in chunks (`run.chunks` counts them);
        `run.lease` becomes the lease for the request itself once they ended."""
        chunks = run.chunks = Chunks(run.lease.predicted.low)
        foreign = holds_foreign_text(run.lease, run.placed.tenant)
        try:
            run.lease = await self._prefill(run.lease, chunks, foreign)
        except BaseException:
            if chunks.running:  # cut inside a chunk: what it computed is read from the slot
                prompt = run.lease.prompt[: chunks.running_to]
                run.sent = SentTask.of(run.lease, 0, chunks, prompt)
            raise

    async def _prefill(self, lease: Lease, chunks: Chunks, foreign: bool) -> Lease:
        if lease.predicted.low != lease.predicted.high:
            return lease  # where the chunks would start is not known
        scheduler = self.stages.scheduler
        tokens = chunk_tokens(lease.table.prefill_ms_per_token.value, self.chunk_ms)
        ends = chunk_ends(len(lease.prompt), lease.predicted.low, tokens)
        isolate = lease.isolate
        for end in ends:
            await scheduler.chunk_turn(lease, len(lease.prompt) - chunks.end)
            chunks.running, chunks.running_to = True, end
            outcome = await self._compute_chunk(lease, lease.prompt[:end], isolate, foreign)
            chunks.running = False
            if not outcome.ok or outcome.tokens_cached != end:
                # what the slot holds now is not known; after a chunk that ended, only this
                # tenant's text (or less): the request reuses what is left of it
                chunks.failed = True
                return scheduler.chunks_done(lease) if chunks.count else lease
            chunks.add(end, outcome)
            self.stages.metrics.prefill_chunks.inc()
            scheduler.chunk_done(lease, end)
            isolate = foreign = False  # the slot holds this tenant's text now
        if not chunks.end_known():
            return lease
        # the last piece, computed by the request itself, yields like a chunk
        await scheduler.chunk_turn(lease, len(lease.prompt) - chunks.end)
        return scheduler.chunks_done(lease)

    async def _compute_chunk(
        self, lease: Lease, prefix: list[int], isolate: bool, foreign: bool
    ) -> TaskOutcome:
        """One chunk: `prefix` computed into the leased slot, one token sampled and not kept
        (`n_predict` 0 still samples one; the slot then holds exactly the prompt). Streamed, so
        the server notices at once if the client leaves (the request is cancelled with it).
        `foreign`: the slot holds text not the tenant's, of which no chunk past the prefix
        reused may be reused by shifting its KV (the server's `--cache-reuse`)."""
        body = {
            "prompt": prefix,
            "n_predict": 0,
            "id_slot": lease.slot.slot_id,
            "cache_prompt": not isolate,
            "stream": True,
        }
        if foreign:
            body["n_cache_reuse"] = 0
        if lease.table.adapters and lease.adapters:
            # under the request's LoRA scales: computed under others, the server would clear
            # the chunks (or, for a request naming none, go on from text of other scales)
            body["lora"] = naming(lease.adapters)
        upstream = lease.table.upstream
        last = b""
        try:
            with self.stages.tracer.span("chunk", **where(lease)):
                response = await send_upstream(
                    self.stages.session,
                    "POST",
                    upstream.own_url("/completion"),
                    orjson.dumps(upstream.own_body(body)),
                    CIMultiDict(self.headers),
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
        if not is_final(final):
            return TaskOutcome(ok=False)
        # the token it sampled is not kept: nothing generated counts
        outcome = of_timings(final.get("timings") or {})
        return replace(outcome, tokens_cached=final.get("tokens_cached"), predicted_n=None)


def cut_between_chunks(run: SlotRun) -> None:
    """A task that ended without an answer: cut between two chunks (or after the last), the slot
    holds exactly what the chunks computed, and the task is recorded as having computed that."""
    chunks = run.chunks
    if chunks is not None and not run.outcome.ok and chunks.between():
        run.lease = replace(run.lease, prompt=run.lease.prompt[: chunks.end])
        run.outcome = chunks.outcome()
