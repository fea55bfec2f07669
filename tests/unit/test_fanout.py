"""Splitting several completions and batches into single tasks, and merging their answers, as
llama-server numbers and shapes them (the integration tests compare with a real one)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from cacheproxy.plugins import load_plugin
from cacheproxy.slots.fanout import (
    BAD_ELEMENT,
    EMPTY_PROMPT,
    FanoutPlan,
    NotSplittable,
    StreamMerge,
    error_event,
    merge_answers,
    plan_fanout,
)
from cacheproxy.slots.prompt_bounds import RequestRejected
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import SlotState, Smoothed, TaskOutcome, UpstreamSlots


def test_one_prompt_and_one_completion_is_no_split() -> None:
    assert plan_fanout("completion", False, {"prompt": "a"}, 4) is None
    assert plan_fanout("completion", False, {"prompt": [1, 2], "n": 1}, 4) is None
    assert plan_fanout("completion", False, {"prompt": ["a", 5, "b"], "n": None}, 4) is None
    assert plan_fanout("chat", True, {"messages": [], "n_cmpl": 1, "n": 3}, 4) is None
    assert plan_fanout("completion", False, {"n": 2}, 4) is None  # no prompt: the server says


def test_tasks_are_numbered_prompt_then_its_children() -> None:
    document = {"prompt": ["a", [7, 8], {"prompt_string": "c"}], "n": 2, "seed": 10}
    plan = plan_fanout("completion", True, document, 4)
    assert plan is not None and plan.oai
    assert [(t.index, t.child) for t in plan.tasks] == [
        (0, 0),
        (1, 1),
        (2, 0),
        (3, 1),
        (4, 0),
        (5, 1),
    ]
    assert [t.body["prompt"] for t in plan.tasks] == [
        "a", "a", [7, 8], [7, 8], {"prompt_string": "c"}, {"prompt_string": "c"},
    ]  # fmt: skip
    assert [t.prompt_input for t in plan.tasks[::2]] == ["a", [7, 8], "c"]
    assert all("n" not in t.body and "n_cmpl" not in t.body for t in plan.tasks)
    # a child's seed moves on by its number (server-task.h add_child)
    assert [t.body["seed"] for t in plan.tasks] == [10, 11, 10, 11, 10, 11]


def test_a_random_seed_stays_random_in_children() -> None:
    plan = plan_fanout("chat", True, {"messages": [], "n_cmpl": 3, "seed": -1}, 4)
    assert plan is not None
    assert [t.body["seed"] for t in plan.tasks] == [-1, -1, -1]
    assert [t.prompt_input for t in plan.tasks] == [None] * 3
    wraps = plan_fanout("chat", True, {"messages": [], "n": 2, "seed": 2**32 - 2}, 4)
    assert wraps is not None and wraps.tasks[1].body["seed"] == 2**32 - 1


def test_a_batch_of_one_and_an_empty_prompt_keep_their_meaning() -> None:
    plan = plan_fanout("completion", False, {"prompt": [[]]}, 4)
    assert plan is not None and len(plan.tasks) == 1
    # at the top level [] would be an empty batch; inside one it is an empty prompt
    assert plan.tasks[0].body["prompt"] == {"prompt_string": []}


RANGE = "Value must be between 1 <= value <= 4, but got"
NOT_A_NUMBER = "[json.exception.type_error.302] type must be number, but is"


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"prompt": "a", "n": 0}, f"Field 'n': {RANGE} 0"),
        ({"prompt": "a", "n_cmpl": 5, "n": 2}, f"Field 'n_cmpl': {RANGE} 5"),
        ({"prompt": "a", "n": "2"}, f"Field 'n': {NOT_A_NUMBER} string"),
        ({"prompt": "a", "n": [2]}, f"Field 'n': {NOT_A_NUMBER} array"),
        ({"prompt": [], "n": 9}, EMPTY_PROMPT),
        ({"prompt": ["a", 1.5], "n": 9}, BAD_ELEMENT),  # the prompt is read before n
        ({"prompt": ["a", ["b"]]}, BAD_ELEMENT),
        ({"prompt": [{"text": "a"}]}, BAD_ELEMENT),
    ],
)
def test_refusals_are_llama_servers(document: dict, message: str) -> None:
    with pytest.raises(RequestRejected) as refused:
        plan_fanout("completion", False, document, 4)
    assert refused.value.message == message


def test_counts_are_read_as_int32_casts() -> None:
    assert len(plan_fanout("completion", False, {"prompt": "a", "n": 2.9}, 4).tasks) == 2
    assert plan_fanout("completion", False, {"prompt": "a", "n": True}, 4) is None
    wrapped = plan_fanout("completion", False, {"prompt": "a", "n": 2**32 + 2}, 4)
    assert wrapped is not None and len(wrapped.tasks) == 2


def test_multimodal_prompts_are_left_to_the_server() -> None:
    multimodal = {"prompt_string": "a", "multimodal_data": []}
    with pytest.raises(NotSplittable):
        plan_fanout("completion", False, {"prompt": [multimodal]}, 4)


def plan_of(tasks: int, oai: bool, children: int = 1, **flags: bool) -> FanoutPlan:
    document = {"prompt": ["p"] * (tasks // children), "n": children, **flags}
    plan = plan_fanout("completion", oai, document, 8)
    assert plan is not None
    return plan


def test_native_answers_merge_into_an_array_in_index_order() -> None:
    answers = [{"index": 0, "content": "x"}, {"index": 0, "content": "y"}]
    assert merge_answers(plan_of(2, oai=False), answers) == [
        {"index": 0, "content": "x"},
        {"index": 1, "content": "y"},
    ]
    one = merge_answers(plan_of(1, oai=False), [{"index": 0, "content": "x"}])
    assert one == {"index": 0, "content": "x"}


def test_oai_answers_merge_into_the_first_with_every_choice() -> None:
    def answer(text: str, prompt_tokens: int) -> dict:
        return {
            "choices": [{"text": text, "index": 0}],
            "usage": {"prompt_tokens": prompt_tokens},
            "timings": {"cache_n": prompt_tokens},
            "__verbose": {"index": 0},
        }

    merged = merge_answers(plan_of(3, oai=True), [answer("a", 1), answer("b", 2), answer("c", 3)])
    assert merged["choices"] == [
        {"text": "a", "index": 0},
        {"text": "b", "index": 1},
        {"text": "c", "index": 2},
    ]
    # usage and timings stay the first task's, as llama-server leaves them
    assert merged["usage"] == {"prompt_tokens": 1} and merged["timings"] == {"cache_n": 1}


def events(data: bytes) -> list[object]:
    return [orjson.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


def test_stream_events_are_renumbered_and_begins_after_the_first_are_null() -> None:
    merge = StreamMerge(plan_of(4, oai=False, children=2), "chatcmpl-x")
    # tasks 0 and 2 are prompts, 1 and 3 their children
    assert merge.started(2) == b""  # the first begin only sends the headers
    assert merge.started(1) == b""  # children send no begin
    assert merge.started(0) == b"data: null\n\n"
    half = merge.feed(3, b'data: {"index":0,"content":"a"}\n\ndata: {"ind')
    assert events(half) == [{"index": 3, "content": "a"}]
    assert events(merge.feed(3, b'ex":0,"content":"b"}\n\n')) == [{"index": 3, "content": "b"}]
    assert merge.closing() == b""  # the native route ends with no [DONE]


def test_oai_streams_share_one_id_and_one_done() -> None:
    merge = StreamMerge(plan_of(2, oai=True), "chatcmpl-one")
    chunk = b'data: {"choices":[{"index":0,"text":"a"}],"id":"chatcmpl-own"}\n\ndata: [DONE]\n\n'
    shown = merge.feed(1, chunk)
    assert events(shown) == [{"choices": [{"index": 1, "text": "a"}], "id": "chatcmpl-one"}]
    assert b"[DONE]" not in shown
    assert merge.closing() == b"data: [DONE]\n\n"


def test_a_child_shows_only_its_prompt_done_and_progress_begins_are_events() -> None:
    merge = StreamMerge(plan_of(2, oai=False, children=2, return_progress=True), "x")
    assert merge.started(0) == merge.started(1) == b""
    begin = b'data: {"index":0,"prompt_progress":{"total":3,"processed":1}}\n\n'
    done = b'data: {"index":0,"prompt_progress":{"total":3,"processed":3}}\n\n'
    assert merge.feed(1, begin) == b""
    assert events(merge.feed(1, done)) == [
        {"index": 1, "prompt_progress": {"total": 3, "processed": 3}}
    ]
    assert events(merge.feed(0, begin + done)) == [
        {"index": 0, "prompt_progress": {"total": 3, "processed": 1}},
        {"index": 0, "prompt_progress": {"total": 3, "processed": 3}},
    ]


def test_an_error_event_ends_the_stream() -> None:
    merge = StreamMerge(plan_of(2, oai=True), "x")
    error = b'data: {"error":{"code":500,"message":"m","type":"server_error"}}\n\n'
    assert merge.feed(0, error) == error
    assert merge.failed
    assert merge.feed(1, b'data: {"choices":[]}\n\n') == b""
    assert merge.closing() == b""  # no [DONE] after an error


def test_an_error_answer_becomes_the_error_event() -> None:
    body = b'{"error":{"code":400,"message":"too long","type":"exceed_context_size_error"}}'
    assert error_event(body, b"{}") == b"data: " + body + b"\n\n"
    assert error_event(b"<html>", b'{"error":1}') == b'data: {"error":1}\n\n'


async def test_an_impatient_request_takes_an_idle_slot_rather_than_wait() -> None:
    """The tasks of one split request share their prompt: a later one must not wait for the
    slot an earlier one is filling with it."""
    table = UpstreamSlots(0, Upstream("http://u"), [SlotState(i, 4096) for i in range(2)])
    policy = load_plugin("routing", "exact-prefix", {"max_wait_s": 5})
    table.prefill_ms_per_token = Smoothed(10.0)  # a slow prefill: worth a wait
    sched = SlotScheduler([table], policy, 8)
    prompt = list(range(500))
    first = await sched.acquire(prompt, "t")
    sched.release(first, TaskOutcome(ok=True, cache_n=0, tokens_cached=500, generated=[]))
    held = await sched.acquire(prompt, "t")  # on the slot that holds the prompt
    patient = asyncio.ensure_future(sched.acquire(prompt, "t"))
    await asyncio.sleep(0)
    assert not patient.done()  # waits for the slot that holds it all
    impatient = await asyncio.wait_for(sched.acquire(prompt, "t", patient=False), 1)
    assert impatient.slot is not held.slot
    patient.cancel()
