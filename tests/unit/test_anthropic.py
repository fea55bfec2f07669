"""The Anthropic translation, by itself: the request conversion's quirks, and the answers and
streams rebuilt from chat chunks as server-task.cpp writes them (including the tool calls the
random-weight test model never makes)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cacheproxy.apis.anthropic import chat_request, normalize_billing_header
from cacheproxy.apis.anthropic_answers import (
    AnthropicObserver,
    MessageStream,
    chat_request_to_render,
    message_from_chat,
)
from cacheproxy.apis.observe import TaskObserver
from cacheproxy.errors import ApiError

# -- requests --------------------------------------------------------------------------------


def test_a_plain_body_gets_the_default_max_tokens_and_only_the_fields_carried_over() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
        "top_k": 3,
        "id_slot": 2,
        "cache_prompt": False,
        "n_predict": 9,
        "stream": True,
    }
    assert chat_request(body) == {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4096,
        "temperature": 0,
        "top_k": 3,
        "stream": True,
    }


def test_the_billing_header_stamp_is_blanked_as_the_server_blanks_it() -> None:
    header = "x-anthropic-billing-header: cc_version=2.1; cch=a5145;You are Claude Code."
    assert normalize_billing_header(header) == (
        "x-anthropic-billing-header: cc_version=2.1; cch=fffff;You are Claude Code."
    )
    # not followed by ';' after five characters, or not a header: left alone
    assert normalize_billing_header("x-anthropic-billing-header: cch=a51;") == (
        "x-anthropic-billing-header: cch=a51;"
    )
    assert normalize_billing_header("hello cch=a5145;") == "hello cch=a5145;"
    blocks = [
        {"type": "text", "text": header},
        {"type": "image"},
        {"type": "text", "text": " more"},
    ]
    converted = chat_request({"system": blocks, "messages": []})
    assert converted["messages"] == [
        {"role": "system", "content": normalize_billing_header(header) + " more"}
    ]
    # a system of another type still makes an (empty) system message
    assert chat_request({"system": 5, "messages": []})["messages"] == [
        {"role": "system", "content": ""}
    ]


def test_content_blocks_become_chat_messages() -> None:
    messages = [
        {"role": "assistant"},  # no content: an assistant's is dropped
        {"role": "user"},  # anyone else's kept as it is
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm"},
                {"type": "text", "text": "Let me look.", "cache_control": {}},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": "é"}},
                {"type": "tool_use", "id": "t2", "name": "g"},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "done"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t2",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"type": "tool_result", "tool_use_id": "t3", "content": {"odd": True}},
                {
                    "type": "tool_result",
                    "tool_use_id": "t4",
                    "content": [
                        {"type": "text", "text": "see"},
                        {"type": "image", "source": {"type": "base64", "data": "AA=="}},
                    ],
                },
                {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
                {"type": "image", "source": {"type": "file"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t5"}]},
    ]
    assert chat_request({"messages": messages})["messages"] == [
        {"role": "user"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look.", "cache_control": {}}],
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"b":1,"a":"é"}'},
                },
                {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
            "reasoning_content": "hm",
        },
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "done"},
        {"role": "tool", "tool_call_id": "t2", "content": "ab"},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
        {
            "role": "tool",
            "tool_call_id": "t4",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AA=="}},
            ],
        },
        {"role": "tool", "tool_call_id": "t5", "content": ""},
    ]


def test_tool_calls_alone_get_empty_content() -> None:
    message = {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": []}]}
    [converted] = chat_request({"messages": [message]})["messages"]
    assert converted == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "", "type": "function", "function": {"name": "f", "arguments": "[]"}}
        ],
    }


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("tool_choice", {"type": "auto"}, {"tool_choice": "auto"}),
        ("tool_choice", {"type": "any"}, {"tool_choice": "required"}),
        ("tool_choice", {"type": "tool", "name": "f"}, {"tool_choice": "required"}),
        ("tool_choice", {"type": "none"}, {}),
        ("tool_choice", "auto", {}),
        ("stop_sequences", ["x"], {"stop": ["x"]}),
        ("max_tokens", None, {"max_tokens": None}),
        ("thinking", {"type": "enabled"}, {"thinking_budget_tokens": 10000}),
        ("thinking", {"type": "enabled", "budget_tokens": 64}, {"thinking_budget_tokens": 64}),
        ("thinking", {"type": "enabled", "budget_tokens": 2.9}, {"thinking_budget_tokens": 2}),
        ("thinking", {"type": "enabled", "budget_tokens": "x"}, {"thinking_budget_tokens": 10000}),
        (
            "thinking",
            {"type": "enabled", "budget_tokens": 2**32 + 5},
            {"thinking_budget_tokens": 5},
        ),
        ("thinking", {"type": "disabled", "budget_tokens": 64}, {}),
        ("thinking", None, {}),
        ("metadata", {"user_id": "u1"}, {"__metadata_user_id": "u1"}),
        ("metadata", {"user_id": ""}, {}),
        ("metadata", {"user_id": 5}, {}),
        (
            "chat_template_kwargs",
            {"enable_thinking": False},
            {"chat_template_kwargs": {"enable_thinking": False}},
        ),
        ("tools", "nope", {}),
    ],
)
def test_field_mappings(field: str, value: Any, expected: dict) -> None:
    converted = chat_request({"messages": [], field: value})
    del converted["messages"]
    converted.setdefault("max_tokens", 4096)
    assert converted == {"max_tokens": 4096, **expected}


def test_tools_become_functions() -> None:
    tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}, {"name": 3}]
    assert chat_request({"messages": [], "tools": tools})["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        },
        {"type": "function", "function": {"name": "", "description": "", "parameters": {}}},
    ]


def test_a_body_without_messages_is_refused_as_the_server_refuses_it() -> None:
    with pytest.raises(ApiError) as refused:
        chat_request({"max_tokens": 3})
    assert (refused.value.status, refused.value.message) == (500, "'messages' is required")
    assert chat_request({"messages": "odd"})["messages"] == []


def test_rendering_asks_for_what_it_reads() -> None:
    assert chat_request_to_render({"messages": []})["verbose"] is True
    streamed = chat_request_to_render({"messages": [], "stream": True})
    assert streamed["verbose"] is True and streamed["timings_per_token"] is True


# -- answers ---------------------------------------------------------------------------------


def chat_answer(message: dict, finish_reason: str, stopping_word: str = "") -> dict:
    return {
        "choices": [{"finish_reason": finish_reason, "index": 0, "message": message}],
        "created": 1,
        "model": "m",
        "object": "chat.completion",
        "usage": {
            "completion_tokens": 5,
            "prompt_tokens": 30,
            "total_tokens": 35,
            "prompt_tokens_details": {"cached_tokens": 12},
        },
        "id": "chatcmpl-1",
        # the native answer inside, where the chat observer reads the task's outcome
        "__verbose": {
            "stopping_word": stopping_word,
            "tokens_cached": 34,
            "timings": {"cache_n": 12, "prompt_n": 18, "predicted_n": 5},
        },
        "timings": {"cache_n": 12, "prompt_n": 18, "predicted_n": 5},
    }


def test_a_whole_answer_in_anthropic_form() -> None:
    message = {
        "role": "assistant",
        "content": "Sure.",
        "reasoning_content": "thinking",
        "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"a":1}'}, "id": "c1"},
            {"type": "function", "function": {"name": "g", "arguments": "not json"}},
        ],
    }
    rendered = message_from_chat(chat_answer(message, "tool_calls"))
    assert list(rendered) == [
        "id",
        "type",
        "role",
        "content",
        "model",
        "stop_reason",
        "stop_sequence",
        "usage",
    ]
    assert rendered == {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "thinking", "signature": ""},
            {"type": "text", "text": "Sure."},
            {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
            {"type": "tool_use", "id": "", "name": "g", "input": {}},
        ],
        "model": "m",
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 12, "input_tokens": 18, "output_tokens": 5},
    }
    stopped = message_from_chat(chat_answer({"role": "assistant", "content": ""}, "stop", "##"))
    assert (stopped["content"], stopped["stop_reason"], stopped["stop_sequence"]) == (
        [],
        "end_turn",
        "##",
    )
    assert message_from_chat(chat_answer({"content": "x"}, "length"))["stop_reason"] == "max_tokens"


def chunk(delta: dict, timings: bool = True, finish: str | None = None, **extra: Any) -> dict:
    event = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": 1,
        "id": "chatcmpl-2",
        "model": "m",
        "object": "chat.completion.chunk",
        **extra,
    }
    if timings:
        event["timings"] = {"cache_n": 7, "prompt_n": 3, "predicted_n": 4}
    return event


def tool_delta(index: int, name: str = "", arguments: str = "", call_id: str = "") -> dict:
    call: dict[str, Any] = {"index": index}
    if call_id:
        call |= {"id": call_id, "type": "function"}
    function = {key: value for key, value in (("name", name), ("arguments", arguments)) if value}
    if function:
        call["function"] = function
    return {"tool_calls": [call]}


def test_a_stream_with_reasoning_text_and_tool_calls() -> None:
    """The events server-task.cpp writes for this sequence of results, with their quirks: the
    final result opens its blocks afresh, and starts again a tool call it continues."""
    stream = MessageStream()
    results = [
        [
            chunk({"role": "assistant", "content": None}, timings=False),
            chunk({"reasoning_content": "a"}),
        ],
        [chunk({"reasoning_content": "b"})],
        [chunk({"content": "Hi"})],
        [chunk(tool_delta(0, "f", '{"x"', "c1"))],
        [
            chunk(tool_delta(0, arguments=":1}"), timings=False, __verbose={"stopping_word": ""}),
            chunk({}, finish="tool_calls"),
        ],
    ]
    events = [event for result in results for part in result for event in stream.chunk(part)]
    assert events == [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "chatcmpl-2",
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": "m",
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"cache_read_input_tokens": 7, "input_tokens": 3, "output_tokens": 0},
                },
            },
        ),
        block_start(0, {"type": "thinking", "thinking": ""}),
        block_delta(0, {"type": "thinking_delta", "thinking": "a"}),
        block_delta(0, {"type": "thinking_delta", "thinking": "b"}),
        block_start(1, {"type": "text", "text": ""}),
        block_delta(1, {"type": "text_delta", "text": "Hi"}),
        block_start(2, {"type": "tool_use", "id": "c1", "name": "f"}),
        block_delta(2, {"type": "input_json_delta", "partial_json": '{"x"'}),
        # the final result: its own tool_calls_started, so the block is started again
        block_start(2, {"type": "tool_use", "id": "c1", "name": "f"}),
        block_delta(2, {"type": "input_json_delta", "partial_json": ":1}"}),
        block_delta(0, {"type": "signature_delta", "signature": ""}),
        block_stop(0),
        block_stop(1),
        block_stop(2),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 4},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_text_before_reasoning_in_one_result_takes_the_index_after_it() -> None:
    """`anthropic_has_reasoning` is read after the result's diffs (server-task.cpp 1006)."""
    stream = MessageStream()
    events = stream.chunk(chunk({"content": "x"}, timings=False)) + stream.chunk(
        chunk({"reasoning_content": "r"})
    )
    assert events == [
        block_start(1, {"type": "text", "text": ""}),
        block_delta(1, {"type": "text_delta", "text": "x"}),
        block_start(0, {"type": "thinking", "thinking": ""}),
        block_delta(0, {"type": "thinking_delta", "thinking": "r"}),
    ]


