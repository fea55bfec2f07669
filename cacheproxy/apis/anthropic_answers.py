"""llama-server's /v1/chat/completions answers as it would have answered them on /v1/messages.

The task behind both routes is the same (server-context.cpp 5286-5300 and 5393-5409); only the
result's `to_json` differs. The Anthropic forms are rebuilt here from the chat forms, field for
field and event for event, as tools/server/server-task.cpp writes them (line numbers in the pinned
tree):

- a whole answer: `to_json_anthropic` (731-795) from `to_json_oaicompat_chat` (414-460);
- a stream: every partial result's `to_json_anthropic` (1324-1461) from its chat chunks
  (`to_json_oaicompat_chat`, 1111-1164), and the final result's `to_json_anthropic_stream`
  (797-983) from its own (`to_json_oaicompat_chat_stream`, 462-527); each event written by
  `format_anthropic_sse` (server-common.cpp 1722-1743), no `[DONE]` (server-context.cpp
  4797-4811), and a late error as `event: error` with the bare error object (4766-4776).

The chat request carries what this needs and the Anthropic route has anyway: `verbose` (the
final result's `stopping_word`, for `stop_sequence`) and, for a stream, `timings_per_token`
(each partial result's cached and decoded prompt counts, for `message_start`'s usage), so the
chunks of one result are told apart: every result's last chunk carries `timings`, the final
result's last one a `finish_reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from cacheproxy.apis.anthropic import chat_request
from cacheproxy.apis.observe import LATE_ERROR, UNCACHED, ShownReuse, TaskObserver, as_shown

# the chat request fields rendering needs, added to the converted request
RENDERING_FIELDS = {"verbose": True}
STREAM_RENDERING_FIELDS = {"verbose": True, "timings_per_token": True}

# finish_reason -> stop_reason: both are "length"/"max_tokens" unless the task stopped on a
# word or end of generation, then "stop"/"end_turn", or with tool calls "tool_calls"/"tool_use"
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use"}
MAX_TOKENS = "max_tokens"

Event = tuple[str, dict[str, Any]]


def chat_request_to_render(body: dict) -> dict:
    """The chat request for a /v1/messages body, with what rendering its answer needs."""
    chat = chat_request(body)
    return {**chat, **(STREAM_RENDERING_FIELDS if chat.get("stream") is True else RENDERING_FIELDS)}


def _stop_reason(finish_reason: Any) -> str:
    return STOP_REASONS.get(finish_reason, MAX_TOKENS)


def _stop_sequence(verbose: Any) -> str | None:
    word = verbose.get("stopping_word") if isinstance(verbose, dict) else None
    return word or None


def _tool_input(arguments: Any) -> Any:
    """The tool call's arguments parsed, or {} where the server's json::parse throws."""
    try:
        return orjson.loads(arguments)
    except (orjson.JSONDecodeError, TypeError):
        return {}


def message_from_chat(answer: dict) -> dict:
    """The /v1/messages answer for a /v1/chat/completions answer (`verbose` on)."""
    choice = answer["choices"][0]
    message = choice["message"]
    blocks: list[dict] = []
    if message.get("reasoning_content"):
        # no signature can be made for a local model: an empty one (server-task.cpp 748-754)
        blocks.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if isinstance(message.get("content"), str) and message["content"]:
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": call["function"]["name"],
                "input": _tool_input(call["function"]["arguments"]),
            }
        )
    usage = answer["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "id": answer["id"],
        "type": "message",
        "role": "assistant",
        "content": blocks,
        "model": answer["model"],
        "stop_reason": _stop_reason(choice["finish_reason"]),
        "stop_sequence": _stop_sequence(answer.get("__verbose")),
        "usage": {
            "cache_read_input_tokens": cached,
            "input_tokens": usage["prompt_tokens"] - cached,
            "output_tokens": usage["completion_tokens"],
        },
    }


# -- streams --------------------------------------------------------------------------------


@dataclass
class _Diff:
    """One `common_chat_msg_diff`, read back from the chat delta it was written as
    (`server_chat_msg_diff_to_json_oaicompat`, server-chat.cpp 621-649)."""

    reasoning: str = ""
    content: str = ""
    tool_index: int | None = None
    tool_id: str = ""
    tool_name: str = ""
    tool_arguments: str = ""

    @classmethod
    def of(cls, delta: dict) -> _Diff:
        diff = cls(delta.get("reasoning_content") or "", delta.get("content") or "")
        calls = delta.get("tool_calls")
        if calls:
            call = calls[0]
            function = call.get("function") or {}
            diff.tool_index = call["index"]
            diff.tool_id = call.get("id", "")
            diff.tool_name = function.get("name", "")
            diff.tool_arguments = function.get("arguments", "")
        return diff


def _block_start(index: int, block: dict) -> Event:
    return (
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def _block_delta(index: int, delta: dict) -> Event:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _block_stop(index: int) -> Event:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


@dataclass
class _OpenBlocks:
    """Whether the thinking and the text content blocks have been started (their
    `content_block_start` sent), as both of llama-server's stream formatters track it."""

    thinking: bool = False
    text: bool = False

    def thinking_and_text(self, diff: _Diff, text_index: int) -> list[Event]:
        """The events of one diff's reasoning and content: each block started once, then its
        deltas (the thinking block is always index 0)."""
        events: list[Event] = []
        if diff.reasoning:
            if not self.thinking:
                events.append(_block_start(0, {"type": "thinking", "thinking": ""}))
                self.thinking = True
            events.append(_block_delta(0, {"type": "thinking_delta", "thinking": diff.reasoning}))
        if diff.content:
            if not self.text:
                events.append(_block_start(text_index, {"type": "text", "text": ""}))
                self.text = True
            events.append(_block_delta(text_index, {"type": "text_delta", "text": diff.content}))
        return events


