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

from aiohttp import web

from cacheproxy.embedded.api_json import (
    BUILD_INFO,
    apply_chat_template,
    chat_chunk,
    dumps_text,
    json_body,
    native_final,
    oai_final,
    prompt_tokens,
    requested_slot,
    require_one_completion,
    sampling_params,
    sse_event,
    stream_final,
    stream_partial,
)
from cacheproxy.embedded.engine import EmbeddedEngine
from cacheproxy.embedded.tasks import (
    CompletionResult,
    CompletionTask,
    EngineError,
    SamplingParams,
    SlotCommand,
)
from cacheproxy.errors import ApiError

ENGINE: web.AppKey[EmbeddedEngine] = web.AppKey("embedded_engine", EmbeddedEngine)
SLOT_SAVE_PATH: web.AppKey[Path | None] = web.AppKey("embedded_slot_save_path", object)  # type: ignore[arg-type]
MODEL_NAME: web.AppKey[str] = web.AppKey("embedded_model_name", str)
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
        prompt, sampling_params(body), requested_slot(body), bool(body.get("cache_prompt", True))
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
            return web.json_response(native, dumps=dumps_text)
        answer = oai_final(kind, result, model, completion_id, created)
        if verbose:
            answer["__verbose"] = native
        return web.json_response(answer, dumps=dumps_text)

    # The first event decides: an error before any token is a plain HTTP error.
    try:
        first = await anext(events)
    except EngineError as error:
        return _error_answer(error)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if kind == "chat":
        await response.write(
            sse_event(
                chat_chunk(
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
                    stream_final(
                        kind, event.result, engine, model, prompt, completion_id, created, body
                    )
                )
                break
            token, text = event
            n_predicted += 1
            if text:
                await response.write(
                    sse_event(
                        stream_partial(
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
        await response.write(sse_event(error.envelope()))
    await response.write_eof()
    return response


async def completion_route(request: web.Request) -> web.StreamResponse:
    body = json_body(await request.read())
    if "prompt" not in body:
        raise EngineError(400, '"prompt" is required')
    require_one_completion(body)
    kind = "text" if request.path.startswith("/v1/") else "native"
    return await _complete(request, body, prompt_tokens(request.app[ENGINE], body["prompt"]), kind)


async def chat_route(request: web.Request) -> web.StreamResponse:
    body = json_body(await request.read())
    require_one_completion(body)
    engine = request.app[ENGINE]
    prompt = apply_chat_template(engine, body)
    return await _complete(
        request, body, engine.model.tokenize(prompt, add_special=True, parse_special=True), "chat"
    )


async def tokenize_route(request: web.Request) -> web.Response:
    body = json_body(await request.read())
    engine = request.app[ENGINE]
    content = body.get("content")
    if content is None:
        return web.json_response({"tokens": []})
    add_special = bool(body.get("add_special", False))
    parse_special = bool(body.get("parse_special", True))
    if isinstance(content, str):
        tokens = engine.model.tokenize(content, add_special, parse_special)
    else:
        tokens = []
        for index, part in enumerate(content):
            if isinstance(part, str):
                tokens += engine.model.tokenize(part, add_special and index == 0, parse_special)
            else:
                tokens.append(int(part))
    if body.get("with_pieces"):
        pieces = []
        for token in tokens:
            raw = engine.model.token_piece(token)
            try:
                piece: str | list[int] = raw.decode()
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": token, "piece": piece})
        return web.json_response({"tokens": pieces})
    return web.json_response({"tokens": tokens})


async def detokenize_route(request: web.Request) -> web.Response:
    body = json_body(await request.read())
    content = request.app[ENGINE].model.detokenize(body.get("tokens", []))
    return web.json_response({"content": content})


async def apply_template_route(request: web.Request) -> web.Response:
    body = json_body(await request.read())
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
            "chat_template": engine.model.chat_template() or "",
            "bos_token": engine.model.special_token_text("bos"),
            "eos_token": engine.model.special_token_text("eos"),
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
                    "meta": engine.model.meta(engine.n_ctx_slot),
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
        raise EngineError(400, "Invalid slot ID") from exc
    action = request.query.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise EngineError(400, "Invalid action")
    filename = ""
    path: Path | None = None
    if action != "erase":
        save_dir = request.app[SLOT_SAVE_PATH]
        if save_dir is None:
            raise EngineError(501, "This server does not support slots action")
        filename = str(json_body(await request.read()).get("filename", ""))
        if not valid_filename(filename):
            raise EngineError(400, "Invalid filename")
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


def _error_answer(error: ApiError) -> web.Response:
    """An error in llama-server's envelope, with its status."""
    return web.Response(status=error.status, body=error.body(), content_type="application/json")


@web.middleware
async def engine_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Engine refusals in llama-server's envelope; unknown routes as its 404."""
    try:
        return await handler(request)
    except EngineError as error:
        return _error_answer(error)
    except web.HTTPNotFound:
        return _error_answer(ApiError(404, "File Not Found", "not_found_error"))


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
