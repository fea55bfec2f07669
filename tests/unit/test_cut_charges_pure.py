"""What a cut task is charged where the proxy cannot read its slot by id: the slot the server
picked for it (server_picked.py), and the slots of a request that held its upstream whole
(whole_cuts.py). Pure functions over `GET /slots` reports as llama-server writes them."""

from __future__ import annotations

from cacheproxy.slots.sent_tasks import SentTask
from cacheproxy.slots.server_picked import (
    PickedSlot,
    Seen,
    identify,
    picked_outcome,
    seen_in,
    unplaced_outcome,
)
from cacheproxy.slots.whole_cuts import reuse_while_running, whole_upstream_cut
from cacheproxy.upstreams.slot_table import SlotContent, TaskOutcome

PROMPT = list(range(1000, 9000))  # 8,000 tokens


def sent(reused: int = 0, seen: int = 0, delivered: bool = True) -> SentTask:
    return SentTask(PROMPT, reused, SlotContent([], 0, None), False, False, seen, delivered)


def slot(slot_id: int, task: int | None, held: int = 0, running: bool = False) -> dict:
    """A slot's entry as llama-server shows it (a slot that never ran a task shows no task)."""
    entry: dict = {"id": slot_id, "n_ctx": 32768, "is_processing": running}
    if task is not None:
        entry.update(id_task=task, n_prompt_tokens=held, n_prompt_tokens_cache=0)
    return entry


def test_the_one_slot_processing_is_the_cut_tasks_where_its_lease_is_alone() -> None:
    report = [slot(0, 4, 0), slot(1, None), slot(2, 9, 2048, running=True), slot(3, 7, 0)]
    picked = identify(report, alone=True)
    assert picked == PickedSlot(2, 9, {0: 4, 1: None, 2: 9, 3: 7})
    # another lease under way, two slots processing, or none: it cannot be told
    assert identify(report, alone=False) is None
    assert identify([*report[:3], slot(3, 10, 512, running=True)], alone=True) is None
    assert identify([slot(0, 4, 0), slot(2, 9, 2048)], alone=True) is None


def test_its_count_is_read_once_it_ended_and_no_task_launched_since() -> None:
    picked = PickedSlot(2, 9, {0: 4, 1: None, 2: 9, 3: 7})
    quiet = [slot(0, 4, 0), slot(1, None), slot(2, 9, 4096), slot(3, 7, 0)]
    assert seen_in(picked, quiet) == (Seen.SETTLED, quiet[2])
    running = [*quiet[:2], slot(2, 9, 4096, running=True), quiet[3]]
    assert seen_in(picked, running) == (Seen.RUNNING, None)
    # a task launched on another slot since (its launch empties the idle ones): lost
    launched = [*quiet[:3], slot(3, 11, 300, running=True)]
    assert seen_in(picked, launched) == (Seen.LOST, None)
    # another task took the slot itself
    assert seen_in(picked, [*quiet[:2], slot(2, 12, 100), quiet[3]]) == (Seen.LOST, None)


def test_the_picked_slot_charges_the_prompts_first_tokens_it_holds() -> None:
    picked = PickedSlot(2, 9, {2: 9})
    outcome = picked_outcome(sent(reused=512), picked, slot(2, 9, 2048))
    assert (outcome.cache_n, outcome.prompt_n, outcome.tokens_cached) == (512, 1536, 2048)
    assert outcome.cut and outcome.ok and outcome.slot_id == 2  # the table follows the pick
    # past the prompt: tokens generated
    whole = picked_outcome(sent(), picked, slot(2, 9, len(PROMPT) + 3))
    assert (whole.prompt_n, whole.predicted_n) == (len(PROMPT), 3)
    # a slot holding less than the predicted reuse: all of it charged, none as computed twice
    short = picked_outcome(sent(reused=4000), picked, slot(2, 9, 1000))
    assert (short.cache_n, short.prompt_n) == (1000, 0)


def test_where_the_slot_cannot_be_told_the_prompt_less_its_reuse_is_charged_if_delivered() -> None:
    bound = unplaced_outcome(sent(reused=500))
    assert (bound.cache_n, bound.prompt_n) == (500, len(PROMPT) - 500)
    # a request the server never had whole is charged nothing, unless tokens came back
    assert unplaced_outcome(sent(delivered=False)).prompt_n == 0
    streamed = unplaced_outcome(sent(seen=2, delivered=False))
    assert (streamed.prompt_n, streamed.predicted_n) == (len(PROMPT), 2)


def test_a_cut_whole_upstream_request_is_charged_what_the_slot_it_wrote_holds() -> None:
    before = [slot(0, 3, 700), slot(1, None)]
    running = [slot(0, 3, 700), {**slot(1, 8, 1024, running=True), "n_prompt_tokens_cache": 0}]
    reused: dict[int, int] = {}
    reuse_while_running(running, reused)
    after = [slot(0, 3, 700), slot(1, 8, 1536)]
    outcome = whole_upstream_cut(before, after, reused, TaskOutcome(ok=False))
    assert (outcome.cache_n, outcome.prompt_n, outcome.predicted_n) == (0, 1536, None)
    assert outcome.cut
    # what the server reused while it ran is reused; tokens the stream carried, generated
    reuse_while_running([{**running[1], "n_prompt_tokens_cache": 600}], reused)
    shown = TaskOutcome(ok=False, predicted_n=2)
    outcome = whole_upstream_cut(before, after, reused, shown)
    assert (outcome.cache_n, outcome.prompt_n, outcome.predicted_n) == (600, 934, 2)
    # the slots unread: what the answer showed
    assert whole_upstream_cut(before, None, reused, shown) is shown
    # nothing written (the server never ran it): nothing
    nothing = whole_upstream_cut(before, before, reused, TaskOutcome(ok=False))
    assert (nothing.cache_n, nothing.prompt_n) == (0, 0)
