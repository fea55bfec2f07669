"""Reading answers on the side: what the slot now holds, and the answer the client is shown."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from cacheproxy.apis import observe
from cacheproxy.apis.observe import TaskObserver


def sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else orjson.dumps(e)) + b"\n\n"
        for e in events
    )


NATIVE_STREAM = sse(
    {"content": "a", "tokens": [11], "stop": False},
    {
        "content": "",
        "tokens": [0],
        "stop": False,
        "prompt_progress": {"total": 5, "cache": 3, "processed": 5, "time_ms": 2},
    },
    {"content": "b", "tokens": [12], "stop": False},
    {
        "content": "",
        "tokens": [],
        "stop": True,
        "tokens_cached": 6,
        "timings": {"cache_n": 3, "prompt_n": 2, "prompt_ms": 1.0, "predicted_n": 2},
    },
)


def test_native_stream_gives_every_generated_id_even_split_anywhere() -> None:
    for cut in range(1, len(NATIVE_STREAM)):
        observer = TaskObserver(5, stream=True, oai=False)
        shown = observer.relay_chunk(NATIVE_STREAM[:cut]) + observer.relay_chunk(
            NATIVE_STREAM[cut:]
        )
        assert shown == NATIVE_STREAM[:cut] + NATIVE_STREAM[cut:]  # passed on untouched
        outcome = observer.outcome()
        assert (outcome.generated, outcome.tokens_cached, outcome.cache_n) == ([11, 12], 6, 3)


def test_a_missing_id_leaves_generated_unknown() -> None:
    observer = TaskObserver(5, stream=True, oai=False)
    observer.relay_chunk(NATIVE_STREAM.replace(b'"predicted_n":2', b'"predicted_n":3'))
    assert observer.outcome().generated is None


def test_oai_stream_counts_the_tail_from_predicted_n() -> None:
    stream = sse(
        {"choices": [{"delta": {"content": "hi"}}]},
        {
            "choices": [{"delta": {}, "finish_reason": "length"}],
            "timings": {"cache_n": 0, "prompt_n": 7, "predicted_n": 4},
        },
        "[DONE]",
    )
    observer = TaskObserver(7, stream=True, oai=True)
    observer.relay_chunk(stream)
    outcome = observer.outcome()
    assert (outcome.ok, outcome.generated, outcome.tokens_cached) == (True, None, 7 + 3)


def test_an_error_event_marks_the_task_failed() -> None:
    observer = TaskObserver(3, stream=True, oai=False)
    observer.relay_chunk(
        sse({"content": "a", "tokens": [1], "stop": False}, {"error": {"code": 500}})
    )
    assert observer.outcome().ok is False


def test_fields_the_proxy_added_are_taken_out_again() -> None:
    answer = {"content": "ab", "tokens": [11, 12], "tokens_cached": 6, "timings": {"cache_n": 3}}
    observer = TaskObserver(
        5, stream=False, oai=False, added=frozenset({"return_tokens"}), ids_in_answer=True
    )
    shown = orjson.loads(observer.rewrite_body(200, orjson.dumps(answer)))
    assert shown["tokens"] == []  # what llama-server sends without return_tokens
    assert observer.outcome().generated == [11, 12]

    oai = {"choices": [{"text": "ab"}], "__verbose": answer}
    added = frozenset({"verbose", "return_tokens"})
    observer = TaskObserver(5, stream=False, oai=True, added=added, ids_in_answer=True)
    shown = orjson.loads(observer.rewrite_body(200, orjson.dumps(oai)))
    assert "__verbose" not in shown
    assert observer.outcome().tokens_cached == 6


def test_hidden_cache_signals_show_an_uncached_run_in_body_and_stream() -> None:
    answer = {
        "content": "ab",
        "timings": {"cache_n": 3, "prompt_n": 2, "prompt_ms": 1.5, "predicted_n": 2},
        "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}},
        "tokens_cached": 6,
    }
    observer = TaskObserver(5, stream=False, oai=False, hide_cache_signals=True)
    shown = orjson.loads(observer.rewrite_body(200, orjson.dumps(answer)))
    assert shown == {
        "content": "ab",
        "timings": {"cache_n": 0, "prompt_n": 5, "predicted_n": 2},
        "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}},
        "tokens_cached": 6,
    }
    assert observer.outcome().cache_n == 3  # the proxy still reads them

    observer = TaskObserver(5, stream=True, oai=False, hide_cache_signals=True)
    half = len(NATIVE_STREAM) // 2
    shown = observer.relay_chunk(NATIVE_STREAM[:half]) + observer.relay_chunk(NATIVE_STREAM[half:])
    shown += observer.finish()
    events = [orjson.loads(line[6:]) for line in shown.split(b"\n\n") if line]
    assert len(events) == 4
    assert events[1]["prompt_progress"] == {"total": 5, "cache": 0, "processed": 5}
    assert events[3]["timings"] == {"cache_n": 0, "prompt_n": 5, "predicted_n": 2}
    assert observer.outcome().cache_n == 3


ANTHROPIC_STREAM = (
    b"event: message_start\n"
    + sse(
        {
            "type": "message_start",
            "message": {
                "usage": {"cache_read_input_tokens": 184, "input_tokens": 1, "output_tokens": 0}
            },
        }
    )
    + b"event: message_delta\n"
    + sse({"type": "message_delta", "usage": {"output_tokens": 2}})
)


def test_hidden_anthropic_and_responses_usage_count_the_whole_prompt() -> None:
    message = {"usage": {"cache_read_input_tokens": 184, "input_tokens": 1, "output_tokens": 2}}
    observer = TaskObserver(0, stream=False, oai=False, hide_cache_signals=True)
    shown = orjson.loads(observer.rewrite_body(200, orjson.dumps(message)))
    assert shown["usage"] == {"cache_read_input_tokens": 0, "input_tokens": 185, "output_tokens": 2}

    observer = TaskObserver(0, stream=True, oai=False, hide_cache_signals=True)
    shown = observer.relay_chunk(ANTHROPIC_STREAM) + observer.finish()
    assert shown.startswith(b"event: message_start\ndata: ")
    start = orjson.loads(shown.split(b"\n")[1][6:])
    assert start["message"]["usage"]["input_tokens"] == 185
    assert start["message"]["usage"]["cache_read_input_tokens"] == 0

    completed = {
        "type": "response.completed",
        "response": {
            "usage": {"input_tokens": 185, "input_tokens_details": {"cached_tokens": 184}}
        },
        "timings": {"cache_n": 184, "prompt_n": 1, "prompt_per_second": 9.0},
    }
    observer = TaskObserver(0, stream=True, oai=False, hide_cache_signals=True)
    event = orjson.loads(observer.relay_chunk(sse(completed))[6:])
    assert event["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert event["timings"] == {"cache_n": 0, "prompt_n": 185}


def test_a_stream_passed_on_unchanged_is_parsed_only_where_the_table_needs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Relaying costs no JSON parse per token: partial events give their ids in one pattern
    search over a batch, and only the final event (native) or the last with `timings` (OAI) is
    parsed. The count
    of parses is the cost itself, so the real parser is wrapped to count its calls."""
    parsed: list[bytes] = []

    def counting_loads(data: bytes) -> object:
        parsed.append(bytes(data))
        return orjson.loads(data)

    monkeypatch.setattr(
        observe,
        "orjson",
        SimpleNamespace(
            loads=counting_loads, dumps=orjson.dumps, JSONDecodeError=orjson.JSONDecodeError
        ),
    )
    observer = TaskObserver(5, stream=True, oai=False)
    stream = b"".join(e + b"\n\n" for e in NATIVE_STREAM.split(b"\n\n") if b"progress" not in e)
    for event in stream.split(b"\n\n")[:-1]:  # one chunk per event, as llama-server flushes
        observer.relay_chunk(event + b"\n\n")
    assert observer.outcome().generated == [11, 12]
    assert len(parsed) == 1 and b'"stop":true' in parsed[0]


