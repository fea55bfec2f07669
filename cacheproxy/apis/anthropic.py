"""Anthropic Messages requests in the chat form llama-server itself converts them to.

A faithful port of `server_chat_convert_anthropic_to_oai` (tools/server/server-chat.cpp 348-619
in the pinned tree): llama-server's /v1/messages handler (server-context.cpp 5393-5409) builds a
new chat body with it and runs that exactly as /v1/chat/completions runs its own body. The proxy
builds the same body, so the chat request it pins to a slot is the one the server would have run.

Its quirks are kept on purpose, since the prompt (hence the cached tokens) depends on them: only
the fields below are carried over (a client's `id_slot` or `cache_prompt` is dropped, as the
server drops it); a field of the wrong type reads as its default, as `json_value` reads it
(server-common.h 43-55); the billing header's `cch=` stamp is blanked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cacheproxy.errors import ApiError

BILLING_HEADER = b"x-anthropic-billing-header:"
CCH_LENGTH = 5
DEFAULT_MAX_TOKENS = 4096  # "required in Anthropic, but we're permissive" (server-chat.cpp 585-590)
DEFAULT_THINKING_BUDGET = 10000
INT32 = 1 << 32
OMIT = object()  # a rule's answer when the chat body gets no field


# -- json_value, as llama-server reads a field: absent, null or of another type is the default --


def _value(document: Any, key: str, default: Any) -> Any:
    if isinstance(document, dict) and document.get(key) is not None:
        return document[key]
    return default


def _string(document: Any, key: str, default: str = "") -> str:
    value = _value(document, key, default)
    return value if isinstance(value, str) else default


def _object(document: Any, key: str) -> Any:
    """`json_value(x, key, json::object())`: any JSON value but null."""
    return _value(document, key, {})


def _int(document: Any, key: str, default: int) -> int:
    """`get<int>()`: nlohmann converts any number (or a boolean) with a C cast to int32."""
    value = _value(document, key, default)
    if isinstance(value, bool | int):
        number = int(value)
    elif isinstance(value, float):
        if not -(2**31) <= value < 2**31:
            return -(2**31)  # what x86's truncating conversion gives for a double out of range
        number = int(value)
    else:
        return default
    number %= INT32
    return number - INT32 if number >= 1 << 31 else number


def _dump(value: Any) -> str:
    """nlohmann's `dump()`: compact, UTF-8 as is, keys in the order they came."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# -- the system prompt (server-chat.cpp 312-374) ------------------------------------------------


def normalize_billing_header(text: str) -> str:
    """Blank the `cch=` stamp of a Claude Code billing header: it changes on every request and
    would stop prefix reuse right there (server-chat.cpp 312-346, bytes as C++ sees them)."""
    data = text.encode()
    if not data.startswith(BILLING_HEADER):
        return text
    index = data.find(b"cch=", len(BILLING_HEADER))
    if index < 0:
        return text
    start = index + len(b"cch=")
    end = start + CCH_LENGTH
    if end < len(data) and data[end : end + 1] == b";":
        return (data[:start] + b"f" * CCH_LENGTH + data[end:]).decode(errors="replace")
    return text  # the server logs "anthropic string not as expected" and leaves it


def _system_message(system: Any) -> dict | None:
    if system is None:
        return None
    content = ""
    if isinstance(system, str):
        content = normalize_billing_header(system)
    elif isinstance(system, list):
        for block in system:
            if _string(block, "type") == "text":
                content += normalize_billing_header(_string(block, "text"))
    return {"role": "system", "content": content}  # any other type: an empty system message


# -- content blocks (server-chat.cpp 376-544) ---------------------------------------------------


def _image_part(source: Any) -> dict | None:
    source_type = _string(source, "type")
    if source_type == "base64":
        media_type = _string(source, "media_type", "image/jpeg")
        url = f"data:{media_type};base64,{_string(source, 'data')}"
    elif source_type == "url":
        url = _string(source, "url")
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call(block: Any) -> dict:
    return {
        "id": _string(block, "id"),
        "type": "function",
        "function": {"name": _string(block, "name"), "arguments": _dump(_object(block, "input"))},
    }


