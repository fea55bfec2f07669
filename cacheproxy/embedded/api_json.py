"""The JSON of llama-server's API for the embedded engine: requests read as llama-server reads
them (sampling fields, prompts, chat templates) and answers, stream chunks and usage shaped as
llama-server writes them, native and OpenAI-style. Pure: no I/O, no event loop."""

from __future__ import annotations

from typing import Any

import jinja2.sandbox
import orjson

from cacheproxy.embedded.engine import EmbeddedEngine
from cacheproxy.embedded.tasks import CompletionResult, EngineError, SamplingParams

BUILD_INFO = "cacheproxy-embedded"
RANDOM_SEED = 0xFFFFFFFF


def json_body(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError as exc:
        raise EngineError(400, f"Failed to parse the request body as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise EngineError(400, "the request body must be a JSON object")
    return data


def first_value(body: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first name present and not null (llama-server treats null as absent)."""
    for name in names:
        if body.get(name) is not None:
            return body[name]
    return default


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    stop = first_value(body, "stop", default=())
    if isinstance(stop, str):
        stop = (stop,)
    seed = int(first_value(body, "seed", default=-1))
    return SamplingParams(
        n_predict=int(
            first_value(body, "n_predict", "max_tokens", "max_completion_tokens", default=-1)
        ),
        temperature=float(first_value(body, "temperature", default=0.8)),
        top_k=int(first_value(body, "top_k", default=40)),
        top_p=float(first_value(body, "top_p", default=0.95)),
        min_p=float(first_value(body, "min_p", default=0.05)),
        seed=RANDOM_SEED if seed < 0 else seed,
        stop=tuple(str(item) for item in stop),
        ignore_eos=bool(first_value(body, "ignore_eos", default=False)),
    )


def requested_slot(body: dict[str, Any]) -> int | None:
    value = body.get("id_slot", -1)
    if not isinstance(value, int) or isinstance(value, bool) or value == -1:
        return None  # a value of the wrong type falls back to -1, as in llama-server
    return value


def prompt_tokens(engine: EmbeddedEngine, prompt: Any) -> list[int]:
    """A string gets BOS and special parsing; an id array is used verbatim; a mixed array
    tokenizes its strings (specials only for a leading string), as llama-server does."""
    if isinstance(prompt, str):
        return engine.model.tokenize(prompt, add_special=True, parse_special=True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt_tokens(engine, prompt[0])
    if isinstance(prompt, list):
        tokens: list[int] = []
        for index, part in enumerate(prompt):
            if isinstance(part, int) and not isinstance(part, bool):
                tokens.append(part)
            elif isinstance(part, str):
                tokens += engine.model.tokenize(part, add_special=index == 0, parse_special=True)
            else:
                raise EngineError(400, '"prompt" elements must be strings or token ids')
        return tokens
    raise EngineError(400, '"prompt" must be a string or an array of token ids')


def apply_chat_template(engine: EmbeddedEngine, body: dict[str, Any]) -> str:
    """The model's Jinja chat template over `messages`, with the generation prompt added; a
    leading BOS text is dropped when the tokenizer adds BOS itself (common/chat.cpp)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EngineError(400, "'messages' is required and must be a non-empty array")
    template_text = engine.model.chat_template()
    if template_text is None:
        raise EngineError(501, "the model has no chat template")
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    bos = engine.model.special_token_text("bos")
    prompt = environment.from_string(template_text).render(
        messages=messages,
        add_generation_prompt=body.get("add_generation_prompt", True),
        bos_token=bos,
        eos_token=engine.model.special_token_text("eos"),
        **(body.get("chat_template_kwargs") or {}),
    )
    if engine.model.adds_bos and bos and prompt.startswith(bos):
        prompt = prompt[len(bos) :]
    return prompt


def native_final(
    result: CompletionResult,
    engine: EmbeddedEngine,
    return_tokens: bool,
    model: str,
    prompt: list[int],
    stream: bool,
) -> dict[str, Any]:
    return {
        "index": 0,
        "content": "" if stream else result.content,
        "tokens": result.tokens if return_tokens and not stream else [],
        "id_slot": result.id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": result.predicted_n,
        "tokens_evaluated": result.tokens_evaluated,
        "generation_settings": {"n_ctx": engine.n_ctx_slot},
        "prompt": engine.model.detokenize(prompt),
        "has_new_line": "\n" in result.content,
        "truncated": False,
        "stop_type": result.stop_type,
        "stopping_word": result.stopping_word,
        "tokens_cached": result.tokens_cached,
        "timings": result.timings(),
    }


def usage_json(result: CompletionResult) -> dict[str, Any]:
    return {
        "completion_tokens": result.predicted_n,
        "prompt_tokens": result.tokens_evaluated,
        "total_tokens": result.predicted_n + result.tokens_evaluated,
        "prompt_tokens_details": {"cached_tokens": result.cache_n},
    }


def finish_reason_of(result: CompletionResult) -> str:
    return "stop" if result.stop_type in ("eos", "word") else "length"


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


def dumps_text(value: Any) -> str:
    return orjson.dumps(value).decode()


def oai_final(
    kind: str, result: CompletionResult, model: str, completion_id: str, created: int
) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {
            "finish_reason": finish_reason_of(result),
            "index": 0,
            "message": {"role": "assistant", "content": result.content},
        }
        obj = "chat.completion"
    else:
        choice = {
            "text": result.content,
            "index": 0,
            "logprobs": None,
            "finish_reason": finish_reason_of(result),
        }
        obj = "text_completion"
    return {
        "choices": [choice],
        "created": created,
        "model": model,
        "system_fingerprint": BUILD_INFO,
        "object": obj,
        "usage": usage_json(result),
        "id": completion_id,
        "timings": result.timings(),
    }


def chat_chunk(
    completion_id: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    return {
        "choices": [{"finish_reason": finish_reason, "index": 0, "delta": delta}],
        "created": created,
        "id": completion_id,
        "model": model,
        "system_fingerprint": BUILD_INFO,
        "object": "chat.completion.chunk",
    }


def stream_partial(
    kind: str,
    token: int,
    text: str,
    n_predicted: int,
    n_prompt: int,
    model: str,
    completion_id: str,
    created: int,
) -> dict[str, Any]:
    if kind == "native":
        # id_slot is -1 in partial chunks, as llama-server sends them
        return {
            "index": 0,
            "content": text,
            "tokens": [token],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": n_predicted,
            "tokens_evaluated": n_prompt,
        }
    if kind == "chat":
        return chat_chunk(completion_id, created, model, {"content": text}, None)
    return {
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}],
        "created": created,
        "model": model,
        "system_fingerprint": BUILD_INFO,
        "object": "text_completion",
        "id": completion_id,
    }


def stream_final(
    kind: str,
    result: CompletionResult,
    engine: EmbeddedEngine,
    model: str,
    prompt: list[int],
    completion_id: str,
    created: int,
    body: dict[str, Any],
) -> bytes:
    if kind == "native":
        return sse_event(native_final(result, engine, False, model, prompt, stream=True))
    if kind == "chat":
        final = chat_chunk(completion_id, created, model, {}, finish_reason_of(result))
    else:
        final = {
            "choices": [
                {
                    "text": "",
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": finish_reason_of(result),
                }
            ],
            "created": created,
            "model": model,
            "system_fingerprint": BUILD_INFO,
            "object": "text_completion",
            "id": completion_id,
        }
    final["timings"] = result.timings()
    chunks = sse_event(final)
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = dict(final, choices=[], usage=usage_json(result))
        usage.pop("timings", None)
        chunks += sse_event(usage)
    return chunks + sse_event("[DONE]")


# llama-server request fields the engine does not implement; refused when set to anything truthy
UNSUPPORTED_FIELDS = ("grammar", "json_schema", "n_probs", "logprobs", "top_logprobs", "tools")


def require_one_completion(body: dict[str, Any]) -> None:
    """The engine runs one plain completion of one prompt per request: refuse what llama-server
    would answer with several, or constrain, rather than answer something else."""
    count = body.get("n_cmpl", body.get("n", 1))
    if count not in (None, 1):
        raise EngineError(
            501,
            "the embedded engine answers one completion per request (n = 1)",
        )
    unsupported = [name for name in UNSUPPORTED_FIELDS if body.get(name)]
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        unsupported.append("response_format")
    if unsupported:
        # an answer that ignored a grammar or a schema would look valid and be wrong
        raise EngineError(
            501,
            f"the embedded engine does not support {', '.join(unsupported)}",
        )
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1
    if several and all(isinstance(part, (str, list)) for part in prompt):
        raise EngineError(
            501,
            "the embedded engine answers one prompt per request, not a batch of prompts",
        )
