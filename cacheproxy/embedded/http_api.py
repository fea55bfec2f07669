"""llama-server's HTTP API over the embedded engine: the routes and JSON shapes clients use.

The field names and envelopes follow the pinned llama-server: native `/completion` answers carry
`id_slot`, `tokens_cached` and `timings{cache_n, prompt_n, ...}`; OAI answers carry `usage` and
`timings`; streams are SSE `data:` events, with `[DONE]` on the OAI routes only.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jinja2.sandbox
import orjson
from aiohttp import web

from cacheproxy.embedded.engine import (
    CompletionResult,
    CompletionTask,
    EmbeddedEngine,
    EngineError,
    SamplingParams,
    SlotCommand,
)
from cacheproxy.http.errors import error_response

ENGINE: web.AppKey[EmbeddedEngine] = web.AppKey("embedded_engine", EmbeddedEngine)
SLOT_SAVE_PATH: web.AppKey[Path | None] = web.AppKey("embedded_slot_save_path", object)  # type: ignore[arg-type]
MODEL_NAME: web.AppKey[str] = web.AppKey("embedded_model_name", str)
BUILD_INFO = "cacheproxy-embedded"
RANDOM_SEED = 0xFFFFFFFF
# llama-server's filename check (fs_validate_filename), the parts a caller can hit by mistake.
_BAD_FILENAME = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|]|^\s|\s$|\.$|\.\.')


def valid_filename(filename: str) -> bool:
    return bool(filename) and not _BAD_FILENAME.search(filename)


class _Done:
    def __init__(self, result: CompletionResult) -> None:
        self.result = result


class EngineBridge:
    """The asyncio side of the engine: callbacks from the worker thread land in a queue."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    async def run(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        requested_slot_id: int | None,
        cache_prompt: bool,
    ) -> AsyncIterator[tuple[int, str] | _Done]:
        """Yield (token, text) per sampled token, then the final result; raise EngineError."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, str] | _Done | EngineError] = asyncio.Queue()

        def put(item: tuple[int, str] | _Done | EngineError) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        task = CompletionTask(
            prompt=prompt,
            sampling=sampling,
            on_text=lambda token, text: put((token, text)),
            on_done=lambda result: put(_Done(result)),
            on_error=put,
            requested_slot_id=requested_slot_id,
            cache_prompt=cache_prompt,
        )
        self.engine.submit(task)
        finished = False
        try:
            while True:
                item = await events.get()
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                yield item
                if isinstance(item, _Done):
                    finished = True
                    return
        finally:
            if not finished:  # the client went away: free the slot
                self.engine.cancel(task)

    async def slot_command(
        self, action: str, slot_id: int, path: Path | None, filename: str
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[dict[str, Any]] = loop.create_future()

        def done(result: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(_settle, answer, result, None)

        def failed(error: EngineError) -> None:
            loop.call_soon_threadsafe(_settle, answer, None, error)

        self.engine.submit(SlotCommand(action, slot_id, path, filename, done, failed))  # type: ignore[arg-type]
        return await answer


def _settle(
    future: asyncio.Future[dict[str, Any]], result: dict[str, Any] | None, error: Exception | None
) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result or {})


# ---------------------------------------------------------------------------- request parsing


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"Failed to parse the request body as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise EngineError("the request body must be a JSON object")
    return data


def _value(body: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first name present and not null (llama-server treats null as absent)."""
    for name in names:
        if body.get(name) is not None:
            return body[name]
    return default


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    stop = _value(body, "stop", default=())
    if isinstance(stop, str):
        stop = (stop,)
    seed = int(_value(body, "seed", default=-1))
    return SamplingParams(
        n_predict=int(_value(body, "n_predict", "max_tokens", "max_completion_tokens", default=-1)),
        temperature=float(_value(body, "temperature", default=0.8)),
        top_k=int(_value(body, "top_k", default=40)),
        top_p=float(_value(body, "top_p", default=0.95)),
        min_p=float(_value(body, "min_p", default=0.05)),
        seed=RANDOM_SEED if seed < 0 else seed,
        stop=tuple(str(item) for item in stop),
        ignore_eos=bool(_value(body, "ignore_eos", default=False)),
    )


def _requested_slot(body: dict[str, Any]) -> int | None:
    value = body.get("id_slot", -1)
    if not isinstance(value, int) or isinstance(value, bool) or value == -1:
        return None  # a value of the wrong type falls back to -1, as in llama-server
    return value


