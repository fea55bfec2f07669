"""Reading answers on the side: what the slot now holds, and the answer the client is shown."""

from __future__ import annotations

import orjson

from cacheproxy.slots.observe import TaskObserver


def sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else orjson.dumps(e)) + b"\n\n"
        for e in events
    )


NATIVE_STREAM = sse(
    {"content": "a", "tokens": [11], "stop": False},
    {"content": "", "tokens": [0], "stop": False, "prompt_progress": {"total": 5, "cache": 3}},
    {"content": "b", "tokens": [12], "stop": False},
    {"content": "", "tokens": [], "stop": True, "tokens_cached": 6,
     "timings": {"cache_n": 3, "prompt_n": 2, "prompt_ms": 1.0, "predicted_n": 2}},
)  # fmt: skip


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
        {"choices": [{"delta": {}, "finish_reason": "length"}],
         "timings": {"cache_n": 0, "prompt_n": 7, "predicted_n": 4}},
        "[DONE]",
    )  # fmt: skip
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
    observer = TaskObserver(5, stream=False, oai=False, added=frozenset({"return_tokens"}),
                            ids_in_answer=True)  # fmt: skip
    shown = orjson.loads(observer.rewrite_body(200, orjson.dumps(answer)))
    assert shown["tokens"] == []  # what llama-server sends without return_tokens
    assert observer.outcome().generated == [11, 12]

    oai = {"choices": [{"text": "ab"}], "__verbose": answer}
    added = frozenset({"verbose", "return_tokens"})
    observer = TaskObserver(5, stream=False, oai=True, added=added, ids_in_answer=True)
    shown = orjson.loads(observer.rewrite_body(200, orjson.dumps(oai)))
    assert "__verbose" not in shown
    assert observer.outcome().tokens_cached == 6


def test_hidden_cache_signals_leave_neither_body_nor_stream() -> None:
    answer = {
        "content": "ab",
        "timings": {"cache_n": 3, "prompt_n": 2, "predicted_n": 2},
        "usage": {"prompt_tokens_details": {"cached_tokens": 3}},
        "tokens_cached": 6,
    }
    observer = TaskObserver(5, stream=False, oai=False, hide_cache_signals=True)
    shown = orjson.loads(observer.rewrite_body(200, orjson.dumps(answer)))
    assert shown == {
        "content": "ab",
        "timings": {"predicted_n": 2},
        "usage": {"prompt_tokens_details": {}},
    }
    assert observer.outcome().cache_n == 3  # the proxy still reads them

    observer = TaskObserver(5, stream=True, oai=False, hide_cache_signals=True)
    half = len(NATIVE_STREAM) // 2
    shown = observer.relay_chunk(NATIVE_STREAM[:half]) + observer.relay_chunk(NATIVE_STREAM[half:])
    shown += observer.finish()
    for signal in (b"cache_n", b"prompt_n", b"tokens_cached", b"prompt_progress"):
        assert signal not in shown
    assert shown.count(b"data: ") == 4
    assert observer.outcome().cache_n == 3
