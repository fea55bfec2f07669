"""A fake llama-server for wiring tests: an aiohttp app on a real loopback socket that answers
what the proxy asks, records every request it gets, and lets a test hold tasks in flight.

It is for wiring (what the proxy sends, and what it does with the answers), never the judge of
exactness: the tests against the real llama-server stay.

Reproduced, as the pinned llama-server does it (the section numbers are those of the project's
llama-server reference notes, which name the sources):
- routes: `/health` and `/v1/health`, `/props`, `/models` and `/v1/models` (`meta.n_vocab`),
  `/metrics` (501 unless `metrics`), `/slots` (per slot: id, n_ctx, speculative, is_processing;
  once it ran a task id_task, n_prompt_tokens = what it holds, next_token as an array),
  `POST /slots/{id}?action=save|restore|erase` (501 without a slot save path; 400 for a bad
  id, action or file name; the id wraps modulo the slot count; deferred while the slot is busy;
  a failed restore clears the slot), `/tokenize` (`add_special` default false, `parse_special`
  default true, `with_pieces`, mixed arrays: BOS only before a leading string), `/detokenize`,
  `/apply-template`, `/completion` and `/completions`, `/v1/completions`, `/chat/completions`
  and `/v1/chat/completions`, `/infill` (§1, §3-§6);
- prompts: ids used verbatim (no BOS; ids outside the vocabulary refused), strings tokenized
  with BOS and specials, mixed arrays, `{"prompt_string": ...}`, batches (an array without an
  id at its top level: one task per prompt); `n_cmpl`/`n` children (1..slots, else 400) on
  slots of their own, cleared when they end; prompts of n_ctx tokens or more refused with
  `exceed_context_size_error`; chat through the same template as `/apply-template`;
- slots (§2): `id_slot` honoured (a busy slot defers the task), else similarity then LRU;
  `cache_n` = the prompt's common prefix with what the slot holds, N-1 for a fully cached
  prompt, 0 with `cache_prompt: false`; after a task the slot holds (prompt + generated) but
  the last sampled token (`tokens_cached`); `n_predict: 0` still samples one token; a client
  that leaves mid-stream leaves the slot holding what was decoded so far;
- the RAM prompt cache (`ram_cache`, as `--cache-ram N`; off by default here, as the proxy
  wants it) for completions whose slot is chosen with f_keep < 0.5, and idle slots emptied into
  it whenever a task starts with unified KV (`unified_kv`, llama-server's automatic `-np`);
- answers (§1.2-§1.5): native, OpenAI text and chat (non-stream and SSE, `[DONE]` on OpenAI
  routes only, `timings` on the last event, `id_slot` -1 in native partial events, the real
  one in the final event), `return_tokens`, `__verbose` only when the request asks for it,
  `n_probs` candidates, `usage.prompt_tokens_details.cached_tokens`;
- the API key (`api_key`; `Authorization: Bearer` or `X-Api-Key`, `/health` public) and the
  loading state (503 on every route, `/health` included), in llama-server's error envelope.

Not reproduced: batching (every task runs on its own, at once; timings are made up from
per-token figures, no time passes), tool calls, reasoning, grammars, stop words, sampling
settings, logit bias, speculative decoding, context shift, `n_keep`/`n_cache_reuse`,
checkpoints, multimodal data, embeddings and rerank, `/v1/responses` and `/v1/messages` (the
proxy converts `/v1/messages` to chat itself), sleeping, `X-Conversation-Id`, SSE pings and
progress events, a busy pinned slot touched by the RAM cache before the task is deferred,
children taking the first free slots by index (they take one as an unpinned task does), a
batch's or several completions' stream (sent task after task once all ran, not interleaved).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from tests.support.fake_llama_answers import (
    TaskRun,
    error_body,
    merged,
    native_answer,
    native_partial,
    oai_answer,
    oai_events,
)
from tests.support.fake_llama_slots import (
    FakeSlot,
    FakeSlots,
    SlotFileRefused,
    common_prefix,
    read_slot_file,
    slot_file_bytes,
    valid_filename,
)
from tests.support.fake_llama_text import (
    apply_template,
    detokenize,
    generate,
    infill_tokens,
    piece,
    tokenize_mixed,
)

COMPLETION_ROUTES = {  # route -> (prompt kind, answer form)
    "/completion": ("prompt", "native"),
    "/completions": ("prompt", "native"),
    "/v1/completions": ("prompt", "text"),
    "/chat/completions": ("chat", "chat"),
    "/v1/chat/completions": ("chat", "chat"),
    "/infill": ("infill", "native"),
}
PUBLIC_PATHS = {"/health", "/v1/health"}


@dataclass
class FakeOptions:
    """The llama-server flags the proxy's behaviour depends on."""

    n_slots: int = 4  # -np
    n_ctx: int = 4096  # per slot
    slot_save_path: Path | None = None  # --slot-save-path; None: no slot actions (501)
    ram_cache: bool = False  # --cache-ram N > 0 (llama-server's default is on: 8 GiB)
    unified_kv: bool = False  # -kvu, or the automatic -np: idle slots emptied into RAM
    api_key: str | None = None  # --api-key
    metrics: bool = True  # --metrics
    n_vocab: int = 32000
    eos_after: int = 8  # tokens generated (the last one EOS) when n_predict is not given
    prompt_ms_per_token: float = 0.1  # what `timings` report (no time is spent)
    predicted_ms_per_token: float = 1.0
    save_bytes_per_ms: float = 100_000.0  # what a save's `save_ms` reports
    model: str = "fake-model.gguf"


