"""HTTP handlers: the same routes as llama-server, each forwarded to an upstream.

Routes whose JSON the cache layer reads (tasks that occupy a slot, slot actions) are checked
here: a malformed body is the client's mistake, a 400 as llama-server answers it. Every other
path and method passes through untouched, so routes this proxy does not read (tokenize, the web
UI, LoRA adapters, resumable streams) behave exactly as llama-server's own.

Once tenants exist, every route but /health needs a tenant's key (401 otherwise), client keys
are never forwarded, and what would show one tenant another's prompts is closed: the slots
(`GET /slots` lists each slot's prompt text; slot actions would save or restore anyone's state),
the metrics and what changes the server for everyone (a router's models, LoRA scales, the
server's tools and MCP proxy), which need the admin key, and the tasks llama-server places
itself (audio transcriptions, `/v1/systemone`), which the proxy could neither isolate nor meter.

`/health` (and `/v1/health`) is the proxy's own answer for a load balancer: 200
`{"status": "ok"}` while at least one upstream can serve, else 503 in llama-server's envelope
(`unavailable_error`: loading, all down, all refused). `/livez` answers 200 while the process
does, whatever the upstreams.

Each handler resolves its caller once, first thing, by its route's rule (`Callers`), and passes
it on: nothing after asks the registry who the request acts for, or whether tenants exist.
"""

from __future__ import annotations

import orjson
from aiohttp import hdrs, web

from cacheproxy.errors import ApiError
from cacheproxy.http.app_keys import (
    ARCHIVE_GAUGES,
    BODY_PARSER,
    CACHE,
    CALLERS,
    METRICS,
    POOL,
    REGISTRY,
    SESSION,
    SETTINGS,
    TASK_SERVICES,
    UPSTREAM_CONNECTIONS,
    UPSTREAM_METRICS,
    TaskServices,
)
from cacheproxy.http.body_parse import BIG_BODY_BYTES, body_chunks
from cacheproxy.http.model_routes import merged_model_list, requested_model, upstream_for
from cacheproxy.slots.admission import InvalidPriority
from cacheproxy.slots.prompt_bounds import PromptLimits
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.shapes import MIRRORED_ROUTES, OPAQUE_ROUTES, STATELESS_ROUTES
from cacheproxy.tenancy.auth import Caller, Callers
from cacheproxy.tenancy.metering import ADMITTED
from cacheproxy.tenancy.registry import Tenant
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.relay import UPSTREAM_TARGET, forward, upstream_errors
from cacheproxy.upstreams.spliced_body import FileBody, SpilledFile, SpilledJson

# POST routes that run a task on a slot: the cache layer must understand their body.
TASK_ROUTES = (*MIRRORED_ROUTES, *OPAQUE_ROUTES, *sorted(STATELESS_ROUTES))
SLOT_ACTION_ROUTE = "/slots/{id_slot}"
HEALTH_PATHS = ("/health", "/v1/health")
LIVENESS_PATH = "/livez"
PUBLIC_PATHS = frozenset({*HEALTH_PATHS, LIVENESS_PATH})
# Routes llama-server runs a task for on a slot it picks itself, which the proxy does not place:
# unseen by the slot table and unmetered, such a task may reuse or overwrite another tenant's
# text (tools/server/server-context.cpp `post_transcriptions_oai`, `post_systemone`).
UNPLACED_TASK_ROUTES = frozenset(
    {"/v1/audio/transcriptions", "/audio/transcriptions", "/v1/systemone"}
)
# Routes that change the server for every tenant or reach past it: the router's models, the
# LoRA adapters' global scales, its global properties (`--props`), the server's own tools
# (files, a shell) and its MCP proxy. Once tenants exist they are the operator's (the admin key).
OPERATOR_ROUTES = frozenset(
    {
        ("POST", "/models"),
        ("DELETE", "/models"),
        ("POST", "/models/load"),
        ("POST", "/models/unload"),
        ("POST", "/lora-adapters"),
        ("POST", "/props"),
        ("GET", "/tools"),
        ("POST", "/tools"),
        ("GET", "/cors-proxy"),
        ("POST", "/cors-proxy"),
    }
)
# the route that changes the LoRA adapters' global scales, which requests naming none run under
ADAPTER_SCALES_ROUTE = ("POST", "/lora-adapters")
OK = b'{"status":"ok"}'


