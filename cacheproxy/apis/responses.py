"""An OpenAI Responses request in the chat-completions form llama-server runs it as.

A faithful port of `server_chat_convert_responses_to_chatcmpl` (tools/server/server-chat.cpp,
lines 6-310 of the pinned tree; line numbers below are that file's). llama-server converts every
`/v1/responses` (and `/v1/responses/input_tokens`) body with it before the chat parser
(server-context.cpp 5343-5359), so the chat body built here, sent to `/apply-template`, gives
exactly the prompt the server will cache. The conversion starts from a copy of the whole body
(line 15): fields it does not know, `id_slot` and `cache_prompt` among them, reach the task.

Pure: no I/O. A body the server would refuse raises `ResponsesInputError`, with the status (400,
`invalid_request_error`) and message llama-server answers (server.cpp 55-91 turns the
converter's `std::invalid_argument` into that envelope). Dict insertion order follows the C++
(its JSON objects keep insertion order), so tool definitions render the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cacheproxy.errors import ApiError

Json = Any
Messages = list[dict[str, Json]]

# Body fields renamed on the way (295-298: max_output_tokens -> max_tokens); the value is
# copied as it is, whatever its type.
RENAMED_FIELDS: dict[str, str] = {"max_output_tokens": "max_tokens"}
# Body fields read from inside an object (300-307: only reasoning.effort is kept).
NESTED_FIELDS: dict[str, tuple[str, str]] = {"reasoning": ("effort", "reasoning_effort")}
# Roles of an input message (58-64); any other role needs an item type of its own.
INPUT_ROLES = frozenset({"user", "system", "developer"})


class ResponsesInputError(ApiError):
    """A Responses body llama-server refuses while converting it: 400 with its message."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, "invalid_request_error")


def responses_to_chat(body: dict[str, Json]) -> dict[str, Json]:
    """The chat-completions body llama-server makes of the Responses body `body` (6-310)."""
    if "input" not in body:
        raise ResponsesInputError("'input' is required")  # 7-9
    if _string_value(body, "previous_response_id"):
        raise ResponsesInputError("llama.cpp does not support 'previous_response_id'.")  # 10-12
    chat = dict(body)  # 15: a copy of everything, unknown fields included
    del chat["input"]
    messages: Messages = []
    if "instructions" in body:  # 19-26: a wrong type gives an empty system message
        messages.append({"role": "system", "content": _string_value(body, "instructions")})
        del chat["instructions"]
    source = body["input"]
    if isinstance(source, str):  # 28-32
        messages.append({"role": "user", "content": source})
    elif isinstance(source, list):  # 33-259
        for item in source:
            _convert_item(item, messages)
    else:
        raise ResponsesInputError("'input' must be a string or array of objects")  # 260-262
    chat["messages"] = messages
    if "tools" in body:
        _convert_tools(body["tools"], chat)
    for field, renamed in RENAMED_FIELDS.items():
        if field in body:
            del chat[field]
            chat[renamed] = body[field]
    for field, (inner, flattened) in NESTED_FIELDS.items():
        if field in body:
            value = body[field]
            if isinstance(value, dict) and inner in value:
                chat[flattened] = value[inner]
            del chat[field]
    return chat


# -- items of an input list -------------------------------------------------------------------


def _convert_item(item: Json, messages: Messages) -> None:
    """Append (or merge into the last assistant message) one input item (43-258)."""
    merge = bool(messages) and messages[-1].get("role") == "assistant"  # 44
    if isinstance(item, dict):
        item = dict(item)  # 43: each item is a copy
        if isinstance(item.get("content"), str):
            # 46-56: a string content becomes one input_text part, for every kind of item
            item["content"] = [{"text": item["content"], "type": "input_text"}]
    for matches, convert in ITEM_KINDS:
        if matches(item):
            convert(item, messages, merge)
            return
    raise ResponsesInputError("Cannot determine type of 'item'")  # 256-258


def _is_input_message(item: Json) -> bool:  # 58-64
    return _has_list(item, "content") and _has_string(item, "role") and item["role"] in INPUT_ROLES


def _input_message(item: dict, messages: Messages, merge: bool) -> None:  # 65-107
    item["content"] = [_input_part(part) for part in item["content"]]
    item.pop("type", None)
    item.pop("status", None)
    messages.append(item)


def _is_output_message(item: Json) -> bool:  # 108-112
    return (
        _has_string(item, "role")
        and item["role"] == "assistant"
        and _has_string(item, "type")
        and item["type"] == "message"
    )


def _output_message(item: dict, messages: Messages, merge: bool) -> None:  # 113-162
    content = item.get("content")
    parts: list[Json] = []
    if isinstance(content, str):  # 117-122 (unreachable: 46-56 made it a list)
        parts.append({"text": content, "type": "text"})
    elif isinstance(content, list):
        parts = [_output_part(part) for part in content]
    if merge:  # 150-156: appended to the assistant message before it
        previous = messages[-1]
        if not isinstance(previous.get("content"), list):
            previous["content"] = []
        previous["content"].extend(parts)
        return
    item.pop("status", None)
    item.pop("type", None)
    item["content"] = parts
    messages.append(item)


def _is_function_call(item: Json) -> bool:  # 163-168
    return (
        all(_has_string(item, key) for key in ("arguments", "call_id", "name", "type"))
        and item["type"] == "function_call"
    )


