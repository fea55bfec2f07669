"""Read what llama-server reports about a task from its answer, without changing the answer.

The proxy may add `return_tokens` (native routes) or `verbose` (OAI routes, whose answers carry
`tokens_cached` and the generated ids only inside `__verbose`) to learn what the slot now holds;
whatever it added is taken out again, so the client gets the answer it would have had.
Streams are never altered: their chunks are read on the side as they pass.
"""

from __future__ import annotations

from typing import Any

import orjson

from cacheproxy.slot_table import TaskOutcome


class TaskObserver:
    def __init__(
        self,
        prompt_length: int,
        stream: bool,
        oai: bool,
        added: frozenset[str],
        ids_in_answer: bool,
    ) -> None:
        self.prompt_length = prompt_length
        self.stream = stream
        self.oai = oai
        self.added = added  # request fields the proxy added and must hide again
        self.ids_in_answer = ids_in_answer  # return_tokens was set: the answer lists generated ids
        self._outcome = TaskOutcome(ok=False)
        self._pending = b""
        self._generated: list[int] = []
        self._timings: dict[str, Any] | None = None
        self._tokens_cached: int | None = None
        self._failed = False

    def outcome(self) -> TaskOutcome:
        if self.stream:
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
        if not isinstance(answer, dict):
            return payload
        self._read_final(answer.get("__verbose", answer) if self.oai else answer)
        if not self.added:
            return payload
        self._hide_added(answer)
        return orjson.dumps(answer)

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

    def observe_chunk(self, chunk: bytes) -> None:
        self._pending += chunk
        *events, self._pending = self._pending.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    self._read_event(line[6:])

    def _read_event(self, data: bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            self._failed = True
            return
        if "timings" in event:
            self._timings = event["timings"]
        if self.oai:
            return
        if event.get("stop"):
            self._tokens_cached = event.get("tokens_cached")
        elif "prompt_progress" not in event:  # progress chunks carry a dummy token id
            self._generated.extend(event.get("tokens") or ())

    def _stream_outcome(self) -> TaskOutcome:
        if self._failed or self._timings is None:
            return TaskOutcome(ok=False)
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
        )