@dataclass
class Received:
    method: str
    path: str
    query: dict[str, str]
    body: Any  # the JSON body (None: none, or not JSON)


@dataclass
class Hold:
    """Tasks whose body `match`es wait until released: on their slot before their prompt is
    computed (`prefill`), or after their first generated token, sent if streamed
    (`generation`); slot actions (`slot_action`, the body with its `action` and `id_slot`)
    before they run."""

    match: Callable[[dict], bool]
    stage: str = "generation"
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    count: int = 0  # tasks held so far

    def release(self) -> None:
        self.released.set()


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class FakeLlamaServer:
    def __init__(self, options: FakeOptions | None = None, **flags: Any) -> None:
        self.options = options or FakeOptions(**flags)
        self.received: list[Received] = []
        self.holds: list[Hold] = []
        self.loading = False
        self.slots = self._new_slots()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.counters = {"prompt_tokens_total": 0, "tokens_predicted_total": 0}

    def _new_slots(self) -> FakeSlots:
        o = self.options
        return FakeSlots(o.n_slots, o.n_ctx, o.ram_cache, o.unified_kv)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on 127.0.0.1 (a free port the first time, the same one after a stop)."""
        app = web.Application(middlewares=[self._front], client_max_size=100 << 20)
        app.router.add_route("*", "/{path:.*}", self._route)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Gone: connections refused until `start` (in-flight requests are cut)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def restart(self) -> None:
        """A new process on the same port: slots, RAM cache and task ids begin again."""
        await self.stop()
        self.slots = self._new_slots()
        await self.start()

    def hold(
        self, match: Callable[[dict], bool] = lambda body: True, stage: str = "generation"
    ) -> Hold:
        hold = Hold(match, stage)
        self.holds.append(hold)
        return hold

    # -- what it was sent ----------------------------------------------------------------------

    def bodies(self, path: str) -> list[dict]:
        """The JSON bodies POSTed to `path`, in order."""
        return [r.body for r in self.received if r.method == "POST" and r.path == path]

    def slot_actions(self) -> list[tuple[int, str, str | None]]:
        """(slot id, action, file name) of every slot action, in order."""
        return [
            (
                int(r.path.rsplit("/", 1)[1]),
                r.query.get("action", ""),
                (r.body or {}).get("filename") if isinstance(r.body, dict) else None,
            )
            for r in self.received
            if r.method == "POST" and r.path.startswith("/slots/")
        ]

    def held_tokens(self) -> list[list[int]]:
        return [list(slot.tokens) for slot in self.slots.slots]

    # -- HTTP ----------------------------------------------------------------------------------

    @web.middleware
    async def _front(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        body = None
        if request.body_exists:
            with contextlib.suppress(orjson.JSONDecodeError):
                body = orjson.loads(await request.read())
        self.received.append(Received(request.method, request.path, dict(request.query), body))
        try:
            if self.loading:
                raise RequestError(503, "Loading model")
            key = self.options.api_key
            if key and request.path not in PUBLIC_PATHS and request.method != "OPTIONS":
                given = request.headers.get("X-Api-Key") or request.headers.get(
                    "Authorization", ""
                ).removeprefix("Bearer ")
                if given != key:
                    raise RequestError(401, "Invalid API Key")
            return await handler(request)
        except RequestError as exc:
            return web.json_response(
                error_body(exc.status, exc.message, exc.kind), status=exc.status
            )

    async def _route(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, request.method
        if method == "GET":
            getter = {
                "/health": self._health,
                "/v1/health": self._health,
                "/props": self._props,
                "/models": self._models,
                "/v1/models": self._models,
                "/slots": self._slots,
                "/metrics": self._metrics,
            }.get(path)
            if getter is not None:
                return getter(request)
        elif method == "POST":
            if path in COMPLETION_ROUTES:
                return await self._completion(request, *COMPLETION_ROUTES[path])
            if path.startswith("/slots/"):
                return await self._slot_action(request)
            poster = {
                "/tokenize": self._tokenize,
                "/detokenize": self._detokenize,
                "/apply-template": self._apply_template,
            }.get(path)
            if poster is not None:
                return poster(await _json_object(request))
        raise RequestError(404, "File Not Found", "not_found_error")

    def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _props(self, _: web.Request) -> web.Response:
        o = self.options
        return web.json_response(
            {
                "default_generation_settings": {
                    "n_ctx": o.n_ctx,
                    "params": {"n_predict": -1, "temperature": 0.8},
                },
                "total_slots": o.n_slots,
                "model_alias": o.model,
                "model_path": f"/models/{o.model}",
                "model_ftype": "F16",
                "modalities": {"vision": False, "audio": False},
                "endpoint_slots": True,
                "endpoint_props": False,
                "endpoint_metrics": o.metrics,
                "chat_template": "chatml (fake)",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "build_info": "b11434-fake",
                "is_sleeping": False,
            }
        )

    def _models(self, _: web.Request) -> web.Response:
        o = self.options
        meta = {
            "vocab_type": 1,
            "n_vocab": o.n_vocab,
            "n_ctx": o.n_ctx,
            "n_ctx_train": 4 * o.n_ctx,
            "n_embd": 64,
            "n_params": 1_000_000,
            "size": 2_000_000,
            "ftype": 1,
        }
        return web.json_response(
            {
                "models": [{"name": o.model, "model": o.model, "capabilities": ["completion"]}],
                "object": "list",
                "data": [
                    {
                        "id": o.model,
                        "aliases": [],
                        "object": "model",
                        "created": 0,
                        "owned_by": "llamacpp",
                        "meta": meta,
                    }
                ],
            }
        )

    def _slots(self, _: web.Request) -> web.Response:
        return web.json_response([slot.report() for slot in self.slots.slots])

    def _metrics(self, _: web.Request) -> web.Response:
        if not self.options.metrics:
            raise RequestError(
                501, "This server does not support metrics endpoint. Start it with `--metrics`"
            )
        busy = sum(slot.processing for slot in self.slots.slots)
        lines = [
            *(f"llamacpp:{name} {value}" for name, value in self.counters.items()),
            f"llamacpp:requests_processing {busy}",
            "llamacpp:requests_deferred 0",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def _tokenize(self, body: dict) -> web.Response:
        if "content" not in body:
            return web.json_response({"tokens": []})
        ids = tokenize_mixed(
            body["content"], bool(body.get("add_special", False)), body.get("parse_special", True)
        )
        if body.get("with_pieces"):
            pieces = []
            for token in ids:
                raw = piece(token)
                try:
                    shown: Any = raw.decode()
                except UnicodeDecodeError:
                    shown = list(raw)
                pieces.append({"id": token, "piece": shown})
            return web.json_response({"tokens": pieces})
        return web.json_response({"tokens": ids})

    def _detokenize(self, body: dict) -> web.Response:
        return web.json_response({"content": detokenize(body.get("tokens") or [])})

    def _apply_template(self, body: dict) -> web.Response:
        return web.json_response({"prompt": apply_template(body)})

    # -- slot actions ------------------------------------------------------------------------

    async def _slot_action(self, request: web.Request) -> web.Response:
        folder = self.options.slot_save_path
        if folder is None:
            raise RequestError(
                501,
                "This server does not support slots action. Start it with `--slot-save-path`",
            )
        raw_id = request.path.rsplit("/", 1)[1]
        if not raw_id.isdigit():
            raise RequestError(400, "Invalid slot ID")
        action = request.query.get("action", "")
        if action not in ("save", "restore", "erase"):
            raise RequestError(400, "Invalid action")
        body = await _json_object(request) if action != "erase" else {}
        name = body.get("filename")
        if action != "erase" and not valid_filename(name):
            raise RequestError(400, "Invalid filename")
        id_slot = int(raw_id)
        await self._held({**body, "action": action, "id_slot": id_slot}, "slot_action")
        self.slots.new_task_id()
        slot = await self.slots.acquire_for_action(id_slot)
        try:
            if action == "erase":
                erased = len(slot.tokens)
                slot.tokens = []
                return web.json_response({"id_slot": id_slot, "n_erased": erased})
            path = folder / name
            if action == "save":
                return web.json_response(await self._save(slot, id_slot, path))
            return web.json_response(await self._restore(slot, id_slot, path))
        finally:
            await self.slots.release(slot, used=False)

    def _n_stream(self) -> int:
        return 1 if self.options.unified_kv else self.options.n_slots

    async def _save(self, slot: FakeSlot, id_slot: int, path: Path) -> dict:
        stream = 0 if self.options.unified_kv else slot.id
        data = slot_file_bytes(slot.tokens, self._n_stream(), stream)
        try:
            await asyncio.to_thread(path.write_bytes, data)
        except OSError as exc:
            raise RequestError(500, "Unable to save slot") from exc
        return {
            "id_slot": id_slot,
            "filename": path.name,
            "n_saved": len(slot.tokens),
            "n_written": len(data),
            "timings": {"save_ms": len(data) / self.options.save_bytes_per_ms},
        }

    async def _restore(self, slot: FakeSlot, id_slot: int, path: Path) -> dict:
        o = self.options
        try:
            tokens = await asyncio.to_thread(
                read_slot_file, path, self._n_stream(), o.n_vocab, o.n_ctx
            )
        except SlotFileRefused as exc:
            slot.tokens = []  # any failure clears the slot
            raise RequestError(400, f"Unable to restore slot: {exc}") from exc
        slot.tokens = tokens
        size = (await asyncio.to_thread(path.stat)).st_size
        return {
            "id_slot": id_slot,
            "filename": path.name,
            "n_restored": len(tokens),
            "n_read": size,
            "timings": {"restore_ms": size / o.save_bytes_per_ms},
        }

    # -- completions ---------------------------------------------------------------------------

    async def _completion(self, request: web.Request, kind: str, form: str) -> web.StreamResponse:
        body = await _json_object(request)
        prompts = self._prompts(kind, body)
        count = body.get("n_cmpl", body.get("n"))
        count = 1 if count is None else count
        if not isinstance(count, int) or not 1 <= count <= self.options.n_slots:
            raise RequestError(
                400,
                f"Field 'n_cmpl': Value must be between 1 <= value <= {self.options.n_slots},"
                f" but got {count}",
            )
        for prompt in prompts:
            self._check_prompt(prompt)
        plan = [(prompt, child) for prompt in prompts for child in range(count)]
        completion_id = ("chatcmpl-" if form == "chat" else "cmpl-") + secrets.token_hex(12)
        if body.get("stream") is True and len(plan) == 1:
            return await self._stream_one(request, body, form, plan[0][0], completion_id)
        runs = await asyncio.gather(
            *(
                self._run(index, prompt, body, child > 0)
                for index, (prompt, child) in enumerate(plan)
            )
        )
        if body.get("stream") is True:
            response = await _event_stream(request)
            for run in runs:
                for event in self._events(run, body, form, completion_id):
                    await response.write(event)
            if form != "native":
                await response.write(b"data: [DONE]\n\n")
            return response
        answers = [self._answer(run, body, form, completion_id) for run in runs]
        return web.json_response(merged(answers, form != "native"), dumps=_dumps)

    def _prompts(self, kind: str, body: dict) -> list[list[int]]:
        if kind == "chat":
            return [tokenize_mixed(apply_template(body), True, True)]
        if kind == "infill":
            return [infill_tokens(body)]
        if "prompt" not in body:
            raise RequestError(400, '"prompt" must be provided')
        prompt = body["prompt"]
        batch = isinstance(prompt, list) and not any(type(item) is int for item in prompt)
        elements = prompt if batch else [prompt]
        if not elements:
            raise RequestError(400, '"prompt" must not be empty')
        return [self._one_prompt(element) for element in elements]

    def _one_prompt(self, element: Any) -> list[int]:
        if isinstance(element, dict) and "prompt_string" in element:
            element = element["prompt_string"]
        if isinstance(element, list) and all(type(item) is int for item in element):
            return list(element)  # ids, verbatim
        if isinstance(element, str | list):
            return tokenize_mixed(element, True, True)
        raise RequestError(
            400,
            '"prompt" elements must be a string, a list of tokens, a JSON object containing a'
            " prompt string, or a list of mixed strings & tokens.",
        )

    def _check_prompt(self, prompt: list[int]) -> None:
        o = self.options
        if any(not 0 <= token < o.n_vocab for token in prompt):
            raise RequestError(400, "Prompt contains invalid tokens")
        if len(prompt) >= o.n_ctx:
            raise RequestError(
                400,
                f"the request exceeds the available context size ({len(prompt)} tokens,"
                f" context {o.n_ctx})",
                "exceed_context_size_error",
            )

    def _plan_generation(self, prompt: list[int], body: dict) -> tuple[int, bool, bool]:
        """How many tokens, whether the last is EOS, whether the context cut it short."""
        n_predict = next(
            (body[k] for k in ("n_predict", "max_tokens", "max_completion_tokens") if k in body),
            -1,
        )
        n_predict = -1 if n_predict is None else int(n_predict)
        room = self.options.n_ctx - len(prompt) - 1  # generation stops at prompt+gen+1 >= n_ctx
        if n_predict < 0:
            count, eos = self.options.eos_after, not body.get("ignore_eos")
        else:
            count, eos = max(n_predict, 1), False  # n_predict 0 still samples one token
        if count > room:
            return max(room, 1), False, True
        return count, eos, False

    async def _run(
        self,
        index: int,
        prompt: list[int],
        body: dict,
        child: bool,
        on_token: Callable[[TaskRun, int], Any] | None = None,
    ) -> TaskRun:
        """One task on a slot, from its choice to its release; `on_token` is awaited after each
        generated token is sampled (a stream sends it)."""
        id_slot = -1 if child else body.get("id_slot", -1)
        if not isinstance(id_slot, int) or isinstance(id_slot, bool):
            id_slot = -1  # a value of another type falls back to -1
        slot = await self.slots.acquire(prompt, id_slot)
        try:
            slot.id_task = self.slots.new_task_id()
            self.slots.launched()
            await self._held(body, "prefill")
            cache_n = common_prefix(slot.tokens, prompt) if body.get("cache_prompt", True) else 0
            cache_n = min(cache_n, len(prompt) - 1)
            count, eos, truncated = self._plan_generation(prompt, body)
            generated = generate(prompt, count, eos)
            run = TaskRun(
                index,
                prompt,
                slot.id,
                cache_n,
                generated,
                "limit" if truncated or not eos else "eos",
                truncated,
                self.options.prompt_ms_per_token,
                self.options.predicted_ms_per_token,
            )
            slot.tokens = list(prompt)  # computed: the prompt's KV is the slot's now
            slot.n_remain = count
            self.counters["prompt_tokens_total"] += run.prompt_n
            for step in range(len(generated)):
                if step:
                    slot.tokens.append(generated[step - 1])  # decoded as the next is sampled
                slot.n_decoded = step + 1
                if on_token is not None:
                    await on_token(run, step)
                if step == 0:
                    await self._held(body, "generation")
            self.counters["tokens_predicted_total"] += len(generated)
            return run
        finally:
            await self.slots.release(slot, clear=child)

    async def _held(self, body: dict, stage: str) -> None:
        for hold in self.holds:
            if hold.stage == stage and not hold.released.is_set() and hold.match(body):
                hold.count += 1
                hold.arrived.set()
                await hold.released.wait()

    async def _stream_one(
        self, request: web.Request, body: dict, form: str, prompt: list[int], completion_id: str
    ) -> web.StreamResponse:
        response = await _event_stream(request)
        chat = form == "chat"

        async def send(run: TaskRun, step: int) -> None:
            if form == "native":
                await response.write(_event(native_partial(run, step)))
            elif step == 0 and chat:  # the role, then this token's delta
                for event in oai_events(run, body, self.options.model, chat, completion_id)[:2]:
                    await response.write(_event(event))
            else:
                events = oai_events(run, body, self.options.model, chat, completion_id)
                await response.write(_event(events[step + (1 if chat else 0)]))

        run = await self._run(0, prompt, body, False, send)
        model = self.options.model
        if form == "native":
            await response.write(_event(native_answer(run, body, model, final_event=True)))
        else:
            tail = oai_events(run, body, model, chat, completion_id)[len(run.generated) + chat :]
            for event in tail:
                await response.write(_event(event))
            await response.write(b"data: [DONE]\n\n")
        return response

    def _events(self, run: TaskRun, body: dict, form: str, completion_id: str) -> list[bytes]:
        model = self.options.model
        if form == "native":
            partial = [native_partial(run, step) for step in range(len(run.generated))]
            documents = [*partial, native_answer(run, body, model, final_event=True)]
        else:
            documents = oai_events(run, body, model, form == "chat", completion_id)
        return [_event(document) for document in documents]

    def _answer(self, run: TaskRun, body: dict, form: str, completion_id: str) -> dict:
        if form == "native":
            return native_answer(run, body, self.options.model)
        return oai_answer(run, body, self.options.model, form == "chat", completion_id)


def _dumps(document: Any) -> str:
    return orjson.dumps(document).decode()


def _event(document: Any) -> bytes:
    return b"data: " + orjson.dumps(document) + b"\n\n"


async def _event_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


async def _json_object(request: web.Request) -> dict:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"Invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


@contextlib.asynccontextmanager
async def fake_llama_server(**flags: Any) -> AsyncIterator[FakeLlamaServer]:
    """A started fake (flags as `FakeOptions`), stopped afterwards."""
    server = FakeLlamaServer(**flags)
    await server.start()
    try:
        yield server
    finally:
        for hold in server.holds:
            hold.release()
        await server.stop()
