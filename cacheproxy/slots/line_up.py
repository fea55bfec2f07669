"""A request lined up at the server behind the running request of its tenant on a slot: sent
pinned to the busy slot, where llama-server holds it (defers it) and starts it in the step that
frees the slot (tools/server/server-queue.cpp `pop_deferred_task`, called on each release).

Why: with every slot busy, a request waiting in the proxy goes out only once the proxy has read
the running one's end, given its slot back and forwarded the next. Meanwhile the slot idles, and
slots that ended in one batch start again one by one, so the server computes them in more and
smaller batches: with a small model, its CPU a request grows with its decodes, and it shares the
CPUs with the proxy. A task deferred at the server starts beside the others freed in the same
step, as behind a plain relay.

A waiter is lined up when, all of (the scheduler asks these pure rules, and keeps the last):
- the upstream's RAM cache is known off: with it on, a task pinned to a busy slot snapshots and
  may overwrite the running slot's KV while it is deferred (server-context.cpp
  `get_available_slot`: `prompt_save`, `prompt_load` on the slot it names, busy or not); and
  the upstream runs each task on the slot it names (the server does not pick);
- the running request is its tenant's, on its tenant's text or an empty slot (`Running`): so
  whatever the running one does, computes whole, half or not at all, the slot holds only that
  tenant's text when the lined-up request starts there;
- the waiter is a single pinned prompt that reuses the prompt cache (no group, no whole
  upstream, no opaque prompt, not computed in chunks) of the highest class: nothing can pass a
  request lined up, and the tenant's interactive requests would wait behind a batch one;
- the disk tier would do nothing between the two (a lined-up request skips its `prepare`):
  - it keeps the running prompt: shares its first token and loses at most its last
    `CONTINUATION_SLACK_TOKENS`. What the running request generates is lost, as any next prompt
    that is not its conversation's next turn loses it; nothing the disk tier would archive is
    lost, and no archive holds more of the prompt than the slot will;
  - or, keeping less of it (a fresh conversation under the same system prompt, another question
    on a short text), the tier archives nothing on that upstream (`archives_from` None: none, or
    one that saves no slots), or both: what the running request leaves (its prompt and the most
    it may generate; no bound, no line-up) is not worth archiving beside what the waiter keeps
    of it (`disk.policy.worth_saving`, the rule a save at eviction starts with), and no archive
    can give the waiter `MIN_ARCHIVE_TOKENS` more of its prompt than the slot will (the rule a
    restore's lookup starts with). The waiter overwrites what the slot is left with, as it
    would had it been granted the slot once freed;
- it runs under the LoRA scales the running one runs under (upstreams/adapters.py);
- its tenant is the only one active (waiting, holding a slot, or within the share window: the
  next slot freed may be another's); with every slot busy, it is at the head of the queue
  (one that may not be lined up is passed by nobody: requests lined up one behind the other
  would keep it from every slot).

The request is then served at once on a provisional lease; when the running request's lease is
given back, the scheduler grants the slot to it as to a waiter (on what the slot then holds) and
its handover resolves to that lease, the one it is recorded with. Only one request waits behind
a slot at a time.

A request is followed only once it is on its way to the server (`SlotScheduler.sent`): its
disk tier's save or restore on the slot is done by then, so one lined up behind it never runs on
the slot before them (a save deferred behind it would archive its text as the evicted one's).
Both requests are the same tenant's, so whichever the server reads first (each comes on its
own connection, and the server's threads read them side by side), no tenant reuses another's
text. Either order is allowed for (`EitherOrder`): the running request's answer is checked
against its reuse on what the slot held before it or on what the lined-up one leaves, and the
lined-up one's on what the running one left or on what the slot held before that one (its lease
keeps the first: what it is charged if cut, and its lineage); once the lined-up one answers,
its `cache_n` tells which order the server took where the two differ, and so what the slot
holds (the lined-up one's text, or the running one's, which ran last); where both orders give
that `cache_n`, the table keeps what the two texts share, then a tail of unknown length.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from cacheproxy.disk.blocks import MIN_ARCHIVE_TOKENS
from cacheproxy.disk.policy import Evicted, worth_saving
from cacheproxy.disk.restores import reusable_of
from cacheproxy.slots.fair_queue import PRIORITIES
from cacheproxy.slots.slot_views import ArchivesFrom, nothing_archived
from cacheproxy.slots.waiter import Waiter
from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.slot_table import (
    CONTINUATION_SLACK_TOKENS,
    UNKNOWN,
    Lease,
    ReuseBounds,
    SlotContent,
    SlotState,
    UpstreamSlots,
)

# what a request lined up may drop of the running prompt: its end, as a next turn re-templates it
SLACK = CONTINUATION_SLACK_TOKENS


@dataclass(frozen=True)
class Running:
    """A leased request another of its tenant may be lined up behind."""

    tenant: str
    table: UpstreamSlots
    slot: SlotState
    generates_at_most: int | None = None  # its bound on the tokens it generates (None: none)
    # what the slot held as the server ran it (None: not known here, after a restore)
    before: SlotContent | None = None


@dataclass(eq=False)
class LinedUp:
    """A request lined up behind the running one on its provisional lease's slot, and the lease
    it runs on once that one is given back."""

    waiter: Waiter
    lease: Lease
    handover: asyncio.Future[Lease]
    followed: Running


@dataclass(frozen=True)
class EitherOrder:
    """A lined-up request handed its slot, and what the server may have done: run the two in
    turn (`in_turn`: its reuse on what the running one left, `left`), or read it first and run
    it on what the slot held before the running one (`swapped`)."""

    in_turn: ReuseBounds
    swapped: ReuseBounds
    left: SlotContent


def hull(one: ReuseBounds, other: ReuseBounds) -> ReuseBounds:
    return ReuseBounds(min(one.low, other.low), max(one.high, other.high))


def reuse_on_content(content: SlotContent | None, prompt: list[int]) -> ReuseBounds:
    """What the server reuses of `prompt` on a slot holding `content` (None: anything)."""
    if content is None:
        return ReuseBounds(0, max(len(prompt) - 1, 0))
    return SlotState(0, 0, content.known, content.unknown_tail).reuse_bounds(prompt)


def either_order(lined: LinedUp, slot: SlotState, in_turn: ReuseBounds) -> EitherOrder:
    """The lined-up request's reuse whichever of the two the server ran first, handed `slot`
    as the running one left it (`in_turn`: its reuse there)."""
    swapped = reuse_on_content(lined.followed.before, lined.waiter.prompt)
    left = slot.content(lined.waiter.tenant)
    return EitherOrder(in_turn, swapped, left)


def running_reuse_either_way(lease: Lease, lined: LinedUp) -> ReuseBounds:
    """The running request's reuse, had the server run the one lined up behind it first: on
    that one's prompt and what it generates."""
    behind = lined.waiter
    tail = UNKNOWN if behind.generates_at_most is None else behind.generates_at_most
    after_it = SlotContent(behind.prompt, tail, behind.tenant)
    return hull(lease.predicted, reuse_on_content(after_it, lease.prompt))


