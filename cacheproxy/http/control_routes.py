"""Routes that act on a task by its id: once tenants exist, a tenant reaches only its own.

llama-server acts on whatever id it is given, whoever asks (tools/server/ of the pinned tree):
- `POST /v1/chat/completions/control` {"id", "action": "reasoning_end"} ends the reasoning of
  the running completion with that id (server-context.cpp `post_control`, 5306-5341, and its
  task, 2669-2700: the first processing slot whose task has that `oaicompat_cmpl_id`);
- `GET /v1/stream?conv_id=` replays, `DELETE /v1/stream?conv_id=` stops, and
  `POST /v1/streams/lookup` {"conversation_ids"} lists the stream sessions that requests sent
  with `X-Conversation-Id` leave behind (server-stream.cpp 454-576).

With tenants, a control request names a completion id one of the tenant's own answers showed
(the proxy records each as it relays it, slots/completion_ids.py) and goes to the upstream its
task runs on (a split request's id: to each of its tasks in turn until one acts, as
llama-server acts on the first of a request's tasks); any other id gets the
answer llama-server gives an id it has no running completion for (200, `success` false, "no
active completion for this id": the same whether the id is another tenant's or nobody's). A
stream session is never a tenant's: the proxy strips `X-Conversation-Id`
(upstreams/relay.py), so no tenant's request leaves one, and every id is another client's: the
replay and the stop get 404 "Stream not found or expired" (llama-server's answer to an id it
does not have), the lookup an empty list (its answer when no id matches). What llama-server
refuses whatever the id (a body that is no JSON, no id, another action) goes to it as it is.
Without tenants these routes pass through.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from cacheproxy.errors import ApiError
from cacheproxy.http.app_keys import CACHE, CALLERS
from cacheproxy.http.routes import forward_as_is, read_small_body

CONTROL_ROUTE = "/v1/chat/completions/control"
STREAM_ROUTE = "/v1/stream"
STREAMS_LOOKUP_ROUTE = "/v1/streams/lookup"
CONTROL_ACTION = "reasoning_end"  # the one action llama-server knows
NO_SUCH_COMPLETION = "no active completion for this id"  # llama-server's words for an id it lacks
NO_SUCH_STREAM = "Stream not found or expired"  # server-stream.cpp's


def not_found(message: str) -> ApiError:
    return ApiError(404, message, "not_found_error")


async def control_route(request: web.Request) -> web.StreamResponse:
    caller = request.app[CALLERS].resolve(request.headers)
    body = await read_small_body(request)
    if not caller.tenants_exist or caller.tenant is None:
        return await forward_as_is(request, caller, body)
    try:
        document = orjson.loads(body or b"")
    except orjson.JSONDecodeError:
        document = None
    named = document.get("id") if isinstance(document, dict) else None
    if not named or not isinstance(named, str) or document.get("action") != CONTROL_ACTION:
        return await forward_as_is(request, caller, body)  # refused before any id is read
    tasks = request.app[CACHE].stages.completion_ids.tasks(caller.tenant.id, named)
    if not tasks:  # another tenant's, or nobody's: answered alike, as llama-server answers
        return web.json_response(
            {"success": False, "message": NO_SUCH_COMPLETION},
            dumps=lambda value: orjson.dumps(value).decode(),
        )
    answer: web.StreamResponse | None = None
    for upstream, task_id in tasks:
        named_there = orjson.dumps({**document, "id": task_id})
        answer = await forward_as_is(request, caller, named_there, upstream)
        if _acted(answer):
            break
    assert answer is not None
    return answer


def _acted(answer: web.StreamResponse) -> bool:
    if answer.status != 200 or not isinstance(answer, web.Response):
        return False
    try:
        return orjson.loads(answer.body).get("success") is True  # type: ignore[arg-type]
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return False


async def stream_route(request: web.Request) -> web.StreamResponse:
    """Replay (GET) or stop (DELETE) a stream session by its id."""
    caller = request.app[CALLERS].resolve(request.headers)
    if caller.tenants_exist and request.query.get("conv_id"):
        raise not_found(NO_SUCH_STREAM)  # never a tenant's: see the module's docstring
    return await forward_as_is(request, caller, None)


async def streams_lookup_route(request: web.Request) -> web.StreamResponse:
    caller = request.app[CALLERS].resolve(request.headers)
    body = await read_small_body(request)
    if caller.tenants_exist:
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # llama-server's own 400
        else:
            return web.json_response([], dumps=lambda value: orjson.dumps(value).decode())
    return await forward_as_is(request, caller, body)


def add_control_routes(app: web.Application) -> None:
    """Before the pass-through (routes.py): these are answered here once tenants exist."""
    app.router.add_post(CONTROL_ROUTE, control_route)
    app.router.add_get(STREAM_ROUTE, stream_route)
    app.router.add_delete(STREAM_ROUTE, stream_route)
    app.router.add_post(STREAMS_LOOKUP_ROUTE, streams_lookup_route)
