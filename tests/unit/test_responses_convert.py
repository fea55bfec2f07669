"""The Responses -> chat conversion, case by case as llama-server's converter does it
(tools/server/server-chat.cpp 6-310 of the pinned tree); tests/integration/test_responses.py
checks the same port against the real server's token counts and errors."""

from __future__ import annotations

from typing import Any

import pytest

from cacheproxy.apis.responses import ResponsesInputError, responses_to_chat

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
TOOL_CALL = {"function": {"arguments": "{}", "name": "f"}, "id": "c1", "type": "function"}


def test_text_input_and_instructions_become_system_and_user_messages() -> None:
    chat = responses_to_chat(
        {"model": "m", "instructions": "Be terse.", "input": "Hi", "id_slot": 2, "stream": True}
    )
    assert chat == {
        "model": "m",
        "id_slot": 2,  # unknown fields reach the task: the slot can be pinned
        "stream": True,
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
        ],
    }


@pytest.mark.parametrize("instructions", [None, 5, ["a"]])
def test_instructions_of_another_type_give_an_empty_system_message(instructions: Any) -> None:
    chat = responses_to_chat({"instructions": instructions, "input": "Hi"})
    assert chat["messages"][0] == {"role": "system", "content": ""}


def test_fields_renamed_and_flattened_others_kept_in_place() -> None:
    body = {
        "input": "Hi",
        "max_output_tokens": 9,
        "temperature": 0,
        "reasoning": {"effort": "high", "summary": "auto"},
        "max_tokens": 3,
    }
    chat = responses_to_chat(body)
    # a key the body had keeps its place, a new one goes last (the server's objects keep order)
    assert list(chat) == ["temperature", "max_tokens", "messages", "reasoning_effort"]
    assert (chat["max_tokens"], chat["reasoning_effort"]) == (9, "high")
    assert "reasoning" not in responses_to_chat({"input": "Hi", "reasoning": {"summary": "x"}})
    assert body["max_output_tokens"] == 9  # the client's body is left as it was


def test_input_messages_get_chat_content_parts() -> None:
    item = {
        "type": "message",
        "role": "developer",
        "status": "completed",
        "name": "n",
        "content": [
            {"type": "input_text", "text": "a"},
            {"type": "input_image", "image_url": "http://x/y.png", "detail": "low"},
        ],
    }
    [message] = responses_to_chat({"input": [item]})["messages"]
    assert message == {
        "role": "developer",
        "name": "n",
        "content": [
            {"text": "a", "type": "text"},
            {"image_url": {"url": "http://x/y.png"}, "type": "image_url"},
        ],
    }
    assert list(message) == ["role", "name", "content"]
    string_content = responses_to_chat({"input": [{"role": "user", "content": "hi"}]})
    assert string_content["messages"] == [
        {"role": "user", "content": [{"text": "hi", "type": "text"}]}
    ]


def test_assistant_items_merge_into_the_assistant_message_before_them() -> None:
    items = [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "message", "role": "assistant", "content": "b"},  # made input_text, accepted
        CALL,
        {**CALL, "call_id": "c2"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "t", "extra": 1}],
        },
    ]
    messages = responses_to_chat({"input": items})["messages"]
    assert messages == [
        {"role": "user", "content": [{"text": "q", "type": "text"}]},
        {
            "role": "assistant",
            "content": [{"text": "a", "type": "text"}, {"text": "b", "type": "text"}],
            "tool_calls": [TOOL_CALL, {**TOOL_CALL, "id": "c2"}],
            "reasoning_content": "r",
        },
        {"content": "out", "role": "tool", "tool_call_id": "c1"},
        {
            "content": [{"type": "text", "text": "t", "extra": 1}],
            "role": "tool",
            "tool_call_id": "c2",
        },
    ]


def test_assistant_items_with_nothing_to_merge_into_start_a_message() -> None:
    reasoning = {"type": "reasoning", "summary": [], "content": [{"text": "r"}]}
    assert responses_to_chat({"input": [CALL]})["messages"] == [
        {"role": "assistant", "tool_calls": [TOOL_CALL]}
    ]
    assert responses_to_chat({"input": [reasoning]})["messages"] == [
        {"role": "assistant", "content": [], "reasoning_content": "r"}
    ]
    # a tool call then a message: the message's parts join the tool-call message
    merged = responses_to_chat(
        {
            "input": [
                CALL,
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "refusal", "refusal": "no"}],
                },
            ]
        }
    )
    assert merged["messages"] == [
        {
            "role": "assistant",
            "tool_calls": [TOOL_CALL],
            "content": [{"refusal": "no", "type": "refusal"}],
        }
    ]


def test_function_tools_are_flattened_others_skipped() -> None:
    tools = [
        {"type": "web_search"},
        {"type": "function", "name": "f", "parameters": {}},
        {"type": "function", "name": "g", "strict": False},
        "not an object",
    ]
    chat = responses_to_chat({"tools": tools, "input": "Hi", "temperature": 0})
    assert list(chat) == ["temperature", "messages", "tools"]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}},
        {"type": "function", "function": {"name": "g", "strict": False}},
    ]
    assert "tools" not in responses_to_chat({"tools": [{"type": "file_search"}], "input": "Hi"})


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"model": "m"}, "'input' is required"),
    (
        {"input": "x", "previous_response_id": "r"},
        "llama.cpp does not support 'previous_response_id'.",
    ),
    ({"input": 5}, "'input' must be a string or array of objects"),
    ({"input": None}, "'input' must be a string or array of objects"),
    ({"input": ["hi"]}, "Cannot determine type of 'item'"),
    ({"input": [{"role": "assistant", "content": "hi"}]}, "Cannot determine type of 'item'"),
    ({"input": [{**CALL, "arguments": {}}]}, "Cannot determine type of 'item'"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "'Input text' requires 'text'",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "'image_url' is required",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
        "'input_file' is not supported by llamacpp at this moment",
    ),
    (
        {"input": [{"role": "user", "content": ["x"]}]},
        "'type' must be one of 'input_text', 'input_image', or 'input_file'",
    ),
    (
        {"input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}]},
        "'Output text' requires 'text'",
    ),
    (
        {"input": [{"type": "message", "role": "assistant", "content": [{"type": "refusal"}]}]},
        "'Refusal' requires 'refusal'",
    ),
    (
        {"input": [{"type": "message", "role": "assistant", "content": [{"type": "x"}]}]},
        "'type' must be one of 'output_text' or 'refusal'",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": [{}]}]},
        "Output of tool call missing 'type' field",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": 1}]}]},
        "Output of tool call should be 'Input text' or 'Input image'",
    ),
    (
        {
            "input": [
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image"}],
                }
            ]
        },
        "'image_url' is required",
    ),
    ({"input": [{"type": "reasoning", "summary": []}]}, "item['content'] is not an array"),
    ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "item['content'] is empty"),
    (
        {"input": [{"type": "reasoning", "summary": [], "content": [{"text": 1}]}]},
        "item['content']['text'] is not a string",
    ),
    ({"input": "x", "tools": {}}, "'tools' must be an array of objects"),
]


@pytest.mark.parametrize(("body", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_refused_with_llama_servers_message(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ResponsesInputError) as refused:
        responses_to_chat(body)
    assert refused.value.envelope() == {
        "error": {"code": 400, "message": message, "type": "invalid_request_error"}
    }


@pytest.mark.parametrize("previous", ["", None, 7])
def test_an_empty_or_mistyped_previous_response_id_is_ignored(previous: Any) -> None:
    assert responses_to_chat({"input": "x", "previous_response_id": previous})["messages"]
