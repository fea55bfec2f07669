"""Read what llama-server reports about a task from its answer, without changing the answer.

The proxy may add `return_tokens` (native routes) or `verbose` (OAI routes, whose answers carry
`tokens_cached` and the generated ids only inside `__verbose`) to learn what the slot now holds;
whatever it added is taken out again, so the client gets the answer it would have had. A server
started with `--verbose` sends `__verbose` to every request that does not say `verbose: false`
(tools/server/server-schema.cpp: `params.verbose = params_base.verbosity > 9`, then the request's
field): what the server sends by its own default is the client's, never taken out. That default
shows in no route, so it is learnt from the first such answer (sent without `verbose`).
Streams pass through untouched, read on the side, unless the tenant's cache signals are hidden,
or its prompt was computed in chunks: then each answer and each event (as soon as it is
complete) is rewritten as an uncached run, or a run without the chunks, would have shown it.
The completion id an OpenAI-shaped answer carries is read as it passes (`on_completion_id`): a
tenant's requests on the routes that act on a completion by its id reach only its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import orjson

from cacheproxy.apis.response_fields import projected
from cacheproxy.apis.task_totals import of_timings, summed
from cacheproxy.upstreams.slot_table import UNANSWERED, TaskOutcome

# Prompt timings: how long the prompt took tells how much of it came from a cache, and an
# uncached run's timing cannot be made up, so they are left out (llama-server's `timings`,
# tools/server/server-common.cpp `result_timings::to_json`; `time_ms` of `prompt_progress`).
PROMPT_TIMINGS = frozenset({"prompt_ms", "prompt_per_token_ms", "prompt_per_second"})
# how a late error starts (llama-server's, or the proxy's own when an upstream breaks off a
# stream, which may come after half an event: that half is dropped)
LATE_ERROR = b'data: {"error"'
# the generated ids of a native partial event, as llama-server writes them
TOKEN_IDS = re.compile(rb'"tokens":\[([0-9,]*)\]')
# the completion id of an OAI answer or event (tools/server/server-common.cpp gen_chatcmplid)
COMPLETION_ID = re.compile(rb'"id":"(chatcmpl-[0-9A-Za-z]+)"')
# an OAI stream chunk carrying generated text (a chat delta's, or `/v1/completions`' `text`) or a
# tool call, as `oai_delta_count` reads them (a quote inside generated text is escaped, so text
# never matches)
OAI_TOKEN_DELTA = re.compile(rb'"(?:content|reasoning_content|text)":"[^"]|"tool_calls":\[\{')
DIGEST_BYTES = 64 << 10  # stream bytes held before they are read


@dataclass(frozen=True)
class ShownReuse:
    """How an answer's cache signals are shown: as llama-server would have reported them had it
    reused no more than `reused` tokens of the prompt. `prompt_ms`: the prompt's computing time
    that came before the request (a chunked prompt's chunks), added to its prompt timings; None:
    prompt timings left out (a tenant hiding its cache signals: an uncached run's time cannot
    be made up)."""

    reused: int
    prompt_ms: float | None


UNCACHED = ShownReuse(0, None)  # a tenant hiding its cache signals: an uncached run


def as_uncached(document: Any) -> Any:
    """`document` as llama-server would have answered it had nothing come from a cache."""
    return as_shown(document, UNCACHED)


def as_shown(document: Any, shown: ShownReuse) -> Any:
    """`document` as llama-server would have answered it had it reused no more than
    `shown.reused` tokens (see `ShownReuse`).

    Fields by route, as tools/server/server-task.cpp builds them (line numbers in the pinned tree):
    - `timings` {cache_n, prompt_n, prompt_*} on native (357, 1062), OAI completion and chat
      (408, 456, 517, 1102, 1156) and Responses (710, 1306) answers and events, and in
      `__verbose` (405, 453, 522, 1099): cache_n at most the reuse shown, prompt_n the rest of
      the prompt, prompt timings out (or with the time computed before added).
    - `usage.prompt_tokens_details.cached_tokens` on OAI routes (370) and
      `usage.input_tokens_details.cached_tokens` on Responses (592, 703): the reuse shown.
    - Anthropic `usage` {input_tokens = uncached part, cache_read_input_tokens} in the answer
      (787-789) and in the `message_start` event (1343-1345): input_tokens the rest of the
      prompt, cache_read_input_tokens the reuse shown (and cache_creation_input_tokens no more).
    - `prompt_progress` {total, cache, processed, time_ms} (242-249; filled at
      server-context.cpp:2187-2190): cache the reuse shown, time_ms out when prompt timings are
      (processed counts cached tokens too). How many progress events a prompt gets still
      depends on how much of it was decoded.
    `tokens_cached`, `tokens_evaluated`, `prompt_tokens` and `total_tokens` are the same either
    way (the slot's length and the prompt's), so they stay.
    """
    if isinstance(document, list):
        return [as_shown(item, shown) for item in document]
    if not isinstance(document, dict):
        return document
    timed = shown.prompt_ms is not None
    out = {
        key: as_shown(value, shown)
        for key, value in document.items()
        if timed or key not in PROMPT_TIMINGS
    }
    cached = _count(out, "cache_n")
    if cached is not None and _count(out, "prompt_n") is not None:
        out["cache_n"] = min(cached, shown.reused)
        out["prompt_n"] += cached - out["cache_n"]
        if timed:
            _add_prompt_time(out, shown.prompt_ms or 0.0)
    cached = _count(out, "cache_read_input_tokens")
    if cached is not None:
        out["cache_read_input_tokens"] = min(cached, shown.reused)
        if _count(out, "input_tokens") is not None:
            out["input_tokens"] += cached - out["cache_read_input_tokens"]
    for key in ("cache_creation_input_tokens", "cached_tokens", "n_prompt_tokens_cache"):
        if (count := _count(out, key)) is not None:
            out[key] = min(count, shown.reused)
    if {"total", "cache"} <= out.keys():  # a prompt_progress object
        if (count := _count(out, "cache")) is not None:
            out["cache"] = min(count, shown.reused)  # `processed` counts cached tokens too
        if not timed:
            out.pop("time_ms", None)
    return out


def _add_prompt_time(timings: dict, earlier_ms: float) -> None:
    """Prompt timings with the time the prompt was computed before the request added: its
    chunks' (the rates then are the whole prompt's)."""
    prompt_ms = timings.get("prompt_ms")
    if not isinstance(prompt_ms, int | float) or isinstance(prompt_ms, bool):
        return
    prompt_ms += earlier_ms
    timings["prompt_ms"] = prompt_ms
    prompt_n = timings["prompt_n"]
    if "prompt_per_token_ms" in timings and prompt_n:
        timings["prompt_per_token_ms"] = prompt_ms / prompt_n
    if "prompt_per_second" in timings and prompt_ms > 0:
        timings["prompt_per_second"] = 1000.0 * prompt_n / prompt_ms


def _count(document: dict, key: str) -> int | None:
    value = document.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class TaskObserver:
    # whether adding `return_tokens`/`verbose` brings the generated ids and `tokens_cached`
    # into the answer (not in every route's shape: see cacheproxy/apis)
    asks_for_ids: ClassVar[bool] = True
    # whether the answer shows the completion id a control request names (OpenAI shapes)
    shows_completion_id: ClassVar[bool] = True
    # an OAI stream's event carrying a generated token, found without a parse, and counted in
    # a parsed one: what a stream cut before its end is charged as generated
    token_delta: ClassVar[re.Pattern[bytes]] = OAI_TOKEN_DELTA

    @staticmethod
    def delta_count(event: dict) -> int:
        return oai_delta_count(event)

    def __init__(
        self,
        prompt_length: int,
        stream: bool,
        oai: bool,
        added: frozenset[str] = frozenset(),
        ids_in_answer: bool = False,
        hide_cache_signals: bool = False,
        learn_verbose_default: Callable[[bool], None] | None = None,
        shown: ShownReuse | None = None,
        fields: tuple[str, ...] | None = None,
    ) -> None:
        self.prompt_length = prompt_length
        self.stream = stream
        self.oai = oai
        self.added = added  # request fields the proxy added and must hide again
        self.ids_in_answer = ids_in_answer  # return_tokens was set: the answer lists generated ids
        # how the answer's cache signals are shown (None: as the server sent them)
        self.shown = UNCACHED if hide_cache_signals else shown
        # called with whether the server sent `__verbose` unasked (its default is not known yet)
        self.learn_verbose_default = learn_verbose_default
        # the client's `response_fields`, taken off the request: the final answer is projected
        # here, as llama-server would have (None: the answer is the server's as it is)
        self.fields = fields
        self._rewrites = self.shown is not None or fields is not None
        self._outcome = UNANSWERED
        self._pending = b""
        self._chunks: list[bytes] = []  # passed on, not yet read (see `_digest`)
        self._held = 0
        self._slow = False  # read every event from now on
        self._generated: list[int] = []
        self._timings: dict[str, Any] | None = None
        # each task's final timings, by its index: a stream of several (a whole upstream's)
        self._task_timings: dict[object, dict[str, Any]] = {}
        self._tokens_cached: int | None = None
        self._slot_id: int | None = None  # a native stream's final event names its slot
        self._truncated = False  # ... and whether the generation reached the context
        self._failed = False
        self._token_events = 0  # OAI stream chunks carrying a generated token's delta
        # called once, at the stream's first event: the prompt has been computed
        self.on_first_event: Callable[[], None] | None = None
        # called once with the answer's completion id, as soon as it passes (OAI shapes)
        self.on_completion_id: Callable[[str], None] | None = None
        self.delivered = False  # the whole request went out: the server has it (`sent`)

    def sent(self) -> None:
        """The whole request was handed to the upstream (upstreams/relay.py `forward`): cut
        from now on, the task is charged what the server computed."""
        self.delivered = True

    def outcome(self) -> TaskOutcome:
        if self.stream:
            if self._chunks:
                self._digest()
            return self._stream_outcome()
        return self._outcome

    # -- a whole JSON answer ---------------------------------------------------------------

    def rewrite_body(self, status: int, payload: bytes) -> bytes:
        if status != 200:
            return payload
        try:
            answer = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return payload
        if isinstance(answer, dict):
            completion_id = answer.get("id")
            if self.on_completion_id is not None and isinstance(completion_id, str):
                self._completion_id(completion_id.encode())
            if self.oai and self.learn_verbose_default is not None:
                self.learn_verbose_default("__verbose" in answer)
            self.read_answer(answer)
            self._hide_added(answer)
        elif isinstance(answer, list) and answer and all(isinstance(a, dict) for a in answer):
            self._read_several(answer)
            if not self._rewrites:
                return payload
        elif not self._rewrites:
            return payload
        if not self.added and not self._rewrites:
            return payload
        return orjson.dumps(self._projected(self._shown(answer)))

    def read_answer(self, answer: dict) -> None:
        """Read the task's outcome from a whole answer in this observer's form."""
        if not self.oai:
            self._read_final(answer)
        elif isinstance(answer.get("__verbose"), dict):
            self._read_final(answer["__verbose"])
        else:  # no `__verbose` (the server's default was not known): the slot's length only
            self._read_final(answer)
            predicted = (answer.get("timings") or {}).get("predicted_n")
            if self._outcome.ok and isinstance(predicted, int):
                # the last sampled token is never decoded, so it is not in the KV cache
                tokens_cached = self.prompt_length + max(predicted - 1, 0)
                self._outcome = replace(self._outcome, tokens_cached=tokens_cached)

    def _read_several(self, finals: list[dict]) -> None:
        """Several native tasks answered together (a whole upstream's `n_cmpl` or batch): what
        they computed and generated, added up."""
        outcomes = []
        for final in finals:
            self._read_final(final)
            outcomes.append(self._outcome)
        self._outcome = summed(outcomes)

    def _shown(self, document: Any) -> Any:
        return document if self.shown is None else as_shown(document, self.shown)

    def _projected(self, document: Any) -> Any:
        """A final answer (or event) as `response_fields` projects it, known by its shape
        (a whole-upstream request's observer reads every route's answer as a native one): an
        OpenAI one's `__verbose` (the native answer it carries), a native one whole."""
        if self.fields is None:
            return document
        if isinstance(document, list):
            return [self._projected(item) for item in document]
        if not isinstance(document, dict):
            return document
        verbose = document.get("__verbose")
        if isinstance(verbose, dict):  # a partial event's is whole
            if not is_final(verbose):
                return document
            return {**document, "__verbose": projected(verbose, self.fields)}
        if not self.oai and is_final(document):  # an OpenAI answer has no `stop`
            return projected(document, self.fields)
        return document

    def _read_final(self, final: dict) -> None:
        timings = final.get("timings") or {}
        generated = final.get("tokens") if self.ids_in_answer else None
        self._outcome = TaskOutcome(
            ok=True,
            cache_n=timings.get("cache_n"),
            prompt_n=timings.get("prompt_n"),
            prompt_ms=timings.get("prompt_ms"),
            tokens_cached=final.get("tokens_cached"),
            generated=list(generated) if isinstance(generated, list) else None,
            predicted_n=timings.get("predicted_n"),
            predicted_ms=timings.get("predicted_ms"),
            slot_id=_slot_id(final),
            truncated=final.get("truncated") is True,
        )

    def _hide_added(self, answer: dict) -> None:
        # without return_tokens llama-server still sends `tokens`, empty
        if self.oai:
            if "verbose" in self.added:
                answer.pop("__verbose", None)
            elif "return_tokens" in self.added and isinstance(answer.get("__verbose"), dict):
                answer["__verbose"]["tokens"] = []
        elif "return_tokens" in self.added and "tokens" in answer:
            answer["tokens"] = []

    # -- a stream, read on the side ---------------------------------------------------------

    def relay_chunk(self, chunk: bytes) -> bytes:
        """What to send on for this chunk: the chunk itself, or its complete events rewritten."""
        if self.on_first_event is not None and b"data:" in chunk:
            first_event, self.on_first_event = self.on_first_event, None
            first_event()
        if self.on_completion_id is not None and self.oai:
            if (found := COMPLETION_ID.search(chunk)) is not None:
                self._completion_id(found.group(1))
        if chunk.startswith(LATE_ERROR):  # after a broken-off event: its half is dropped
            if self._chunks:
                self._digest()
            self._pending = b""
        if not self._rewrites:
            self._read_chunk(chunk)
            return chunk
        self._pending += chunk
        *events, self._pending = self._pending.split(b"\n\n")
        return b"".join(self._relay_event(event) + b"\n\n" for event in events)

    def _completion_id(self, found: bytes) -> None:
        """The answer's completion id, told once (only llama-server's kind of id)."""
        if found.startswith(b"chatcmpl-") and self.on_completion_id is not None:
            told, self.on_completion_id = self.on_completion_id, None
            told(found.decode())

    def _read_chunk(self, chunk: bytes) -> None:
        """Keep a chunk passed on unchanged, to be read in batches (`_digest`): a chunk costs
        an append, and a batch a few scans in C, not a JSON parse per event."""
        self._chunks.append(chunk)
        self._held += len(chunk)
        if self._held > DIGEST_BYTES:
            self._digest()

    def _digest(self) -> None:
        """Read the complete events held. Only what the table needs is parsed: an error, the
        events with `timings`, a native stream's final event (`tokens_cached`); the ids of
        native partial events are found by one regular-expression pass (llama-server writes
        `"tokens":[id]`; a quote inside generated text is escaped, so text never matches).
        Anything else (progress events, an error, per-token timings) is read event by event."""
        data = self._pending + b"".join(self._chunks)
        self._chunks, self._held = [], 0
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return
        self._pending, complete = data[end + 2 :], data[: end + 2]
        if self._slow or b'"error"' in complete or b'"prompt_progress"' in complete:
            self._slow = True
            for event in complete[:-2].split(b"\n\n"):
                self._relay_event(event)
            return
        final = complete.rfind(b'"timings"')
        if final >= 0:  # the last event with timings (native: the final one), parsed
            final = complete.rfind(b"\n\n", 0, final) + 2  # 0 when it is the first event
            self._relay_event(complete[final : complete.index(b"\n\n", final)])
        partial = complete[:final] if final >= 0 else complete
        if self.oai:
            # the chunks carrying a generated token, counted without a parse: what a stream cut
            # before its end is charged (its last event, with timings, was read above)
            token_delta = self.token_delta
            self._token_events += sum(
                1 for event in partial.split(b"\n\n") if token_delta.search(event)
            )
            return
        if b'"timings"' in partial:  # timings on partial events too: read each
            self._slow = True
            for event in partial[:-2].split(b"\n\n"):
                self._relay_event(event)
            return
        for ids in TOKEN_IDS.findall(partial):
            if ids:
                self._generated.extend(map(int, ids.split(b",")))

    def finish(self) -> bytes:
        """Whatever is left once the stream has ended (an unterminated last event)."""
        rest, self._pending = self._pending, b""
        return rest if self._rewrites else b""

    def _relay_event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for index, line in enumerate(lines):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                document = self._read_event(line[6:])
                if self._rewrites and document is not None:
                    lines[index] = b"data: " + orjson.dumps(self._projected(self._shown(document)))
        return b"\n".join(lines)

    def _read_event(self, data: bytes) -> Any:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(event, dict):
            return event
        if "error" in event:
            self._failed = True
        elif "timings" in event:
            self._timings = self._task_timings[_task_index(event)] = event["timings"]
        if self.oai:
            self._token_events += self.delta_count(event)
            return event
        if "error" in event:
            return event
        if event.get("stop"):
            self._tokens_cached = event.get("tokens_cached")
            self._slot_id = _slot_id(event)
            self._truncated = event.get("truncated") is True
        elif "prompt_progress" not in event:  # progress chunks carry a dummy token id
            self._generated.extend(event.get("tokens") or ())
        return event

    def _stream_outcome(self) -> TaskOutcome:
        if self._failed or self._timings is None:
            # cut or failed: what was streamed was still generated (and is charged for)
            seen = self._token_events if self.oai else len(self._generated)
            return TaskOutcome(ok=False, predicted_n=seen or None)
        if len(self._task_timings) > 1:  # several tasks: their ids interleave, not kept
            return summed([of_timings(timings) for timings in self._task_timings.values()])
        predicted = self._timings.get("predicted_n", 0)
        tokens_cached = self._tokens_cached
        if tokens_cached is None:
            # the last sampled token is never decoded, so it is not in the KV cache
            tokens_cached = self.prompt_length + max(predicted - 1, 0)
        # a token that leaves incomplete UTF-8 gets no chunk: then some ids are missing
        complete = not self.oai and len(self._generated) == predicted
        return TaskOutcome(
            ok=True,
            cache_n=self._timings.get("cache_n"),
            prompt_n=self._timings.get("prompt_n"),
            prompt_ms=self._timings.get("prompt_ms"),
            tokens_cached=tokens_cached,
            generated=self._generated if complete else None,
            predicted_n=self._timings.get("predicted_n"),
            predicted_ms=self._timings.get("predicted_ms"),
            slot_id=self._slot_id,
            truncated=self._truncated,
        )


def _task_index(event: dict) -> object:
    """Which task of several a native stream event is: its `index` (an OpenAI chunk has none
    at its top: its final usage chunk names no choice, and its timings are one task's)."""
    return event.get("index")


def is_final(answer: dict) -> bool:
    """A native task's final answer or final stream event (`stop` true): the one
    `response_fields` projects, and the one a chunk ends with; an error is none."""
    return answer.get("stop") is True and "error" not in answer


def _slot_id(final: dict) -> int | None:
    """The slot a native final answer (or `__verbose`) names; partial events say -1."""
    slot_id = final.get("id_slot")
    return (
        slot_id
        if isinstance(slot_id, int) and not isinstance(slot_id, bool) and slot_id >= 0
        else None
    )


def oai_delta_count(event: dict) -> int:
    """How many choices of an OAI stream chunk carry generated text or a tool call (llama-server
    sends one chunk per token, save a token that leaves incomplete UTF-8): a chat chunk's
    `delta`, a text completion's (`/v1/completions`) `text`."""
    count = 0
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            count += any(delta.get(key) for key in ("content", "reasoning_content", "tool_calls"))
        elif isinstance(choice.get("text"), str) and choice["text"]:
            count += 1
    return count
