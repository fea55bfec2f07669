"""A request does not wait for a busy slot only to keep an idle slot's text the disk tier archives
as it is overwritten: it takes the idle slot at once, as llama-server does beside its RAM cache
(W5's agents waited 35-370 ms so, for a busy slot sharing 15 tokens with them). A wait for more
reuse is priced as before."""

from __future__ import annotations

import random

from cacheproxy_plugins.routing_exact import ExactPrefixRouting

from cacheproxy.slots.routing import RouteRequest, UseSlot, WaitForSlot
from cacheproxy.slots.slot_views import (
    ArchivesFrom,
    nothing_archived,
    slot_candidates,
    upstream_views,
)
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.rates import Smoothed
from cacheproxy.upstreams.slot_table import SlotState, UpstreamSlots
from tests.support.asking import Asking

TENANT = "agents"
MIN_TOKENS = 256  # the disk tier's `min_tokens`


def archiving(index: int) -> int | None:
    return MIN_TOKENS


def text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 20000) for _ in range(n)]


def agents_bed(idle_owner: str | None, idle_tokens: int) -> tuple[UpstreamSlots, list[int]]:
    """Slot 0 runs another agent's turn (1,000 tokens), its prompt computed, its 32-token answer
    taking the server 30 ms; slot 1 is idle, holding a third agent's conversation; all three
    share only their first 15 tokens (a template's header)."""
    rng = random.Random(7)
    header = text(rng, 15)
    slots = [SlotState(slot_id, 8192) for slot_id in range(2)]
    table = UpstreamSlots(0, Upstream("http://127.0.0.1:1"), slots)
    table.after_prefill_s = Smoothed(0.03)
    slots[0].hold([*header, *text(rng, 985)])
    slots[0].tenant, slots[0].busy, slots[0].lease_started = TENANT, True, 0.0
    slots[1].hold([*header, *text(rng, idle_tokens - 15)])
    slots[1].tenant, slots[1].last_used = idle_owner, 1.0
    return table, [*header, *text(rng, 1200)]


def plan(table: UpstreamSlots, prompt: list[int], archives_from: ArchivesFrom) -> object:
    holders = {id(table.slots[0]): (TENANT, 0.0)}  # its prompt was computed at 0 s
    views, _, _ = slot_candidates(
        [table], Asking(prompt, TENANT), holders, "", 0.0, None, archives_from
    )
    policy = ExactPrefixRouting(ExactPrefixRouting.Options())
    return policy.plan(RouteRequest(len(prompt)), views, upstream_views([table]))


def idle_view(table: UpstreamSlots, prompt: list[int], archives_from: ArchivesFrom) -> object:
    views, _, _ = slot_candidates([table], Asking(prompt, TENANT), {}, "", 0.0, None, archives_from)
    [idle] = [view for view in views if not view.busy]
    return idle


def test_an_idle_slot_whose_text_is_archived_is_taken_rather_than_a_busy_one_waited_for() -> None:
    table, prompt = agents_bed(TENANT, 4000)
    idle = idle_view(table, prompt, archiving)
    assert (idle.lost, idle.archived) == (3985, True)
    assert plan(table, prompt, archiving) == UseSlot(0, 1)
    # without a disk tier the idle slot's 3,985 tokens would be lost: the wait keeps them
    assert idle_view(table, prompt, nothing_archived).archived is False
    assert isinstance(plan(table, prompt, nothing_archived), WaitForSlot)


def test_a_busy_slot_holding_more_of_the_prompt_is_still_waited_for() -> None:
    """The busy slot holds the prompt's first 800 tokens (a group's prefix): the wait is for
    more reuse, priced as before, whatever the disk tier keeps of the idle slot."""
    table, prompt = agents_bed(TENANT, 4000)
    running = table.slots[0]
    prompt = [*running.known[:800], *prompt[800:]]
    assert idle_view(table, prompt, archiving).archived is True
    assert plan(table, prompt, archiving) == WaitForSlot(0, 0, 5.0)


def test_text_the_tier_would_not_archive_is_still_kept_by_a_wait() -> None:
    """Nobody's text (it was there before the proxy) is never archived, nor one shorter than
    `min_tokens`: placing a request there still loses it."""
    nobodys, prompt = agents_bed(None, 4000)
    assert idle_view(nobodys, prompt, archiving).archived is False
    assert isinstance(plan(nobodys, prompt, archiving), WaitForSlot)
    short, prompt = agents_bed(TENANT, MIN_TOKENS - 1)
    assert idle_view(short, prompt, archiving).archived is False
