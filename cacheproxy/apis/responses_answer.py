"""What a llama-server Responses answer says about the task it ran, read without changing it.

The shapes (tools/server/server-task.cpp of the pinned tree):
- the JSON answer (528-597) has no `timings`, no `tokens_cached` and no generated ids, whatever
  the request asks (`verbose` and `return_tokens` add nothing to it): the outcome comes from
  `usage` {input_tokens = the prompt, output_tokens = tokens generated,
  input_tokens_details.cached_tokens = the prompt tokens reused, `cache_n`};
- the event stream (1166-1314, 599-714) ends with `response.completed`, whose data carries
  `timings` {cache_n, prompt_n, predicted_n, ...} beside the same `usage`, so the chat stream's
  reading serves as it is; deltas carry text, not ids. Each generated token's text comes in
  one delta event (`response.output_text.delta`, `.reasoning_text.delta` or
  `.function_call_arguments.delta`, 1225-1300), counted as a chat chunk is: what a stream cut
  before its end is charged as generated.
Either way the slot's ids past the prompt are unknown: the table records the prompt and an
unknown tail of the generated tokens the slot kept (all but the last, never decoded).
Hiding cache signals (`as_uncached`) covers the Responses fields: `cached_tokens` and `timings`
in the answer and in `response.completed`, `prompt_progress` in `response.in_progress`.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from cacheproxy.apis.observe import TaskObserver
from cacheproxy.upstreams.slot_table import TaskOutcome

DELTA_TYPES = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)
# one of those, found without a parse (a quote inside generated text is escaped, so text
# never matches)
TOKEN_DELTA = re.compile(
    b'"type":"(?:' + b"|".join(re.escape(kind.encode()) for kind in sorted(DELTA_TYPES)) + b')"'
)


def responses_outcome(answer: dict[str, Any], prompt_length: int) -> TaskOutcome:
    """The outcome of a task from its whole Responses answer (its `usage`)."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return TaskOutcome(ok=False)
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = usage.get("input_tokens")
    generated = usage.get("output_tokens")
    if not all(isinstance(count, int) for count in (cached, prompt, generated)):
        return TaskOutcome(ok=False)
    return TaskOutcome(
        ok=True,
        cache_n=cached,
        prompt_n=prompt - cached,
        # the last sampled token is never decoded, so it is not in the slot
        tokens_cached=prompt_length + max(generated - 1, 0),
        predicted_n=generated,
    )


class ResponsesObserver(TaskObserver):
    """TaskObserver for `/v1/responses`: streams read as chat streams are (their last event
    has `timings`), whole answers from their `usage`."""

    asks_for_ids = False  # nothing the proxy could add would bring ids into the answer
    shows_completion_id = False  # its ids are its own (`resp_...`), which no control names
    token_delta: ClassVar[re.Pattern[bytes]] = TOKEN_DELTA

    @staticmethod
    def delta_count(event: dict) -> int:
        return int(event.get("type") in DELTA_TYPES)

    def _read_final(self, final: dict) -> None:
        self._outcome = responses_outcome(final, self.prompt_length)