def refuse_for_tenants(caller: Caller, what: str) -> None:
    if caller.tenants_exist:
        raise ApiError(
            403, f"{what} is managed by cacheproxy, not open to tenants", "permission_error"
        )


def parse_json_object(body: bytes) -> dict:
    """The request body as a JSON object, or a 400 in llama-server's envelope."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise ApiError(400, "request body must be a JSON object")
    return document


async def read_small_body(request: web.Request) -> bytes | None:
    """The whole body of a route whose body is a small JSON object the proxy reads (a slot
    action, a control request), held in memory: 413 past 1 MiB (or `max_body_bytes`)."""
    if not request.body_exists:
        return None
    limit = min(request.app[SETTINGS].max_body_bytes, BIG_BODY_BYTES)
    return b"".join([chunk async for chunk in body_chunks(request, limit)])


async def task_route(request: web.Request) -> web.StreamResponse:
    """A task: admitted within the tenant's limits (429 past one), counted in the usage
    ledger whatever its answer, its rate-limit headers on the answer."""
    services = request.app[TASK_SERVICES]
    tracer = services.tracer
    if tracer.enabled:
        with tracer.span("auth"):
            caller = services.callers.resolve(request.headers)
    else:  # off: not even the no-op span and its calls
        caller = services.callers.resolve(request.headers)
    tenant = caller.tenant
    assert tenant is not None  # a keyed route's caller acts for a tenant (else it raised)
    if tracer.enabled:
        tracer.annotate(tenant=tenant.id)
    meter = services.meter
    status = 499  # the client left before any answer: counted as an error
    handed_off = False
    read = None
    try:
        handoff = services.handoff
        if handoff is not None and not handoff.accepts(request, tenant.id):
            # another proxy's conversation goes there whole, before it is admitted here: the
            # owner authenticates, admits and counts it (a hand-off header that is not
            # another proxy's, forged or stale, counts for nothing)
            read = await _read_task(request, services, tenant.id)
            session = request.headers.get(services.settings.routing.session_header)
            owner = handoff.owner(tenant.id, read[1], session)
            if owner is not None and (
                answer := await handoff.send(request, read[0], owner, tenant.id)
            ):
                handed_off = True
                return answer
        admitted = meter.admit(tenant.id)
        if admitted is None:  # limits shared between proxies: this one's allowance ran short
            admitted = await meter.admit_topped_up(tenant.id)
        request[ADMITTED] = (tenant.id, admitted)
        if read is None:
            read = await _read_task(request, services, tenant.id)
        placed = _placed(request, services, caller, tenant, read)
        response = await services.cache.handle(request, placed)
        status = response.status
        return response
    except (ApiError, web.HTTPException) as exc:
        status = exc.status
        raise
    finally:
        if not handed_off:
            meter.record_request(tenant.id, status)
        if read is not None and isinstance(read[0], SpilledJson):
            read[0].close()  # its spill file, and its bytes in the tenant's spill bound


async def _read_task(
    request: web.Request, services: TaskServices, tenant: str
) -> tuple[bytes | SpilledJson, dict, PromptLimits]:
    # ids and id-prompt lengths are checked with the parse, before any other work (a big body
    # is spilled within the tenant's bound and parsed in a worker process: what it refuses
    # never takes this process's memory)
    limits = services.cache.prompt_limits()
    body, document = await services.body_parser.read_task_body(
        request, services.settings.max_body_bytes, request.path, limits, tenant
    )
    return body, document, limits


def _placed(
    request: web.Request,
    services: TaskServices,
    caller: Caller,
    tenant: Tenant,
    read: tuple[bytes | SpilledJson, dict, PromptLimits],
) -> PlacedRequest:
    """The task as the cache layer reads it: its body, its caller (acting for `tenant`), what
    its headers ask."""
    body, document, limits = read
    settings = services.settings
    try:
        share = services.request_limits.of(
            tenant, request.headers.get(settings.scheduling.priority_header)
        )
    except InvalidPriority as exc:
        raise ApiError(400, str(exc)) from None
    return PlacedRequest(
        path=request.path,
        body=body,
        document=document,
        caller=caller,
        tenant=tenant.id,
        session=request.headers.get(settings.routing.session_header),
        checked_with=limits,
        limits=share,
    )


async def metrics_route(request: web.Request) -> web.Response:
    """With one upstream, its own /metrics answer (its 501 without `--metrics`) followed by the
    proxy's families; with several, the proxy's metrics, then every upstream's (from the last
    scheduled scrape), each labelled with the upstream's URL (see upstreams/server_metrics.py).
    A router has no metrics of its own (only its model instances, by `?model=`): asked without
    a model, the proxy's families are the answer."""
    request.app[CALLERS].resolve_operator(request.headers)  # the admin key, once tenants exist
    own, upstreams = request.app[METRICS], request.app[UPSTREAM_METRICS]
    for table in request.app[CACHE].tables:  # read when asked: it moves with every answer
        if table.ram_shadow is not None:
            own.shadow_proven.labels(table.upstream.name).set(table.ram_shadow.proven_bytes)
    if (archive_gauges := request.app.get(ARCHIVE_GAUGES)) is not None:
        await archive_gauges.refresh()
    started = str(own.started_unix)  # when the proxy's counters started
    router_only = "model" not in request.query and any(
        table.router for table in request.app[CACHE].tables
    )
    if not upstreams.live or router_only:
        body = own.render() + upstreams.exposition()
    else:
        upstream = upstreams.upstreams[0]
        with upstream_errors(upstream):
            answer = await upstreams.read_live(request.query_string)
        if answer.status != 200:  # the server's own refusal, as it is
            headers = {"Content-Type": answer.content_type or "application/json"}
            return web.Response(status=answer.status, body=answer.body, headers=headers)
        body = answer.body.rstrip(b"\n") + b"\n" + own.render()
        started = answer.process_start or started  # the server's, as it sends it
    headers = {
        "Content-Type": "text/plain; version=0.0.4",
        "Process-Start-Time-Unix": started,
    }
    return web.Response(body=body, headers=headers)