def test_errors_and_the_end_marker() -> None:
    error = {"code": 500, "message": "boom", "type": "server_error"}
    assert MessageStream().chunk({"error": error}) == [("error", error)]
    observer = AnthropicObserver(TaskObserver(10, stream=True, oai=True))
    shown = observer.relay_chunk(
        b'data: {"error": {"code": 500, "message": "boom"}}\n\ndata: [DONE]\n\n:\n\n'
    )
    assert shown == b'event: error\ndata: {"code":500,"message":"boom"}\n\n:\n\n'


def block_start(index: int, block: dict) -> tuple[str, dict]:
    return (
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def block_delta(index: int, delta: dict) -> tuple[str, dict]:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def block_stop(index: int) -> tuple[str, dict]:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


def test_hidden_cache_signals_cover_the_anthropic_forms() -> None:
    answer = orjson.dumps(chat_answer({"role": "assistant", "content": "x"}, "stop"))
    observer = AnthropicObserver(TaskObserver(30, stream=False, oai=True), hide_cache_signals=True)
    usage = orjson.loads(observer.rewrite_body(200, answer))["usage"]
    assert usage == {"cache_read_input_tokens": 0, "input_tokens": 30, "output_tokens": 5}
    assert observer.chat.outcome().cache_n == 12  # the table still learns what happened

    observer = AnthropicObserver(TaskObserver(10, stream=True, oai=True), hide_cache_signals=True)
    first = chunk({"role": "assistant", "content": None})
    shown = observer.relay_chunk(b"data: " + orjson.dumps(first) + b"\n\n")
    data = orjson.loads(shown.split(b"data: ", 1)[1])
    assert data["message"]["usage"] == {
        "cache_read_input_tokens": 0,
        "input_tokens": 10,
        "output_tokens": 0,
    }


def test_a_stream_split_anywhere_renders_the_same() -> None:
    parts = [
        chunk({"role": "assistant", "content": None}, timings=False),
        chunk({"content": "Hé"}),
        chunk({"content": "llo"}, timings=False, __verbose={"stopping_word": "!"}),
        chunk({}, finish="stop"),
    ]
    raw = b"".join(b"data: " + orjson.dumps(part) + b"\n\n" for part in parts) + b"data: [DONE]\n\n"
    whole = AnthropicObserver(TaskObserver(10, stream=True, oai=True)).relay_chunk(raw)
    observer = AnthropicObserver(TaskObserver(10, stream=True, oai=True))
    split = b"".join(observer.relay_chunk(raw[i : i + 7]) for i in range(0, len(raw), 7))
    assert split + observer.finish() == whole
    assert b'"stop_sequence":"!"' in whole and b"[DONE]" not in whole
    assert observer.chat.outcome().ok


def test_the_proxys_late_error_after_half_an_event_drops_the_half() -> None:
    late = b'data: {"error":{"code":502,"message":"gone","type":"unavailable_error"}}\n\n'
    for hide in (False, True):
        observer = AnthropicObserver(TaskObserver(10, stream=True, oai=True), hide)
        assert observer.relay_chunk(b'data: {"choices":[{"fin') == b""
        assert observer.relay_chunk(late) == (
            b'event: error\ndata: {"code":502,"message":"gone","type":"unavailable_error"}\n\n'
        )
        assert not observer.chat.outcome().ok
    hiding = TaskObserver(10, stream=True, oai=True, hide_cache_signals=True)
    assert hiding.relay_chunk(b'data: {"choices":[{"fin') == b""
    assert hiding.relay_chunk(late) == late


def test_a_stream_without_timings_until_its_end_still_starts_with_message_start() -> None:
    """The embedded engine ignores timings_per_token: its stream is read as one result per
    chunk, and the client still gets every event llama-server would send."""
    stream = MessageStream()
    parts = [
        chunk({"role": "assistant", "content": None}, timings=False),
        chunk({"content": "He"}, timings=False),
        chunk({"content": "y"}, timings=False),
        chunk({}, finish="stop"),
    ]
    events = [event for part in parts for event in stream.chunk(part)]
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 3
