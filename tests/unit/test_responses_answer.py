"""Reading llama-server's Responses answers (tools/server/server-task.cpp 528-714, 1166-1314 of
the pinned tree): what the slot holds after the task, and what a hiding tenant is shown."""

from __future__ import annotations

import orjson

from cacheproxy.apis.responses_answer import ResponsesObserver, responses_outcome

USAGE = {
    "input_tokens": 40,
    "output_tokens": 5,
    "total_tokens": 45,
    "input_tokens_details": {"cached_tokens": 32},
}
ANSWER = {
    "completed_at": 1,
    "created_at": 1,
    "id": "resp_x",
    "model": "m",
    "object": "response",
    "output": [{"type": "message", "role": "assistant", "content": [], "id": "msg_x"}],
    "status": "completed",
    "usage": USAGE,
}
TIMINGS = {"cache_n": 32, "prompt_n": 8, "prompt_ms": 3.5, "predicted_n": 5, "predicted_ms": 2.0}


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + orjson.dumps({"type": name, **data}) + b"\n\n"


STREAM = (
    event("response.created", {"response": {"id": "resp_x", "status": "in_progress"}})
    + event("response.in_progress", {"response": {"id": "resp_x", "status": "in_progress"}})
    + event("response.output_text.delta", {"item_id": "msg_x", "delta": "hi"})
    + event("response.completed", {"response": {**ANSWER, "usage": USAGE}, "timings": TIMINGS})
)


def test_a_whole_answer_is_read_from_its_usage() -> None:
    outcome = responses_outcome(ANSWER, 40)
    # the slot keeps the prompt and the generated tokens but the last, never decoded
    assert (outcome.ok, outcome.cache_n, outcome.prompt_n, outcome.tokens_cached) == (
        True,
        32,
        8,
        44,
    )
    assert outcome.generated is None  # the answer has no ids: an unknown tail
    assert not responses_outcome({"error": {"code": 500}}, 40).ok


def test_a_whole_answer_passes_untouched_unless_signals_are_hidden() -> None:
    payload = orjson.dumps(ANSWER)
    observer = ResponsesObserver(40, stream=False, oai=True)
    assert observer.rewrite_body(200, payload) == payload
    assert observer.outcome().tokens_cached == 44

    hiding = ResponsesObserver(40, stream=False, oai=True, hide_cache_signals=True)
    shown = orjson.loads(hiding.rewrite_body(200, payload))
    assert shown["usage"] == {**USAGE, "input_tokens_details": {"cached_tokens": 0}}
    assert {**shown, "usage": USAGE} == ANSWER
    assert hiding.outcome().cache_n == 32  # the table still learns the truth


def test_a_stream_is_read_from_its_completed_event_split_anywhere() -> None:
    for cut in range(1, len(STREAM), 7):
        observer = ResponsesObserver(40, stream=True, oai=True)
        shown = observer.relay_chunk(STREAM[:cut]) + observer.relay_chunk(STREAM[cut:])
        assert shown == STREAM
        outcome = observer.outcome()
        assert (outcome.cache_n, outcome.prompt_n, outcome.tokens_cached) == (32, 8, 44)
        assert outcome.generated is None


def test_a_hiding_tenants_stream_shows_an_uncached_run() -> None:
    observer = ResponsesObserver(40, stream=True, oai=True, hide_cache_signals=True)
    shown = observer.relay_chunk(STREAM) + observer.finish()
    blocks = shown.split(b"\n\n")[:-1]
    assert [block.split(b"\n")[0] for block in blocks] == [
        block.split(b"\n")[0] for block in STREAM.split(b"\n\n")[:-1]
    ]  # the same events, in order, each still named
    completed = orjson.loads(blocks[-1].split(b"\n")[1][6:])
    assert completed["timings"] == {
        "cache_n": 0,
        "prompt_n": 40,
        "predicted_n": 5,
        "predicted_ms": 2.0,
    }
    assert completed["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 0}


def test_an_error_event_fails_the_task() -> None:
    observer = ResponsesObserver(40, stream=True, oai=True)
    observer.relay_chunk(STREAM.split(b"event: response.completed")[0])
    observer.relay_chunk(b'data: {"error":{"code":500,"message":"x","type":"server_error"}}\n\n')
    assert not observer.outcome().ok


def test_a_stream_cut_before_its_end_counts_each_token_it_carried() -> None:
    """What a cut stream is charged as generated: its delta events, one a token (text,
    reasoning or a tool call's arguments), not the events around them; read fast (the events
    passed on as they are) or one by one (a hiding tenant's, rewritten)."""
    deltas = [
        event("response.reasoning_text.delta", {"item_id": "rs_x", "delta": "so"}),
        event("response.output_item.added", {"item": {"type": "message", "id": "msg_x"}}),
        event("response.output_text.delta", {"item_id": "msg_x", "delta": 'say "hi"'}),
        event("response.output_text.delta", {"item_id": "msg_x", "delta": "!"}),
        event("response.function_call_arguments.delta", {"item_id": "fc_x", "delta": "{"}),
    ]
    cut = STREAM.split(b"event: response.output_text.delta")[0] + b"".join(deltas)
    for hiding in (False, True):
        observer = ResponsesObserver(40, stream=True, oai=True, hide_cache_signals=hiding)
        observer.relay_chunk(cut)
        outcome = observer.outcome()
        assert (outcome.ok, outcome.predicted_n) == (False, 4), hiding
