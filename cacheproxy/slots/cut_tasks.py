"""What a task cut before its answer ended computed, learnt from its slot once the server let go.

A task's prompt and computed counts come with its answer's last event. A task cut before it (the
client left, the upstream broke off a stream, a chunk was under way) never gets them, yet the
server computed some or all of its prompt, and maybe generated past what was streamed. So the
proxy keeps the slot leased and reads it from `GET /slots` once the server has let go of it
(`is_processing` false): its `n_prompt_tokens` is what the slot's KV holds (tools/server/
server-context.cpp:738, `prompt.tokens.size()`), which only the task wrote since the proxy leased
it (a busy slot is never pinned). Seen on the pinned server: a cut task's slot holds the prompt's
first n tokens (plus the tokens generated, each in as it was sampled), n a multiple of the batch
size past the reuse while the prompt was being computed; its per-task counts
(`n_prompt_tokens_processed`, `_cache`) are reset by then (`reset()`, server-context.cpp:404).

When the server notices a cut: it checks a closed connection while it waits for the task's next
result, once a second without any result for any task (server-queue.cpp:450-470, 550-557: any
result wakes the wait, which then starts over). So a prompt being computed while other tasks
stream is computed whole (its first token is its first result), and on a quiet server the cut is
seen within a second; the slot's report is read again no sooner than that (`READ_AGAIN_S`): a
read is itself a task whose result would start the server's wait over. A task that streamed
tokens has results coming: the server sees the cut at its next write, and the slot is read
again soon, then less and less often.

From the slot's report (pure, `settled_outcome`), the task is charged:
- its prompt, when a generated token was streamed (the prompt was computed): the mirror's count,
  the reuse as predicted, the rest computed;
- else what the slot shows: the prompt's first n tokens, the reuse as predicted, the rest of them
  computed; n past the prompt is tokens generated;
- nothing, when the slot shows no sign that the task ran there (the same length as before, other
  text): a request the server may not have received (its slot is then nobody's, unknown, as
  before), or when it cannot be read (the server is gone);
- its prompt, when the server still computes it at the deadline (it will, whole);
- as an unreadable slot, when the server picked the slot itself (`Lease.unpinned`): which slot
  it wrote cannot be told.
The slot then holds the prompt's first n tokens (and n past it that were generated, unnamed), as
the tenant's text, where the task provably wrote them; else it is nobody's, its content unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import aiohttp

from cacheproxy.slots.chunked_prefill import Chunks
from cacheproxy.upstreams.client import UnsuitableUpstream, UpstreamClient
from cacheproxy.upstreams.slot_table import Lease, SlotContent, TaskOutcome

log = logging.getLogger(__name__)

# llama-server looks for a closed connection after a second without results (see above): a
# read of the slots sooner would be one, and put it off again
READ_AGAIN_S = 1.1
# a task that streamed tokens has results coming: the server sees the cut at its next write,
# and the slot is read again soon, then less and less often
FIRST_PAUSE_S = 0.05
# at least this long to let the server notice a cut, however short its prompt
MIN_SETTLE_S = 5.0
# what a read of the slots may meet: then the task's slot cannot be told
UNREADABLE = (aiohttp.ClientError, TimeoutError, ValueError, UnsuitableUpstream)


@dataclass(frozen=True)
class SentTask:
    """A request sent to a leased slot whose answer did not come whole: what is known of it."""

    prompt: list[int]  # its prompt's ids (empty when not known: an opaque prompt)
    reused: int  # what the server was expected to reuse of it
    held: SlotContent  # what the slot held when it went out
    isolate: bool  # that was another tenant's text, to be reused in no part
    opaque: bool
    generated_seen: int = 0  # tokens its stream carried before it was cut

    @classmethod
    def of(
        cls,
        lease: Lease,
        generated_seen: int,
        chunks: Chunks | None = None,
        prompt: list[int] | None = None,
    ) -> SentTask:
        """The task sent on the leased slot: its prompt (`prompt`: a chunk's), after `chunks`
        computed part of it (the slot then holds their prefix, or what is not known if one
        failed), else over what the slot held when leased."""
        if chunks is None or chunks.count == 0:
            held, reused, isolate = lease.previous, lease.predicted.low, lease.isolate
        else:
            prefix = lease.prompt[: chunks.end]
            held = SlotContent(prefix, None if chunks.failed else 0, None)
            reused, isolate = chunks.end, False
        prompt = lease.prompt if prompt is None else prompt
        return cls(prompt, reused, held, isolate, lease.opaque, generated_seen)


def settled_outcome(sent: SentTask, entry: dict | None) -> TaskOutcome:
    """What the cut task computed and what its slot holds, from the slot's `GET /slots` entry
    once the server let go of it (None: not read; `is_processing`: still computing at the
    deadline). A `cut` outcome: its figures are charged, never checked against a prediction."""
    seen = sent.generated_seen
    length = len(sent.prompt)
    whole_prompt = TaskOutcome(
        ok=False, cut=True, cache_n=sent.reused, prompt_n=length - sent.reused, predicted_n=seen
    )
    if entry is None or entry.get("is_processing"):
        # tokens came (the prompt was computed), or the server still computes it
        return whole_prompt if seen or entry is not None else _NOTHING
    held = entry.get("n_prompt_tokens")
    if not isinstance(held, int) or held < 0:
        return whole_prompt if seen else _NOTHING
    if not _ran_there(sent, held):
        return _NOTHING
    if sent.opaque:  # the prompt's ids and reuse unknown: the slot's tokens, as computed
        return TaskOutcome(
            ok=True, cut=True, cache_n=0, prompt_n=max(held - seen, 0), tokens_cached=held,
            predicted_n=seen,
        )  # fmt: skip
    if held < sent.reused:
        # the slot lost what the task reused (a server RAM cache clearing idle slots): what it
        # computed cannot be told, nor what the slot holds
        return whole_prompt if seen else _NOTHING
    kept = min(held, length)
    computed = length - sent.reused if seen else kept - sent.reused
    return TaskOutcome(
        ok=True,
        cut=True,
        cache_n=sent.reused,
        prompt_n=computed,
        tokens_cached=held,
        predicted_n=max(seen, held - length),
    )


# a task the server shows no sign of having run: charged nothing, its slot unknown
_NOTHING = TaskOutcome(ok=False, cut=True, cache_n=0, prompt_n=0)


def _ran_there(sent: SentTask, held: int) -> bool:
    """Whether the slot, holding `held` tokens, provably holds what the task wrote: it streamed
    tokens, or the slot's length changed (nothing else ran there while leased), or it holds the
    same prompt prefix of the tenant's as before (then all the same whether the task ran)."""
    if sent.generated_seen:
        return True
    before = sent.held.n_tokens_at_least if sent.held.unknown_tail is not None else None
    if before is None:
        return False
    if held != before:
        return True
    return (
        not sent.isolate
        and not sent.opaque
        and sent.held.unknown_tail == 0
        and sent.held.known == sent.prompt[:held]
    )


class CutTasks:
    """Reads the slots of cut tasks, in tasks of their own that a handler's cancellation (the
    client left) cannot interrupt; a stop waits for them (`wait_settled`)."""

    def __init__(self, client: UpstreamClient) -> None:
        self.client = client  # its calls bounded: a stopped server is not waited for
        self._settling: set[asyncio.Task[None]] = set()

    async def run(self, settle: Awaitable[None]) -> None:
        """Run `settle` to its end, in a task of its own: a caller cancelled meanwhile (the
        client left, or a stop cut the handler) stops waiting, and `settle` runs on (a stop
        waits for it within its deadline, `wait_settled`)."""
        task = asyncio.ensure_future(settle)
        task.set_name("settle-cut-task")
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            return  # the caller unwinds a cancellation (a stop's cut): not held up by the read
        await asyncio.shield(task)

    async def outcome(self, lease: Lease, sent: SentTask) -> TaskOutcome:
        """What the cut task on the leased slot computed (`settled_outcome`), its slot read
        once the server let go of it, at most until a deadline that lets the server compute the
        rest of the prompt at its measured rate."""
        if lease.unpinned:
            # the server picked the slot itself: which one it ran on cannot be told, so it is
            # not read (charged as a slot that cannot be read)
            return settled_outcome(sent, None)
        table = lease.table
        left = max(len(sent.prompt) - sent.reused, 0)
        deadline = time.monotonic() + MIN_SETTLE_S + 2 * left * table.server_ms_per_token() / 1000
        entry = None
        pause = FIRST_PAUSE_S if sent.generated_seen else READ_AGAIN_S
        while True:
            with contextlib.suppress(*UNREADABLE):
                entry = None
                report = await self.client.slots(table.upstream)
                entry = next((e for e in report if e.get("id") == lease.slot.slot_id), None)
            if entry is None or not entry.get("is_processing"):
                break
            if time.monotonic() + pause > deadline:
                log.warning(
                    "slot %d of %s still runs a cut task: charged its whole prompt",
                    lease.slot.slot_id,
                    table.upstream.base_url,
                )
                break
            await asyncio.sleep(pause)
            pause = min(2 * pause, READ_AGAIN_S)
        return settled_outcome(sent, entry)

    async def wait_settled(self, timeout_s: float | None) -> None:
        """Let the reads under way finish (at a stop, before the drain); those still running
        after `timeout_s` are stopped, each giving its slot back unread (a frozen server is
        not waited for past a stop's deadline)."""
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=timeout_s)
        for task in list(self._settling):
            task.cancel()
        if self._settling:
            await asyncio.wait(set(self._settling))