def prompt_tokens(engine: EmbeddedEngine, prompt: Any) -> list[int]:
    """A string gets BOS and special parsing; an id array is used verbatim; a mixed array
    tokenizes its strings (specials only for a leading string), as llama-server does."""
    if isinstance(prompt, str):
        return engine.tokenize(prompt, add_special=True, parse_special=True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt_tokens(engine, prompt[0])
    if isinstance(prompt, list):
        tokens: list[int] = []
        for index, part in enumerate(prompt):
            if isinstance(part, int) and not isinstance(part, bool):
                tokens.append(part)
            elif isinstance(part, str):
                tokens += engine.tokenize(part, add_special=index == 0, parse_special=True)
            else:
                raise EngineError('"prompt" elements must be strings or token ids')
        return tokens
    raise EngineError('"prompt" must be a string or an array of token ids')


def apply_chat_template(engine: EmbeddedEngine, body: dict[str, Any]) -> str:
    """The model's Jinja chat template over `messages`, with the generation prompt added; a
    leading BOS text is dropped when the tokenizer adds BOS itself (common/chat.cpp)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EngineError("'messages' is required and must be a non-empty array")
    template_text = engine.chat_template()
    if template_text is None:
        raise EngineError("the model has no chat template", "not_supported_error", 501)
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    bos = engine.special_token_text("bos")
    prompt = environment.from_string(template_text).render(
        messages=messages,
        add_generation_prompt=body.get("add_generation_prompt", True),
        bos_token=bos,
        eos_token=engine.special_token_text("eos"),
        **(body.get("chat_template_kwargs") or {}),
    )
    if engine.adds_bos and bos and prompt.startswith(bos):
        prompt = prompt[len(bos) :]
    return prompt


# ---------------------------------------------------------------------------------- answers


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
        "prompt": engine.detokenize(prompt),
        "has_new_line": "\n" in result.content,
        "truncated": False,
        "stop_type": result.stop_type,
        "stopping_word": result.stopping_word,
        "tokens_cached": result.tokens_cached,
        "timings": result.timings(),
    }


def _usage(result: CompletionResult) -> dict[str, Any]:
    return {
        "completion_tokens": result.predicted_n,
        "prompt_tokens": result.tokens_evaluated,
        "total_tokens": result.predicted_n + result.tokens_evaluated,
        "prompt_tokens_details": {"cached_tokens": result.cache_n},
    }


def _finish_reason(result: CompletionResult) -> str:
    return "stop" if result.stop_type in ("eos", "word") else "length"


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


# ---------------------------------------------------------------------------------- handlers


async def _complete(
    request: web.Request, body: dict[str, Any], prompt: list[int], kind: str
) -> web.StreamResponse:
    """Run one completion and answer it in the shape of `kind`: native, text or chat."""
    engine = request.app[ENGINE]
    bridge = EngineBridge(engine)
    model = request.app[MODEL_NAME]
    stream = bool(body.get("stream", False))
    return_tokens = bool(body.get("return_tokens", False))
    verbose = bool(body.get("verbose", False))
    completion_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    events = bridge.run(
        prompt, sampling_params(body), _requested_slot(body), bool(body.get("cache_prompt", True))
    )
    if not stream:
        text_parts: list[str] = []
        result: CompletionResult | None = None
        async for event in events:
            if isinstance(event, _Done):
                result = event.result
            else:
                text_parts.append(event[1])
        assert result is not None
        native = native_final(result, engine, return_tokens, model, prompt, stream=False)
        if kind == "native":
            return web.json_response(native, dumps=_dumps)
        answer = _oai_final(kind, result, model, completion_id, created)
        if verbose:
            answer["__verbose"] = native
        return web.json_response(answer, dumps=_dumps)

    # The first event decides: an error before any token is a plain HTTP error.
    try:
        first = await anext(events)
    except EngineError as error:
        return error_response(error.code, error.message, error.error_type)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if kind == "chat":
        await response.write(
            _sse(
                _chat_chunk(
                    completion_id, created, model, {"role": "assistant", "content": None}, None
                )
            )
        )
    n_predicted = 0
    try:
        event: tuple[int, str] | _Done | None = first
        while event is not None:
            if isinstance(event, _Done):
                await response.write(
                    _stream_final(
                        kind, event.result, engine, model, prompt, completion_id, created, body
                    )
                )
                break
            token, text = event
            n_predicted += 1
            if text:
                await response.write(
                    _sse(
                        _stream_partial(
                            kind,
                            token,
                            text,
                            n_predicted,
                            len(prompt),
                            model,
                            completion_id,
                            created,
                        )
                    )
                )
            event = await anext(events, None)
    except EngineError as error:
        await response.write(
            _sse(
                {"error": {"code": error.code, "message": error.message, "type": error.error_type}}
            )
        )
    await response.write_eof()
    return response


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _oai_final(
    kind: str, result: CompletionResult, model: str, completion_id: str, created: int
) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {
            "finish_reason": _finish_reason(result),
            "index": 0,
            "message": {"role": "assistant", "content": result.content},
        }
        obj = "chat.completion"
    else:
        choice = {
            "text": result.content,
            "index": 0,
            "logprobs": None,
            "finish_reason": _finish_reason(result),
        }
        obj = "text_completion"
    return {
        "choices": [choice],
        "created": created,
        "model": model,
        "system_fingerprint": BUILD_INFO,
        "object": obj,
        "usage": _usage(result),
        "id": completion_id,
        "timings": result.timings(),
    }


def _chat_chunk(
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


def _stream_partial(
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
        return _chat_chunk(completion_id, created, model, {"content": text}, None)
    return {
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}],
        "created": created,
        "model": model,
        "system_fingerprint": BUILD_INFO,
        "object": "text_completion",
        "id": completion_id,
    }


def _stream_final(
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
        return _sse(native_final(result, engine, False, model, prompt, stream=True))
    if kind == "chat":
        final = _chat_chunk(completion_id, created, model, {}, _finish_reason(result))
    else:
        final = {
            "choices": [
                {"text": "", "index": 0, "logprobs": None, "finish_reason": _finish_reason(result)}
            ],
            "created": created,
            "model": model,
            "system_fingerprint": BUILD_INFO,
            "object": "text_completion",
            "id": completion_id,
        }
    final["timings"] = result.timings()
    chunks = _sse(final)
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = dict(final, choices=[], usage=_usage(result))
        usage.pop("timings", None)
        chunks += _sse(usage)
    return chunks + _sse("[DONE]")


# llama-server request fields the engine does not implement; refused when set to anything truthy
UNSUPPORTED_FIELDS = ("grammar", "json_schema", "n_probs", "logprobs", "top_logprobs", "tools")


def _require_one_completion(body: dict[str, Any]) -> None:
    """The engine runs one plain completion of one prompt per request: refuse what llama-server
    would answer with several, or constrain, rather than answer something else."""
    count = body.get("n_cmpl", body.get("n", 1))
    if count not in (None, 1):
        raise EngineError(
            "the embedded engine answers one completion per request (n = 1)",
            "not_supported_error",
            501,
        )
    unsupported = [name for name in UNSUPPORTED_FIELDS if body.get(name)]
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        unsupported.append("response_format")
    if unsupported:
        # an answer that ignored a grammar or a schema would look valid and be wrong
        raise EngineError(
            f"the embedded engine does not support {', '.join(unsupported)}",
            "not_supported_error",
            501,
        )
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1
    if several and all(isinstance(part, (str, list)) for part in prompt):
        raise EngineError(
            "the embedded engine answers one prompt per request, not a batch of prompts",
            "not_supported_error",
            501,
        )


async def completion_route(request: web.Request) -> web.StreamResponse:
    body = _json_body(await request.read())
    if "prompt" not in body:
        raise EngineError('"prompt" is required')
    _require_one_completion(body)
    kind = "text" if request.path.startswith("/v1/") else "native"
    return await _complete(request, body, prompt_tokens(request.app[ENGINE], body["prompt"]), kind)


async def chat_route(request: web.Request) -> web.StreamResponse:
    body = _json_body(await request.read())
    _require_one_completion(body)
    engine = request.app[ENGINE]
    prompt = apply_chat_template(engine, body)
    return await _complete(
        request, body, engine.tokenize(prompt, add_special=True, parse_special=True), "chat"
    )


async def tokenize_route(request: web.Request) -> web.Response:
    body = _json_body(await request.read())
    engine = request.app[ENGINE]
    content = body.get("content")
    if content is None:
        return web.json_response({"tokens": []})
    add_special = bool(body.get("add_special", False))
    parse_special = bool(body.get("parse_special", True))
    if isinstance(content, str):
        tokens = engine.tokenize(content, add_special, parse_special)
    else:
        tokens = []
        for index, part in enumerate(content):
            if isinstance(part, str):
                tokens += engine.tokenize(part, add_special and index == 0, parse_special)
            else:
                tokens.append(int(part))
    if body.get("with_pieces"):
        pieces = []
        for token in tokens:
            raw = engine.token_piece(token)
            try:
                piece: str | list[int] = raw.decode()
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": token, "piece": piece})
        return web.json_response({"tokens": pieces})
    return web.json_response({"tokens": tokens})


async def detokenize_route(request: web.Request) -> web.Response:
    body = _json_body(await request.read())
    return web.json_response({"content": request.app[ENGINE].detokenize(body.get("tokens", []))})


async def apply_template_route(request: web.Request) -> web.Response:
    body = _json_body(await request.read())
    return web.json_response({"prompt": apply_chat_template(request.app[ENGINE], body)})


async def health_route(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def props_route(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response(
        {
            "default_generation_settings": {"n_ctx": engine.n_ctx_slot, "params": {}},
            "total_slots": engine.config.n_slots,
            "model_alias": request.app[MODEL_NAME],
            "model_path": str(engine.config.model_path),
            "modalities": {"vision": False, "audio": False},
            "chat_template": engine.chat_template() or "",
            "bos_token": engine.special_token_text("bos"),
            "eos_token": engine.special_token_text("eos"),
            "build_info": BUILD_INFO,
            "is_sleeping": False,
        }
    )


async def models_route(request: web.Request) -> web.Response:
    """llama-server's model list: clients read the id; the proxy's disk tier reads `meta`."""
    engine = request.app[ENGINE]
    name = str(engine.config.model_path)
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "llamacpp",
                    "meta": engine.model_meta(),
                }
            ],
        }
    )


async def slots_route(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].slot_report())


async def slot_action_route(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        slot_id = int(request.match_info["id_slot"])
    except ValueError as exc:
        raise EngineError("Invalid slot ID") from exc
    action = request.query.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise EngineError("Invalid action")
    filename = ""
    path: Path | None = None
    if action != "erase":
        save_dir = request.app[SLOT_SAVE_PATH]
        if save_dir is None:
            raise EngineError(
                "This server does not support slots action", "not_supported_error", 501
            )
        filename = str(_json_body(await request.read()).get("filename", ""))
        if not valid_filename(filename):
            raise EngineError("Invalid filename")
        path = save_dir / filename
    answer = await EngineBridge(engine).slot_command(action, slot_id, path, filename)
    return web.json_response(answer)


async def metrics_route(request: web.Request) -> web.Response:
    stats = request.app[ENGINE].stats
    busy = sum(1 for slot in request.app[ENGINE].slot_report() if slot["is_processing"])
    counters = {
        "prompt_tokens_total": stats.prompt_tokens_total,
        "prompt_tokens_cached_total": stats.prompt_tokens_cached_total,
        "prompt_seconds_total": stats.prompt_seconds_total,
        "tokens_predicted_total": stats.tokens_predicted_total,
        "tokens_predicted_seconds_total": stats.tokens_predicted_seconds_total,
        "n_decode_total": stats.n_decode_total,
    }
    lines = []
    for name, value in counters.items():
        lines += [f"# TYPE llamacpp:{name} counter", f"llamacpp:{name} {value}"]
    lines += ["# TYPE llamacpp:requests_processing gauge", f"llamacpp:requests_processing {busy}"]
    # A KV-sharing prompt cache: cells counted once, and who holds how many. The engine serves
    # one tenant's traffic only (the proxy refuses a RAM-cache upstream while tenants exist), so
    # "held" is per sequence: slots and cached prefixes.
    typed: set[str] = set()
    for name, value in request.app[ENGINE].kv_sharing_report().items():
        family = name.split("{", 1)[0]
        if family not in typed:
            typed.add(family)
            lines.append(f"# TYPE llamacpp:{family} gauge")
        lines.append(f"llamacpp:{name} {value}")
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")


@web.middleware
async def engine_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Engine refusals in llama-server's envelope; unknown routes as its 404."""
    try:
        return await handler(request)
    except EngineError as error:
        return error_response(error.code, error.message, error.error_type)
    except web.HTTPNotFound:
        return error_response(404, "File Not Found", "not_found_error")


def create_engine_app(
    engine: EmbeddedEngine, slot_save_path: Path | None, model_name: str
) -> web.Application:
    app = web.Application(client_max_size=100 * 1024 * 1024, middlewares=[engine_errors])
    app[ENGINE] = engine
    app[SLOT_SAVE_PATH] = slot_save_path
    app[MODEL_NAME] = model_name
    for path in ("/completion", "/completions", "/v1/completions"):
        app.router.add_post(path, completion_route)
    for path in ("/chat/completions", "/v1/chat/completions"):
        app.router.add_post(path, chat_route)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_post("/apply-template", apply_template_route)
    for path in ("/health", "/v1/health"):
        app.router.add_get(path, health_route)
    app.router.add_get("/props", props_route)
    for path in ("/models", "/v1/models"):
        app.router.add_get(path, models_route)
    app.router.add_get("/slots", slots_route)
    app.router.add_post("/slots/{id_slot}", slot_action_route)
    app.router.add_get("/metrics", metrics_route)
    return app
