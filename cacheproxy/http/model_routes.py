"""Routes by model, beside the task routes (which the request path places by model itself):

- `GET /models` and `GET /v1/models`: every model of every upstream, once, with its status (a
  router says each model's own; a plain server's one model is loaded), as far as the caller's
  tenant may use it. With one upstream and a caller free to use any model, the upstream's own
  answer, as it is.
- Any other request naming a model (`?model=` on a GET, `"model"` in a JSON body, as
  llama-server's router reads them: tools/server/server-models.cpp `proxy_get`, `proxy_post`)
  goes to an upstream serving it, and a tenant's request for a model outside its allow list is
  refused (403) there as on the task routes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from cacheproxy.http.app_keys import CACHE, POOL, SESSION, SETTINGS
from cacheproxy.slots.model_choice import model_not_allowed, named_model, visible_to
from cacheproxy.tenancy.auth import Caller
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.spliced_body import FileBody

READ_TIMEOUT_S = 10.0
# a body past this is not parsed on the event loop for its model: it goes where one naming none
# goes (a router among the upstreams still routes it by its model itself)
MAX_PARSED_BODY_BYTES = 1 << 20


def requested_model(request: web.Request, body: bytes | FileBody | None) -> str | None:
    """The model a request names: `?model=` on a GET, the JSON body's `"model"` on a POST
    (not read from a big body, sent from its spill file)."""
    if request.method in ("GET", "HEAD"):
        model = request.query.get("model")
        return model or None
    if not isinstance(body, bytes) or len(body) > MAX_PARSED_BODY_BYTES:
        return None
    if not body.lstrip().startswith(b"{"):
        return None
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the upstream answers that as it would
    return named_model(document) if isinstance(document, dict) else None


def upstream_for(app: web.Application, caller: Caller, model: str | None) -> Upstream | None:
    """The upstream serving `model` (a router's instance: the router, its model in the
    request); None: the pool's choice, as for a request naming none. Raises 403 for a model
    outside the caller's allow list."""
    if model is None:
        return None
    allowed = caller.allowed_models
    tables = [table for table in app[CACHE].tables if not table.router]
    serving = [table for table in tables if model in table.model_names]
    if allowed is not None and not any(visible_to(t.model_names, allowed) for t in serving):
        raise model_not_allowed(model)
    for table in serving:
        if table.healthy or table.unloaded:
            return table.upstream
    return serving[0].upstream if serving else None


async def merged_model_list(app: web.Application, caller: Caller) -> web.Response | None:
    """The answer to GET /models, /v1/models: every upstream's models, merged, as `caller`
    may see them; None (the upstream's own answer, as it is) with one upstream and a caller
    free to use any model."""
    upstreams = app[POOL].upstreams
    if len(upstreams) == 1 and caller.allowed_models is None:
        return None
    routers = {id(table.upstream) for table in app[CACHE].tables if table.router}
    answers = await asyncio.gather(
        *(_model_list(app, upstream, id(upstream) in routers) for upstream in upstreams)
    )
    merged = merged_models([a for a in answers if a is not None], caller.allowed_models)
    return web.Response(body=orjson.dumps(merged), content_type="application/json")


async def _model_list(app: web.Application, upstream: Upstream, router: bool) -> dict | None:
    """One upstream's list: a router's `GET /models` (every model, with its status), a plain
    server's `GET /v1/models`; None when it does not answer."""
    settings = app[SETTINGS]
    key = settings.upstream_api_key
    headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
    url = upstream.url("/models" if router else "/v1/models")
    timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
    try:
        async with app[SESSION].get(url, headers=headers, timeout=timeout) as answer:
            if answer.status != 200:
                return None
            listed = orjson.loads(await answer.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None
    return listed if isinstance(listed, dict) else None


def merged_models(answers: list[dict], allowed: frozenset[str] | None) -> dict[str, Any]:
    """The upstreams' model lists as one, each model once (by id, the first upstream's entry),
    with a status (a plain server's model is loaded), those outside `allowed` left out."""
    data: list[dict] = []
    seen: set[str] = set()
    kept_names: set[str] = set()
    for answer in answers:
        for entry in answer.get("data") or []:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            aliases = [a for a in entry.get("aliases") or [] if isinstance(a, str)]
            names = frozenset({entry["id"], *aliases})
            if entry["id"] in seen or not visible_to(names, allowed):
                continue
            seen.add(entry["id"])
            kept_names |= names
            data.append({**entry, "status": entry.get("status") or {"value": "loaded"}})
    merged: dict[str, Any] = {"object": "list", "data": data}
    # the Ollama-style list plain servers give beside it, for the models kept
    models = [
        entry
        for answer in answers
        for entry in answer.get("models") or []
        if isinstance(entry, dict) and entry.get("model") in kept_names
    ]
    if models:
        merged["models"] = models
    return merged