def held_after(
    slot: SlotState, either: EitherOrder, cache_n: int
) -> tuple[list[int], int | None] | None:
    """What the slot holds (its known ids, and an unknown tail) once the lined-up request has
    answered `cache_n`, where that is not the text of its own the table holds: where only the
    swapped order gives `cache_n`, the running one ran last and its text is there; where both
    do, only what the two texts share is known. None: it ran in turn, as recorded."""
    if not either.swapped.holds(cache_n):
        return None
    left = either.left
    if not either.in_turn.holds(cache_n):
        return list(left.known), left.unknown_tail
    if slot.known == left.known and slot.unknown_tail == left.unknown_tail:
        return None
    return slot.known[: common_prefix_length(slot.known, left.known)], UNKNOWN


def may_be_followed(lease: Lease, waiter: Waiter) -> bool:
    """Whether others of its tenant may be lined up behind `lease`, just granted to `waiter`: a
    single pinned prompt on its tenant's own text or an empty slot (see above)."""
    previous = lease.previous
    empty = not previous.known and previous.unknown_tail == 0
    own_or_empty = empty or previous.owner == waiter.tenant
    return (
        own_or_empty
        and not lease.isolate
        and not lease.opaque
        and not lease.chunked
        and not lease.unpinned
        and waiter.count is None
        and waiter.patient
    )


def may_line_up(waiter: Waiter) -> bool:
    """Whether the waiter's request may be sent behind a running one (see above)."""
    return (
        waiter.count is None
        and waiter.patient
        and waiter.cache_prompt
        and bool(waiter.prompt)
        and not waiter.opaque
        and not waiter.exclusive
        and waiter.share.priority == PRIORITIES[0]
    )


def line_up_target(
    waiter: Waiter, running: Iterable[Running], archives_from: ArchivesFrom = nothing_archived
) -> Running | None:
    """The running request `waiter` may be lined up behind: of those it may follow, the one whose
    prompt it shares most of, the longest running of those; None when there is none."""
    best: Running | None = None
    best_key = (0, 0.0)
    for candidate in running:
        table, slot = candidate.table, candidate.slot
        if candidate.tenant != waiter.tenant:
            continue
        if waiter.slot_id is not None and slot.slot_id != waiter.slot_id:
            continue
        if waiter.tables is not None and table.index not in waiter.tables:
            continue
        if table.ram_cache_state != "off" or table.server_picks or not table.healthy:
            continue
        if table.adapters and not table.same_scales(slot, waiter.lora):
            continue  # computed under other LoRA scales: the server would clear it, or mix
        known, prompt = slot.known, waiter.prompt
        floor = archives_from(table.index)  # None: nothing archived, any prompt may follow
        if floor is not None and (not known or known[0] != prompt[0]):
            continue  # shares nothing: the disk tier may archive what it loses, or restore
        shared = slot.shared_with(prompt)
        lost = slot.tokens_lost_to(prompt, shared)
        if floor is not None and lost > SLACK and not disk_passes(candidate, prompt, shared, floor):
            continue
        key = (shared, -slot.lease_started)
        if best is None or key > best_key:
            best, best_key = candidate, key
    return best


def disk_passes(candidate: Running, prompt: list[int], shared: int, floor: int) -> bool:
    """Whether the disk tier, archiving slots of at least `floor` tokens, would neither archive
    what `candidate` leaves on its slot for `prompt`, which keeps `shared` tokens of it, nor
    restore an archive for `prompt` there (see above)."""
    if reusable_of(prompt) - shared >= MIN_ARCHIVE_TOKENS:
        return False  # an archive might give it more than the slot will
    if candidate.generates_at_most is None:
        return False  # what it leaves has no bound
    slot = candidate.slot
    left = slot.n_tokens_at_least + candidate.generates_at_most
    return not worth_saving(Evicted(left, shared, candidate.tenant), floor)