def _tool_message(block: Any) -> dict:
    tool_use_id = _string(block, "tool_use_id")
    result = _value(block, "content", None)
    if isinstance(result, str):
        content: Any = result
    elif isinstance(result, list):
        text = ""
        parts: list[dict] = []
        has_images = False
        for item in result:
            item_type = _string(item, "type")
            if item_type == "text":
                text += _string(item, "text")
                parts.append({"type": "text", "text": _string(item, "text")})
            elif item_type == "image":
                has_images = True
                part = _image_part(_object(item, "source"))
                if part is not None:
                    parts.append(part)
        # text only: collapsed to one string; with images, OpenAI's multimodal tool form
        content = parts if has_images else text
    else:
        content = ""
    return {"role": "tool", "tool_call_id": tool_use_id, "content": content}


def _converted_messages(message: Any) -> list[Any]:
    """One Anthropic message as the chat messages it becomes: itself, or its blocks taken apart
    into a message (text and images, tool calls, reasoning) followed by one per tool result."""
    role = _string(message, "role")
    if not isinstance(message, dict) or "content" not in message:
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]
    parts: list[Any] = []
    tool_calls: list[dict] = []
    tool_results: list[dict] = []
    reasoning = ""
    for block in content:
        block_type = _string(block, "type")
        if block_type == "text":
            parts.append(block)  # verbatim, with whatever else the block carries
        elif block_type == "thinking":
            reasoning += _string(block, "thinking")
        elif block_type == "image":
            part = _image_part(_object(block, "source"))
            if part is not None:
                parts.append(part)
        elif block_type == "tool_use":
            tool_calls.append(_tool_call(block))
        elif block_type == "tool_result":
            tool_results.append(_tool_message(block))
    converted: list[Any] = []
    if parts or tool_calls or reasoning:
        chat_message: dict[str, Any] = {"role": role, "content": parts or ""}
        if tool_calls:
            chat_message["tool_calls"] = tool_calls
        if reasoning:
            chat_message["reasoning_content"] = reasoning
        converted.append(chat_message)
    return converted + tool_results


# -- the other fields: one rule each (server-chat.cpp 548-616) ----------------------------------


def _tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        return OMIT
    return [
        {
            "type": "function",
            "function": {
                "name": _string(tool, "name"),
                "description": _string(tool, "description"),
                "parameters": tool["input_schema"]
                if isinstance(tool, dict) and "input_schema" in tool
                else {},
            },
        }
        for tool in tools
    ]


TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "required"}  # "none": no field


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return OMIT
    return TOOL_CHOICES.get(_string(choice, "type"), OMIT)


def _thinking_budget(thinking: Any) -> Any:
    thinking = thinking if thinking is not None else {}
    if _string(thinking, "type") != "enabled":
        return OMIT
    return _int(thinking, "budget_tokens", DEFAULT_THINKING_BUDGET)


def _metadata_user_id(metadata: Any) -> Any:
    return _string(metadata if metadata is not None else {}, "user_id") or OMIT


def _verbatim(value: Any) -> Any:
    return value


# (Anthropic field, chat field, rule, what the chat body gets when the field is absent), in the
# order the server writes them. A field present but null is present (`contains`).
FIELD_MAPPINGS: tuple[tuple[str, str, Callable[[Any], Any], Any], ...] = (
    ("tools", "tools", _tools, OMIT),
    ("tool_choice", "tool_choice", _tool_choice, OMIT),
    ("stop_sequences", "stop", _verbatim, OMIT),
    ("max_tokens", "max_tokens", _verbatim, DEFAULT_MAX_TOKENS),
    ("temperature", "temperature", _verbatim, OMIT),
    ("top_p", "top_p", _verbatim, OMIT),
    ("top_k", "top_k", _verbatim, OMIT),
    ("stream", "stream", _verbatim, OMIT),
    ("chat_template_kwargs", "chat_template_kwargs", _verbatim, OMIT),
    ("thinking", "thinking_budget_tokens", _thinking_budget, OMIT),
    ("metadata", "__metadata_user_id", _metadata_user_id, OMIT),
)


def chat_request(body: dict) -> dict:
    """The chat body llama-server runs for this /v1/messages body.

    Raises ApiError as the server refuses it: a body without `messages` is a plain
    std::runtime_error there, hence a 500 server_error (server.cpp 55-91).
    """
    messages: list[Any] = []
    system = _system_message(body.get("system"))
    if system is not None:
        messages.append(system)
    if "messages" not in body:
        raise ApiError(500, "'messages' is required")
    if isinstance(body["messages"], list):
        for message in body["messages"]:
            messages += _converted_messages(message)
    chat: dict[str, Any] = {"messages": messages}
    for source, target, rule, default in FIELD_MAPPINGS:
        value = rule(body[source]) if source in body else default
        if value is not OMIT:
            chat[target] = value
    return chat
