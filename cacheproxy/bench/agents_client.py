"""W5's clients: each turn of an agent sent through the real `anthropic` or `openai` SDK (async,
streamed), and what the server's usage said about it.

The two APIs carry the same conversation in their own shapes: the Messages API as a `system`
prompt, `tools`, and messages whose assistant turns end in a `tool_use` block answered by a
`tool_result` block; the Responses API as `instructions`, `tools`, and input items where each
answer is followed by a `function_call` and a `function_call_output`.

Usage, as llama-server writes it (tools/server/server-task.cpp of the pinned tree):
`/v1/messages` gives `input_tokens` = prompt tokens minus cached ones and
`cache_read_input_tokens` = the cached ones (`to_json_anthropic`, and `message_start` in the
stream); `/v1/responses` gives `input_tokens` = all prompt tokens and
`input_tokens_details.cached_tokens` (`to_json_oaicompat_resp`, `response.completed` in the
stream). Decoded = prompt tokens minus cached ones, on both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import anthropic
import openai

from cacheproxy.bench.agents_trace import Agent, tool_schemas
from cacheproxy.bench.harness import BenchmarkError

APIS = ("messages", "responses")
API_ROUTES = {"messages": "/v1/messages", "responses": "/v1/responses"}
MODEL = "bench"  # llama-server serves its one model whatever the name
REQUEST_TIMEOUT_S = 600.0
# The SDKs as an agent runs them: keep-alive connections and the SDK's default retries. Both
# matter: llama-server closes the connection after every streamed response although it announces
# keep-alive (see harness.STREAM_HEADERS), so a pooled connection can be gone when the next turn
# is written to it; the SDK then retries on a fresh one (the server never read the request).
MAX_RETRIES = 2
# Greedy sampling, so both arms see the same answers. Neither SDK has a `temperature` argument
# that both servers read the same way, so it goes in the body as is.
SAMPLING = {"temperature": 0}


@dataclass(frozen=True)
class TurnResult:
    """One request of one agent, with the server's own accounting."""

    agent: str
    turn: int
    answer: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    started_s: float  # since the arm started
    ttft_s: float
    total_s: float

    @property
    def decoded(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class ApiDriver(Protocol):
    api: str

    async def turn(self, agent: Agent, turn: int, answers: list[str]) -> TurnResult: ...

    async def close(self) -> None: ...


@dataclass
class Clock:
    """Times one request against the arm's start."""

    arm_started: float
    started: float = 0.0
    first_token: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def result(
        self, agent: Agent, turn: int, answer: str, prompt: int, cached: int, output: int
    ) -> TurnResult:
        finished = time.perf_counter()
        return TurnResult(
            agent=agent.name,
            turn=turn,
            answer=answer,
            prompt_tokens=prompt,
            cached_tokens=cached,
            output_tokens=output,
            started_s=self.started - self.arm_started,
            ttft_s=(self.first_token or finished) - self.started,
            total_s=finished - self.started,
        )


def check_turn(agent: Agent, turn: int, answers: list[str]) -> None:
    if not 0 <= turn < agent.turns or len(answers) != turn:
        raise ValueError(f"{agent.name}: turn {turn} with {len(answers)} answers")


# --- Anthropic Messages -----------------------------------------------------------------------


def messages_body(agent: Agent, turn: int, answers: list[str]) -> dict[str, Any]:
    """The keyword arguments of `messages.create` for turn `turn` (0-based)."""
    check_turn(agent, turn, answers)
    messages: list[dict[str, Any]] = [{"role": "user", "content": agent.task}]
    for answer, call in zip(answers, agent.tool_calls, strict=False):
        content: list[dict[str, Any]] = [{"type": "text", "text": answer}] if answer else []
        tool_use_id = f"toolu_{call.call_id}"
        content.append(
            {"type": "tool_use", "id": tool_use_id, "name": call.name, "input": call.arguments}
        )
        messages.append({"role": "assistant", "content": content})
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tool_use_id, "content": call.output}
                ],
            }
        )
    return {
        "system": agent.system,
        "messages": messages,
        "tools": [
            {"name": name, "description": description, "input_schema": schema}
            for name, description, schema in tool_schemas()
        ],
    }