async def slot_action_route(request: web.Request) -> web.StreamResponse:
    caller = request.app[CALLERS].resolve(request.headers)
    refuse_for_tenants(caller, "slot save, restore and erase")
    body = await read_small_body(request)
    if body:  # erase takes no body; save and restore name a file in a JSON object
        parse_json_object(body)
    upstream = upstream_of(request, caller, requested_model(request, body))
    response = await forward_as_is(request, caller, body, upstream)
    slot_id, action = request.match_info["id_slot"], request.query.get("action")
    if response.status == 200 and slot_id.isdigit() and isinstance(response, web.Response):
        # a restore or an erase changes what the slot holds behind the table's back
        for table in request.app[CACHE].tables:
            if table.upstream is upstream:
                table.after_slot_action(int(slot_id), action, response.body)
    return response


async def health_route(request: web.Request) -> web.Response:
    """200 while an upstream can serve a task, else llama-server's 503 saying why."""
    caller = request.app[CALLERS].resolve_open()  # open to all, as llama-server's
    unavailable = await request.app[CACHE].unavailable(caller.tenants_exist)
    if unavailable is not None:
        raise unavailable
    return web.Response(body=OK, content_type="application/json")


async def liveness_route(request: web.Request) -> web.Response:
    """The proxy's process answers: 200, whatever its upstreams."""
    return web.Response(body=OK, content_type="application/json")


async def slots_route(request: web.Request) -> web.StreamResponse:
    caller = request.app[CALLERS].resolve(request.headers)
    refuse_for_tenants(caller, "GET /slots")
    return await forward_as_is(request, caller, None)


async def models_route(request: web.Request) -> web.StreamResponse:
    """GET /models, /v1/models: every upstream's models, as the caller may use them."""
    caller = request.app[CALLERS].resolve(request.headers)
    merged = await merged_model_list(request.app, caller)
    return merged if merged is not None else await forward_as_is(request, caller, None)


