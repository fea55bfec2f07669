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
- where the server picked the slot itself (`Lease.unpinned`, its default topology): what the
  slot it picked shows, found while the task runs; else its prompt less the predicted reuse,
  when the server had the whole request (server_picked.py says how, and why that bound).
The slot then holds the prompt's first n tokens (and n past it that were generated, unnamed), as
the tenant's text, where the task provably wrote them; else it is nobody's, its content unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from cacheproxy.ops.held_tasks import HeldTasks
from cacheproxy.slots.sent_tasks import SentTask, whole_prompt
from cacheproxy.slots.server_picked import (
    Seen,
    identify,
    picked_outcome,
    seen_in,
    unplaced_outcome,
)
from cacheproxy.upstreams.client import UnsuitableUpstream, UpstreamClient
from cacheproxy.upstreams.slot_table import Lease, TaskOutcome, UpstreamSlots

log = logging.getLogger(__name__)

# llama-server looks for a closed connection after a second without results (see above): a
# read of the slots sooner would be one, and put it off again
READ_AGAIN_S = 1.1
# a task that streamed tokens has results coming: the server sees the cut at its next write,
# and the slot is read again soon, then less and less often
FIRST_PAUSE_S = 0.05
# at least this long to let the server notice a cut, however short its prompt
MIN_SETTLE_S = 5.0
# reads that look for the slot the server picked for a cut task, before it is charged the bound
IDENTIFY_READS = 2
# what a read of the slots may meet: then the task's slot cannot be told
UNREADABLE = (aiohttp.ClientError, TimeoutError, ValueError, UnsuitableUpstream)


def settled_outcome(sent: SentTask, entry: dict | None) -> TaskOutcome:
    """What the cut task computed and what its slot holds, from the slot's `GET /slots` entry
    once the server let go of it (None: not read; `is_processing`: still computing at the
    deadline). A `cut` outcome: its figures are charged, never checked against a prediction."""
    seen = sent.generated_seen
    length = len(sent.prompt)
    whole = whole_prompt(sent)
    if entry is None or entry.get("is_processing"):
        # tokens came (the prompt was computed), or the server still computes it
        return whole if seen or entry is not None else _NOTHING
    held = entry.get("n_prompt_tokens")
    if not isinstance(held, int) or held < 0:
        return whole if seen else _NOTHING
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
        return whole if seen else _NOTHING
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


def settle_s(table: UpstreamSlots, left: int) -> float:
    """How long the server is given to notice a cut and let go of its slot: enough to compute
    the `left` tokens of the prompt at its measured rate, twice over."""
    return MIN_SETTLE_S + 2 * max(left, 0) * table.server_ms_per_token() / 1000


class CutTasks:
    """Reads the slots of cut tasks, in tasks of their own that a handler's cancellation (the
    client left) cannot interrupt; a stop waits for them (`wait_settled`)."""

    def __init__(self, client: UpstreamClient) -> None:
        self.client = client  # its calls bounded: a stopped server is not waited for
        self._settling = HeldTasks()

    async def run(self, settle: Coroutine[Any, Any, None]) -> None:
        """Run `settle` to its end, in a task of its own: a caller cancelled meanwhile (the
        client left, or a stop cut the handler) stops waiting, and `settle` runs on (a stop
        waits for it within its deadline, `wait_settled`)."""
        task = self.start(settle)
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            return  # the caller unwinds a cancellation (a stop's cut): not held up by the read
        await asyncio.shield(task)

    def start(self, settle: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `settle` in a task of its own, not waited for here (a stop waits for it)."""
        return self._settling.start(settle, "settle-cut-task")

    async def outcome(self, lease: Lease, sent: SentTask) -> TaskOutcome:
        """What the cut task on the leased slot computed (`settled_outcome`), its slot read
        once the server let go of it, at most until a deadline that lets the server compute the
        rest of the prompt at its measured rate."""
        if lease.unpinned:
            return await self._picked_by_server(lease, sent)
        table = lease.table
        deadline = time.monotonic() + settle_s(table, len(sent.prompt) - sent.reused)
        pause = FIRST_PAUSE_S if sent.generated_seen else READ_AGAIN_S
        while True:
            report = await self._report(table)
            slot_id = lease.slot.slot_id
            entry = next((e for e in report or () if e.get("id") == slot_id), None)
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

    async def _picked_by_server(self, lease: Lease, sent: SentTask) -> TaskOutcome:
        """What the cut task the server placed itself computed: its slot found while it runs
        and read once the server let go of it (server_picked.py), else the safe bound."""
        if sent.generated_seen or not sent.delivered:
            return unplaced_outcome(sent)  # its prompt was computed, or never had
        table = lease.table
        deadline = time.monotonic() + settle_s(table, len(sent.prompt) - sent.reused)
        picked = None
        looks = IDENTIFY_READS
        while True:
            report = await self._report(table)
            if report is None:
                break
            if picked is None:
                # found as the client leaves: the server has not noticed yet (its own wait);
                # looked for again once, should it not have started the task yet
                alone = sum(slot.busy for slot in table.slots) == 1  # as the report came
                picked = identify(report, alone)
                looks -= 1
                if picked is None and (looks == 0 or not alone):
                    break
                seen, entry = Seen.RUNNING, None
            else:
                seen, entry = seen_in(picked, report)
            if seen is Seen.SETTLED and entry is not None:
                return picked_outcome(sent, picked, entry)
            if seen is Seen.LOST or time.monotonic() + READ_AGAIN_S > deadline:
                break
            await asyncio.sleep(READ_AGAIN_S)
        log.info(
            "the slot a cut task ran on in %s cannot be told: charged its prompt",
            table.upstream.base_url,
        )
        return unplaced_outcome(sent)

    async def _report(self, table: UpstreamSlots) -> list[dict] | None:
        with contextlib.suppress(*UNREADABLE):
            return await self.client.slots(table.upstream)
        return None

    async def wait_settled(self, timeout_s: float | None) -> None:
        """Let the reads under way finish (at a stop, before the drain); those still running
        after `timeout_s` are stopped, each giving its slot back unread (a frozen server is
        not waited for past a stop's deadline)."""
        await self._settling.wait(timeout_s)
        await self._settling.cancel()