class MessagesDriver:
    api = "messages"

    def __init__(self, base_url: str, max_tokens: int, arm_started: float) -> None:
        self._client = anthropic.AsyncAnthropic(
            base_url=base_url,
            api_key="bench",  # neither arm checks it (no tenants, no keys)
            max_retries=MAX_RETRIES,
            timeout=REQUEST_TIMEOUT_S,
        )
        self._max_tokens = max_tokens
        self._arm_started = arm_started

    async def turn(self, agent: Agent, turn: int, answers: list[str]) -> TurnResult:
        clock = Clock(self._arm_started)
        text: list[str] = []
        usage: dict[str, int] = {}
        clock.start()
        try:
            stream = await self._client.messages.create(
                model=MODEL,
                max_tokens=self._max_tokens,
                stream=True,
                extra_body=SAMPLING,
                **messages_body(agent, turn, answers),
            )
            async for event in stream:
                if event.type == "message_start":
                    usage["input"] = event.message.usage.input_tokens
                    usage["cached"] = event.message.usage.cache_read_input_tokens or 0
                elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                    clock.token()
                    text.append(event.delta.text)
                elif event.type == "message_delta":
                    usage["output"] = event.usage.output_tokens
        # The SDK's own errors, and its transport's (a connection lost mid-stream surfaces as
        # the HTTP library's error, which the SDK does not wrap): the run cannot go on either way.
        except Exception as exc:
            raise BenchmarkError(f"{agent.name} turn {turn} over /v1/messages: {exc!r}") from exc
        if {"input", "cached", "output"} - usage.keys():
            raise BenchmarkError(f"{agent.name} turn {turn}: the stream carried no usage")
        prompt = usage["input"] + usage["cached"]  # input_tokens excludes the cached ones
        return clock.result(agent, turn, "".join(text), prompt, usage["cached"], usage["output"])

    async def close(self) -> None:
        await self._client.close()


# --- OpenAI Responses -------------------------------------------------------------------------


def responses_body(agent: Agent, turn: int, answers: list[str]) -> dict[str, Any]:
    """The keyword arguments of `responses.create` for turn `turn` (0-based)."""
    check_turn(agent, turn, answers)
    items: list[dict[str, Any]] = [{"role": "user", "content": agent.task}]
    for answer, call in zip(answers, agent.tool_calls, strict=False):
        if answer:
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": answer}],
                }
            )
        call_id = f"call_{call.call_id}"
        items.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": call.name,
                "arguments": call.arguments_json,
            }
        )
        items.append({"type": "function_call_output", "call_id": call_id, "output": call.output})
    return {
        "instructions": agent.system,
        "input": items,
        "tools": [
            {"type": "function", "name": name, "description": description, "parameters": schema}
            for name, description, schema in tool_schemas()
        ],
    }


class ResponsesDriver:
    api = "responses"

    def __init__(self, base_url: str, max_tokens: int, arm_started: float) -> None:
        self._client = openai.AsyncOpenAI(
            base_url=base_url + "/v1",
            api_key="bench",
            max_retries=MAX_RETRIES,
            timeout=REQUEST_TIMEOUT_S,
        )
        self._max_tokens = max_tokens
        self._arm_started = arm_started

    async def turn(self, agent: Agent, turn: int, answers: list[str]) -> TurnResult:
        # The raw event stream, not `responses.stream()`: that helper rebuilds the response from
        # the events and llama-server's text deltas carry no `content_index` it could use.
        clock = Clock(self._arm_started)
        text: list[str] = []
        usage = None
        clock.start()
        try:
            stream = await self._client.responses.create(
                model=MODEL,
                max_output_tokens=self._max_tokens,
                stream=True,
                extra_body=SAMPLING,
                **responses_body(agent, turn, answers),
            )
            async for event in stream:
                if event.type == "response.output_text.delta":
                    clock.token()
                    text.append(event.delta)
                elif event.type == "response.completed":
                    usage = event.response.usage
        except Exception as exc:  # as above
            raise BenchmarkError(f"{agent.name} turn {turn} over /v1/responses: {exc!r}") from exc
        if usage is None:
            raise BenchmarkError(f"{agent.name} turn {turn}: the stream carried no usage")
        cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
        return clock.result(
            agent, turn, "".join(text), usage.input_tokens, cached or 0, usage.output_tokens
        )

    async def close(self) -> None:
        await self._client.close()


DRIVERS: dict[str, type[MessagesDriver] | type[ResponsesDriver]] = {
    "messages": MessagesDriver,
    "responses": ResponsesDriver,
}


def driver_for(api: str, base_url: str, max_tokens: int, arm_started: float) -> ApiDriver:
    return DRIVERS[api](base_url, max_tokens, arm_started)
