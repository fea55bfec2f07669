"""The fake llama-server's answers: what one task computed, and the JSON each route makes of it.

Shapes as tools/server/server-task.cpp builds them in the pinned tree (reference §1.2-§1.5):
native answers and events, OpenAI text and chat completions (whole and streamed, `usage`,
`timings` on the last event, `__verbose` when the request says `verbose`), `n_probs`
candidates. Pure: the server module runs the tasks and sends these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tests.support.fake_llama_text import detokenize, generated_text, piece, top_candidates


@dataclass
class TaskRun:
    """One task as the fake ran it."""

    index: int  # the answer's `index`: prompts' tasks and their children, numbered flat
    prompt: list[int]
    slot_id: int
    cache_n: int
    generated: list[int]
    stop_type: str  # "eos" or "limit"
    truncated: bool
    prompt_ms_per_token: float
    predicted_ms_per_token: float

    @property
    def prompt_n(self) -> int:
        return len(self.prompt) - self.cache_n

    @property
    def tokens_cached(self) -> int:
        """The slot's length after the task: the last sampled token is never decoded."""
        return len(self.prompt) + len(self.generated) - 1

    @property
    def finish_reason(self) -> str:
        return "length" if self.stop_type == "limit" else "stop"

    def timings(self) -> dict:
        prompt_ms = self.prompt_n * self.prompt_ms_per_token
        predicted_ms = len(self.generated) * self.predicted_ms_per_token
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": self.prompt_ms_per_token,
            "prompt_per_second": 1000 / self.prompt_ms_per_token,
            "predicted_n": len(self.generated),
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": self.predicted_ms_per_token,
            "predicted_per_second": 1000 / self.predicted_ms_per_token,
        }

    def usage(self) -> dict:
        return {
            "completion_tokens": len(self.generated),
            "prompt_tokens": len(self.prompt),
            "total_tokens": len(self.prompt) + len(self.generated),
            "prompt_tokens_details": {"cached_tokens": self.cache_n},
        }


def native_answer(run: TaskRun, body: dict, model: str, final_event: bool = False) -> dict:
    """`/completion`'s answer (server-task.cpp 340-363), or its stream's final event."""
    answer: dict[str, Any] = {
        "index": run.index,
        "content": "" if final_event else generated_text(run.generated),
        "tokens": [] if final_event or not body.get("return_tokens") else list(run.generated),
        "id_slot": run.slot_id,
        "stop": True,
        "model": model,
        "tokens_predicted": len(run.generated),
        "tokens_evaluated": len(run.prompt),
        "generation_settings": {"n_predict": body.get("n_predict", -1), "temperature": 0.8},
        "prompt": detokenize(run.prompt),
        "has_new_line": False,
        "truncated": run.truncated,
        "stop_type": run.stop_type,
        "stopping_word": "",
        "tokens_cached": run.tokens_cached,
        "timings": run.timings(),
    }
    n_probs = body.get("n_probs") or 0
    if isinstance(n_probs, int) and n_probs > 0 and not final_event:
        answer["completion_probabilities"] = [
            {
                "id": token,
                "token": piece(token).decode(errors="replace"),
                "logprob": 0.0,
                "top_logprobs": [
                    {"id": candidate, "logprob": -float(rank)}
                    for rank, candidate in enumerate(top_candidates(token, n_probs))
                ],
            }
            for token in run.generated
        ]
    return answer


def native_partial(run: TaskRun, step: int) -> dict:
    """A native stream's event for generated token `step` (id_slot -1, as the server sends)."""
    token = run.generated[step]
    return {
        "index": run.index,
        "content": generated_text([token]),
        "tokens": [token],
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": step + 1,
        "tokens_evaluated": len(run.prompt),
    }


def _oai_common(kind: str, model: str, completion_id: str) -> dict:
    return {
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "b11434-fake",
        "object": kind,
        "id": completion_id,
    }


def oai_answer(run: TaskRun, body: dict, model: str, chat: bool, completion_id: str) -> dict:
    """`/v1/completions` (server-task.cpp 374-412) or `/v1/chat/completions` (414-460)."""
    text = generated_text(run.generated)
    if chat:
        choice = {
            "finish_reason": run.finish_reason,
            "index": run.index,
            "message": {"role": "assistant", "content": text},
        }
    else:
        choice = {
            "text": text,
            "index": run.index,
            "logprobs": None,
            "finish_reason": run.finish_reason,
        }
    kind = "chat.completion" if chat else "text_completion"
    answer = {
        "choices": [choice],
        **_oai_common(kind, model, completion_id),
        "usage": run.usage(),
        "timings": run.timings(),
    }
    if body.get("verbose"):
        answer["__verbose"] = native_answer(run, body, model)
    return answer


def oai_events(run: TaskRun, body: dict, model: str, chat: bool, completion_id: str) -> list[dict]:
    """Every event of an OpenAI stream but `[DONE]`, `timings` on the last one with choices."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    common = _oai_common(kind, model, completion_id)
    events = []
    if chat:
        role = {"role": "assistant", "content": None}
        events.append({"choices": [_delta(run.index, role)], **common})
    for token in run.generated:
        text = generated_text([token])
        if chat:
            events.append({"choices": [_delta(run.index, {"content": text})], **common})
        else:
            choice = {"text": text, "index": run.index, "logprobs": None, "finish_reason": None}
            events.append({"choices": [choice], **common})
    if chat:
        last = {"finish_reason": run.finish_reason, "index": run.index, "delta": {}}
    else:
        last = {
            "text": "",
            "index": run.index,
            "logprobs": None,
            "finish_reason": run.finish_reason,
        }
    events.append({"choices": [last], **common, "timings": run.timings()})
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({"choices": [], **common, "usage": run.usage()})
    return events


def _delta(index: int, delta: dict) -> dict:
    return {"finish_reason": None, "index": index, "delta": delta}


def merged(answers: list[dict], oai: bool) -> Any:
    """Several tasks' whole answers as the server answers them: one object, the native array,
    or (OpenAI) the first answer with every other one's first choice appended."""
    if len(answers) == 1:
        return answers[0]
    if not oai:
        return answers
    first = answers[0]
    for answer in answers[1:]:
        first["choices"].extend(answer["choices"][:1])
    return first


def error_body(status: int, message: str, kind: str | None = None) -> dict:
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        500: "server_error",
        501: "not_supported_error",
        503: "unavailable_error",
    }
    return {"error": {"code": status, "message": message, "type": kind or kinds[status]}}