def _function_call(item: dict, messages: Messages, merge: bool) -> None:  # 169-190
    call = {
        "function": {"arguments": item["arguments"], "name": item["name"]},
        "id": item["call_id"],
        "type": "function",
    }
    if merge:  # 179-184: one more tool call of the assistant message before it
        previous = messages[-1]
        if not isinstance(previous.get("tool_calls"), list):
            previous["tool_calls"] = []
        previous["tool_calls"].append(call)
        return
    messages.append({"role": "assistant", "tool_calls": [call]})


def _is_function_call_output(item: Json) -> bool:  # 191-195
    return (
        _has_string(item, "call_id")
        and (_has_string(item, "output") or _has_list(item, "output"))
        and _has_string(item, "type")
        and item["type"] == "function_call_output"
    )


def _function_call_output(item: dict, messages: Messages, merge: bool) -> None:  # 196-230
    output = item["output"]
    if not isinstance(output, str):
        output = [_tool_output_part(part) for part in output]
    messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})


def _is_reasoning(item: Json) -> bool:  # 231-233
    return _has_list(item, "summary") and _has_string(item, "type") and item["type"] == "reasoning"


def _reasoning(item: dict, messages: Messages, merge: bool) -> None:  # 234-255
    content = item.get("content")
    if not isinstance(content, list):
        raise ResponsesInputError("item['content'] is not an array")
    if not content:
        raise ResponsesInputError("item['content'] is empty")
    if not _has_string(content[0], "text"):
        raise ResponsesInputError("item['content']['text'] is not a string")
    text = content[0]["text"]
    if merge:  # 246-248: the reasoning of the assistant message before it
        messages[-1]["reasoning_content"] = text
        return
    messages.append({"role": "assistant", "content": [], "reasoning_content": text})


ItemConverter = Callable[[dict, Messages, bool], None]
# Item kinds in the order llama-server tries them (the first that matches wins).
ITEM_KINDS: tuple[tuple[Callable[[Json], bool], ItemConverter], ...] = (
    (_is_input_message, _input_message),
    (_is_output_message, _output_message),
    (_is_function_call, _function_call),
    (_is_function_call_output, _function_call_output),
    (_is_reasoning, _reasoning),
)


# -- content parts ----------------------------------------------------------------------------


def _input_part(part: Json) -> dict[str, Json]:  # 68-96
    kind = _string_value(part, "type")
    if kind == "input_text":
        if "text" not in part:
            raise ResponsesInputError("'Input text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "input_image":  # `detail` may be left out
        if "image_url" not in part:
            raise ResponsesInputError("'image_url' is required")
        return {"image_url": {"url": part["image_url"]}, "type": "image_url"}
    if kind == "input_file":
        raise ResponsesInputError("'input_file' is not supported by llamacpp at this moment")
    raise ResponsesInputError("'type' must be one of 'input_text', 'input_image', or 'input_file'")


def _output_part(part: Json) -> dict[str, Json]:  # 125-147
    kind = _string_value(part, "type")
    if kind in ("output_text", "input_text"):
        if not _has_string(part, "text"):
            raise ResponsesInputError("'Output text' requires 'text'")
        return {"text": part["text"], "type": "text"}
    if kind == "refusal":
        if not _has_string(part, "refusal"):
            raise ResponsesInputError("'Refusal' requires 'refusal'")
        return {"refusal": part["refusal"], "type": "refusal"}
    raise ResponsesInputError("'type' must be one of 'output_text' or 'refusal'")


def _tool_output_part(part: Json) -> Json:  # 204-223: changed in place, other keys kept
    if not isinstance(part, dict) or "type" not in part:
        raise ResponsesInputError("Output of tool call missing 'type' field")
    kind = part["type"]
    if kind not in ("input_text", "input_image"):
        raise ResponsesInputError("Output of tool call should be 'Input text' or 'Input image'")
    part = dict(part)
    if kind == "input_text":
        part["type"] = "text"
        return part
    if "image_url" not in part:
        raise ResponsesInputError("'image_url' is required")
    part["type"] = "image_url"
    part["image_url"] = {"url": part["image_url"]}
    return part


# -- tools ------------------------------------------------------------------------------------


def _convert_tools(tools: Json, chat: dict[str, Json]) -> None:  # 266-293
    if not isinstance(tools, list):
        raise ResponsesInputError("'tools' must be an array of objects")
    converted = []
    for tool in tools:
        if _string_value(tool, "type") != "function":
            continue  # other tool types have no chat equivalent: skipped, as the server does
        function = {key: value for key, value in tool.items() if key != "type"}
        function.setdefault("strict", True)
        converted.append({"type": "function", "function": function})
    del chat["tools"]
    if converted:
        chat["tools"] = converted


# -- llama-server's JSON accessors ------------------------------------------------------------


def _string_value(document: Json, key: str) -> str:
    """`json_value(document, key, std::string())` (server-common.h 42-56): the string, or ""
    when absent, null, of another type, or when `document` is not an object."""
    if isinstance(document, dict):
        value = document.get(key)
        if isinstance(value, str):
            return value
    return ""


def _has_string(document: Json, key: str) -> bool:  # exists_and_is_string (39-41)
    return isinstance(document, dict) and isinstance(document.get(key), str)


def _has_list(document: Json, key: str) -> bool:  # exists_and_is_array (36-38)
    return isinstance(document, dict) and isinstance(document.get(key), list)