def test_generated_text_that_looks_like_a_key_is_not_read_as_one() -> None:
    """Text is a JSON string, its quotes escaped: `"stop":true` or `"tokens":[9]` written by the
    model never match the keys the relay searches for."""
    lookalike = '"stop":true, "tokens":[99], "timings":{}, {"error":1}'
    stream = sse(
        {"content": lookalike, "tokens": [21], "stop": False},
        {"content": lookalike, "tokens": [22], "stop": False},
        {
            "content": "",
            "tokens": [],
            "stop": True,
            "tokens_cached": 6,
            "timings": {"cache_n": 3, "prompt_n": 2, "prompt_ms": 1.0, "predicted_n": 2},
        },
    )
    observer = TaskObserver(5, stream=True, oai=False)
    assert observer.relay_chunk(stream) == stream
    outcome = observer.outcome()
    assert outcome.ok and outcome.generated == [21, 22] and outcome.tokens_cached == 6


@pytest.mark.parametrize("route", ["chat", "text"])
def test_an_oai_stream_cut_before_its_end_counts_a_token_a_chunk_that_carries_one(
    route: str,
) -> None:
    """What a cut stream is charged as generated, read fast (passed on as it is) or event by
    event (a hiding tenant's): each chunk carrying text or a tool call, on the chat route
    (`delta`) and on `/v1/completions` (`text`); not a role, an empty text or logprobs."""

    def chunk(text: str) -> dict:
        if route == "chat":
            return {"choices": [{"index": 0, "delta": {"content": text}}], "object": "x"}
        logprobs = {"content": [{"id": 1, "token": text, "logprob": -0.5}]}
        return {"choices": [{"text": text, "index": 0, "logprobs": logprobs}], "object": "x"}

    opening = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}
    stream = sse(opening, chunk("a"), chunk(""), chunk('say "b"'), chunk("c"))
    for hiding in (False, True):
        observer = TaskObserver(7, stream=True, oai=True, hide_cache_signals=hiding)
        observer.relay_chunk(stream)
        outcome = observer.outcome()
        assert (outcome.ok, outcome.predicted_n) == (False, 3), hiding