async def pass_through(request: web.Request) -> web.StreamResponse:
    caller = pass_through_caller(request)
    # a big body is spilled within the caller's bounds and sent from its file, never held here
    app = request.app
    limit = app[SETTINGS].max_body_bytes
    tenant = caller.tenant.id if caller.tenant is not None else ""
    body, named = await app[BODY_PARSER].read_body(request, limit, tenant)
    try:
        # a big body's model, read from its file: held to the tenant's models as any
        model = named if isinstance(body, SpilledFile) else requested_model(request, body)
        upstream = upstream_of(request, caller, model)
        response = await forward_as_is(request, caller, body, upstream)
        cache = app.get(CACHE)
        if (request.method, path_of(request)) == ADAPTER_SCALES_ROUTE and cache is not None:
            if response.status < 300:
                await cache.monitor.adapters_changed(upstream)
        return response
    finally:
        if isinstance(body, SpilledFile):
            body.close()


def path_of(request: web.Request) -> str:
    """The request's path as it is forwarded (canonical)."""
    return request[UPSTREAM_TARGET].partition("?")[0]


def pass_through_caller(request: web.Request) -> Caller:
    """Who a request on a route the proxy does not read acts for, by its path as forwarded
    (canonical): refused with a 403 where tenants exist and the route is not theirs."""
    callers = request.app[CALLERS]
    path = path_of(request)
    # a CORS preflight carries no key (browsers send none): llama-server answers it before any
    # key check with its CORS headers and no data (tools/server/server-http.cpp, pre-routing)
    if path in PUBLIC_PATHS or request.method == hdrs.METH_OPTIONS:
        return callers.resolve_open()
    if (request.method, path) in OPERATOR_ROUTES:
        try:
            return callers.resolve_operator(request.headers)
        except ApiError:
            caller = callers.resolve(request.headers)  # a bad key: 401, as anywhere
            what = f"{request.method} {path} changes the server for every tenant"
            raise ApiError(
                403, f"{what}: it is the operator's (the admin key)", "permission_error"
            ) from None
    caller = callers.resolve(request.headers)
    if path in UNPLACED_TASK_ROUTES and caller.tenants_exist:
        raise ApiError(
            403,
            f"{path} runs a task on a slot llama-server picks itself, which cacheproxy cannot"
            " isolate from other tenants' text or meter: not open to tenants",
            "permission_error",
        )
    return caller


def upstream_of(request: web.Request, caller: Caller, model: str | None) -> Upstream:
    """The upstream serving `model` (403 for a model outside the caller's list), else the
    pool's pick."""
    return upstream_for(request.app, caller, model) or request.app[POOL].pick()


async def forward_as_is(
    request: web.Request,
    caller: Caller,
    body: bytes | FileBody | None,
    upstream: Upstream | None = None,
) -> web.StreamResponse:
    """The request, with `body`, to `upstream` (else the pool's pick), its answer relayed."""
    app = request.app
    if upstream is None:  # one serving the model it names, if it names one
        upstream = upstream_of(request, caller, requested_model(request, body))
    key = app[SETTINGS].upstream_api_key
    secret = key.get_secret_value() if key else None
    return await forward(
        request,
        app[SESSION],
        upstream,
        body,
        secret,
        forward_client_key=caller.forward_client_key,
        connections=app[UPSTREAM_CONNECTIONS],
    )


async def _collect_task_services(app: web.Application) -> None:
    # once every context has started
    settings = app[SETTINGS]
    app[CALLERS] = Callers(app[REGISTRY], settings.single_user_keys, settings.tenants.admin_api_key)
    app[TASK_SERVICES] = TaskServices.of(app)


def add_routes(app: web.Application) -> None:
    app.on_startup.append(_collect_task_services)
    for path in TASK_ROUTES:
        app.router.add_post(path, task_route)
    app.router.add_post(SLOT_ACTION_ROUTE, slot_action_route)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/slots", slots_route)
    app.router.add_get("/models", models_route)
    app.router.add_get("/v1/models", models_route)
    for path in HEALTH_PATHS:
        app.router.add_get(path, health_route)
    app.router.add_get(LIVENESS_PATH, liveness_route)
    app.router.add_route("*", "/{tail:.*}", pass_through)