@dataclass
class MessageStream:
    """Turns a chat stream's chunks into the /v1/messages events of the same task."""

    # what the server's task_result_state knows after each partial result (server-task.cpp
    # 988-1024): whether a thinking or text block was started, and the message so far
    thinking_started: bool = False
    text_started: bool = False
    reasoning: str = ""
    content: str = ""
    tool_calls: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (id, name)
    _result: list[dict] = field(default_factory=list)  # the chunks of the result being read

    def chunk(self, chunk: dict) -> list[Event]:
        """The events for a chat chunk: none until its result's last chunk has come."""
        if "error" in chunk:
            return [("error", chunk["error"])]
        if not chunk.get("choices"):
            return []  # a usage chunk: never asked for
        self._result.append(chunk)
        if "timings" not in chunk:
            return []
        result, self._result = self._result, []
        if result[-1]["choices"][0].get("finish_reason") is None:
            return self._partial(result)
        if any("role" in part["choices"][0]["delta"] for part in result):
            # never from llama-server (its first result ends with timings): a server that
            # ignores timings_per_token, as the embedded engine does. Each chunk is taken as a
            # result of its own, with the prompt counts known at the end.
            timings = result[-1]["timings"]
            events = [
                event
                for part in result[:-1]
                for event in self._partial([{**part, "timings": timings}])
            ]
            return events + self._final(result[-1:])
        return self._final(result)

    def _note(self, diffs: list[_Diff]) -> None:
        for diff in diffs:
            self.reasoning += diff.reasoning
            self.content += diff.content
            if diff.tool_index is not None and (diff.tool_id or diff.tool_name):
                self.tool_calls[diff.tool_index] = (diff.tool_id, diff.tool_name)

    def _partial(self, result: list[dict]) -> list[Event]:
        """`server_task_result_cmpl_partial::to_json_anthropic` (server-task.cpp 1324-1461)."""
        deltas = [chunk["choices"][0]["delta"] for chunk in result]
        first = any("role" in delta for delta in deltas)  # n_decoded == 1: the chat role delta
        diffs = [_Diff.of(delta) for delta in deltas if "role" not in delta]
        events: list[Event] = []
        if first:
            timings = result[-1]["timings"]
            events.append(
                (
                    "message_start",
                    {
                        "type": "message_start",
                        "message": {
                            "id": result[0]["id"],
                            "type": "message",
                            "role": "assistant",
                            "content": [],
                            "model": result[0]["model"],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": {
                                "cache_read_input_tokens": timings["cache_n"],
                                "input_tokens": timings["prompt_n"],
                                "output_tokens": 0,
                            },
                        },
                    },
                )
            )
        # the state before this result, and whether the message has reasoning after it
        opened = _OpenBlocks(self.thinking_started, self.text_started)
        self._note(diffs)
        has_reasoning = bool(self.reasoning)
        text_index = 1 if has_reasoning else 0
        for diff in diffs:
            events += opened.thinking_and_text(diff, text_index)
            if diff.tool_index is not None:
                index = int(has_reasoning) + int(opened.text) + diff.tool_index
                if diff.tool_name:
                    events.append(
                        _block_start(
                            index, {"type": "tool_use", "id": diff.tool_id, "name": diff.tool_name}
                        )
                    )
                if diff.tool_arguments:
                    events.append(
                        _block_delta(
                            index, {"type": "input_json_delta", "partial_json": diff.tool_arguments}
                        )
                    )
        self.thinking_started, self.text_started = opened.thinking, opened.text
        return events

    def _final(self, result: list[dict]) -> list[Event]:
        """`server_task_result_cmpl_final::to_json_anthropic_stream` (server-task.cpp 797-983):
        its block flags start afresh, and its indices follow the whole message."""
        finish = result[-1]
        verbose = next((chunk["__verbose"] for chunk in result if "__verbose" in chunk), None)
        diffs = [_Diff.of(chunk["choices"][0]["delta"]) for chunk in result[:-1]]
        self._note(diffs)
        has_thinking, has_text = bool(self.reasoning), bool(self.content)
        text_index = 1 if has_thinking else 0
        opened = _OpenBlocks()
        tools_started: set[int] = set()
        events: list[Event] = []
        for diff in diffs:
            events += opened.thinking_and_text(diff, text_index)
            if diff.tool_index is not None:
                index = int(has_thinking) + int(has_text) + diff.tool_index
                if diff.tool_index not in tools_started:
                    tool_id, name = self.tool_calls.get(diff.tool_index, ("", ""))
                    events.append(
                        _block_start(index, {"type": "tool_use", "id": tool_id, "name": name})
                    )
                    tools_started.add(diff.tool_index)
                if diff.tool_arguments:
                    events.append(
                        _block_delta(
                            index, {"type": "input_json_delta", "partial_json": diff.tool_arguments}
                        )
                    )
        if has_thinking:
            # Anthropic's API wants a signature before a thinking block closes: an empty one
            events.append(_block_delta(0, {"type": "signature_delta", "signature": ""}))
            events.append(_block_stop(0))
        if has_text:
            events.append(_block_stop(text_index))
        for tool_index in range(len(self.tool_calls)):
            events.append(_block_stop(int(has_thinking) + int(has_text) + tool_index))
        stop = {
            "stop_reason": _stop_reason(finish["choices"][0]["finish_reason"]),
            "stop_sequence": _stop_sequence(verbose),
        }
        usage = {"output_tokens": finish["timings"]["predicted_n"]}
        events.append(("message_delta", {"type": "message_delta", "delta": stop, "usage": usage}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def sse_event(name: str, data: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class AnthropicObserver:
    """The chat answer to a converted /v1/messages request, shown as /v1/messages would show it.

    The chat observer reads the task's outcome for the table, as on the chat route; what the
    client sees is rendered here (and made to look uncached for a tenant who hides that, or
    shown as it would be without chunks: `shown`, see `ShownReuse`).
    """

    def __init__(
        self, chat: TaskObserver, hide_cache_signals: bool = False, shown: ShownReuse | None = None
    ) -> None:
        self.chat = chat
        self.shown = UNCACHED if hide_cache_signals else shown
        self.stream = MessageStream()
        self._pending = b""

    def _shown(self, document: Any) -> Any:
        return document if self.shown is None else as_shown(document, self.shown)

    def rewrite_body(self, status: int, payload: bytes) -> bytes:
        if status != 200:
            return payload  # an error: the same envelope on both routes
        try:
            answer = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return payload
        if not isinstance(answer, dict) or "choices" not in answer:
            return payload
        self.chat.read_answer(answer)
        return orjson.dumps(self._shown(message_from_chat(answer)))

    def relay_chunk(self, chunk: bytes) -> bytes:
        self.chat.relay_chunk(chunk)  # read on the side; its own output is not shown
        if chunk.startswith(LATE_ERROR):
            self._pending = b""  # after a broken-off event: its half is dropped
        self._pending += chunk
        *events, self._pending = self._pending.split(b"\n\n")
        return b"".join(self._render(event) for event in events)

    def finish(self) -> bytes:
        self.chat.finish()
        rest, self._pending = self._pending, b""
        return self._render(rest) if rest.strip() else b""

    def _render(self, event: bytes) -> bytes:
        data = next((line[6:] for line in event.split(b"\n") if line.startswith(b"data: ")), None)
        if data is None:
            return event + b"\n\n"  # a ping (`:`): sent on both routes alike
        if data == b"[DONE]":
            return b""  # the Anthropic route sends no end marker
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(chunk, dict):
            return event + b"\n\n"
        return b"".join(
            sse_event(name, self._shown(payload)) for name, payload in self.stream.chunk(chunk)
        )
