"""The admin API under /admin/: tenants, their keys and quotas, public prefixes, usage figures.

It is a sub-application, so its own middlewares guard every path under /admin/ (unknown ones
included) and nothing under /admin/ ever falls through to the upstream. Every answer the admin
API gives itself, errors included, is in llama-server's envelope; client input never causes a 500.

Auth: the admin key (`tenants.admin_api_key`) in `Authorization: Bearer ...` or `X-Api-Key`; else
401 "Invalid API Key", before routing, so unknown paths tell nothing either. With no admin key
configured every /admin/ path answers 403 `permission_error`, as llama-server answers for a
feature it was started without.

| method | path                               | body                         | answer          |
|--------|------------------------------------|------------------------------|-----------------|
| POST   | /admin/tenants                     | TenantCreate                 | 201 tenant+key  |
| GET    | /admin/tenants                     |                              | 200 tenants     |
| GET    | /admin/tenants/{id}                |                              | 200 tenant+keys |
| PATCH  | /admin/tenants/{id}                | TenantPatch                  | 200 tenant      |
| POST   | /admin/tenants/{id}/rotate-key     | none or {}                   | 200 tenant+key  |
| GET    | /admin/tenants/{id}/usage          |                              | 200 usage       |
| GET    | /admin/tenants/{id}/limits         |                              | 200 limits      |
| PATCH  | /admin/tenants/{id}/limits         | LimitsPatch                  | 200 limits      |
| GET    | /admin/usage (`?tenant=&from=&to=&group_by=`) |                   | 200 ledger rows |
| POST   | /admin/public-prefixes             | PublicPrefixCreate           | 201 prefix      |
| GET    | /admin/public-prefixes             |                              | 200 prefixes    |
| GET    | /admin/public-prefixes/{id}        |                              | 200 prefix      |
| DELETE | /admin/public-prefixes/{id}        |                              | 204             |
| GET    | /admin/archives (`?tenant_id=`)    |                              | 200 archives    |
| DELETE | /admin/archives/{id}               |                              | 204             |
| GET    | /admin/dashboard (also `?key=`)    |                              | 200 HTML page   |
| GET    | /admin/state (also `?key=`)        |                              | 200 state       |
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    ValidationError,
)

from cacheproxy.db.connection import DATABASE_ERRORS, is_lock_timeout
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.errors import ApiError, describe_validation_error
from cacheproxy.http.app_keys import ARCHIVES, METER, REGISTRY, SETTINGS, USAGE
from cacheproxy.http.dashboard import add_dashboard, admin_credentials
from cacheproxy.tenancy.auth import check_admin_key
from cacheproxy.tenancy.limits import Limits
from cacheproxy.tenancy.registry import (
    DEFAULT_TENANT,
    DuplicateName,
    TenantRegistry,
    UnknownPublicPrefix,
    UnknownTenant,
)
from cacheproxy.tenancy.registry_records import (
    MAX_MODEL_NAME_CHARS,
    MAX_MODELS,
    MAX_PUBLIC_PREFIX_TOKENS,
    MAX_QUOTA,
    MAX_TOKEN_ID,
    MAX_WEIGHT,
    InvalidField,
    PublicPrefix,
    tenant_summary,
)
from cacheproxy.tenancy.usage import GROUPINGS, aggregate, parse_time

# A public prefix of MAX_PUBLIC_PREFIX_TOKENS ids fits; nothing else comes close.
ADMIN_MAX_BODY_BYTES = 4 << 20
MAX_PROBLEMS_SHOWN = 5

Name = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
Quota = Annotated[int, Field(ge=0, le=MAX_QUOTA)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Weight = Annotated[float, Field(gt=0, le=MAX_WEIGHT)]
Bound = Annotated[int, Field(ge=1, le=MAX_QUOTA)]
PriorityClass = Literal["interactive", "batch"]
ModelName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_MODEL_NAME_CHARS)]
# a tenant's allow list of models (null: any model)
Models = Annotated[list[ModelName], Field(max_length=MAX_MODELS)]


class _Body(BaseModel):
    # strict: 1 is not true, "5" is not 5; unknown fields are mistakes, not ignored
    model_config = ConfigDict(extra="forbid", strict=True)


BodyModel = TypeVar("BodyModel", bound=_Body)


class TenantCreate(_Body):
    name: Name
    quota_bytes: Quota | None = None
    quota_archives: Quota | None = None
    hide_cache_signals: bool = False
    may_use_public_prefixes: bool = True
    weight: Weight = 1.0
    max_queued: Bound | None = None
    max_concurrent: Bound | None = None
    max_priority: PriorityClass = "interactive"
    models: Models | None = None


class TenantPatch(_Body):
    # Only the fields given are changed. null clears a quota; for the others the registry
    # refuses it (400), since a tenant without a name or a flag is not a thing.
    name: Name | None = None
    disabled: bool | None = None
    hide_cache_signals: bool | None = None
    may_use_public_prefixes: bool | None = None
    quota_bytes: Quota | None = None
    quota_archives: Quota | None = None
    # fair share: null sets a bound back to the scheduling settings' default
    weight: Weight | None = None
    max_queued: Bound | None = None
    max_concurrent: Bound | None = None
    max_priority: PriorityClass | None = None
    # null: any model again
    models: Models | None = None


class RotateKey(_Body):
    pass


class LimitsPatch(_Body):
    # only the limits given change; null: the default (settings' [limits]) applies again
    requests_per_minute: Quota | None = None
    prompt_tokens_per_minute: Quota | None = None
    generated_tokens_per_minute: Quota | None = None
    tokens_per_day: Quota | None = None
    tokens_per_month: Quota | None = None


class PublicPrefixCreate(_Body):
    name: Name
    tokens: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PUBLIC_PREFIX_TOKENS)]


def add_admin_routes(app: web.Application) -> None:
    """Mount the admin API at /admin on `app` (whose SETTINGS are already set).

    aiohttp resolves the most specific prefix first, so /admin/... reaches this sub-app and never
    the pass-through catch-all. The registry comes from `app[REGISTRY]` (the app's cleanup context
    opens it), the usage figures from `app[USAGE]`.
    """
    admin_key = app[SETTINGS].tenants.admin_api_key
    admin = web.Application(middlewares=[_require_admin_key(admin_key), _registry_errors])
    admin.router.add_post("/tenants", create_tenant)
    admin.router.add_get("/tenants", list_tenants)
    admin.router.add_get("/tenants/{tenant_id}", get_tenant)
    admin.router.add_patch("/tenants/{tenant_id}", patch_tenant)
    admin.router.add_post("/tenants/{tenant_id}/rotate-key", rotate_key)
    admin.router.add_get("/tenants/{tenant_id}/usage", tenant_usage)
    admin.router.add_get("/tenants/{tenant_id}/limits", get_limits)
    admin.router.add_patch("/tenants/{tenant_id}/limits", patch_limits)
    admin.router.add_get("/usage", usage_ledger)
    admin.router.add_post("/public-prefixes", add_public_prefix)
    admin.router.add_get("/public-prefixes", list_public_prefixes)
    admin.router.add_get("/public-prefixes/{prefix_id}", get_public_prefix)
    admin.router.add_delete("/public-prefixes/{prefix_id}", delete_public_prefix)
    admin.router.add_get("/archives", list_archives)
    admin.router.add_delete("/archives/{archive_id}", delete_archive)
    add_dashboard(app, admin)  # /dashboard, /state, and the reuse sampler on `app`
    app.add_subapp("/admin", admin)


# -- handlers ------------------------------------------------------------------------------


async def create_tenant(request: web.Request) -> web.Response:
    body = await _parse(request, TenantCreate)
    registry = _registry(request)
    tenant, api_key = await registry.acreate(**body.model_dump())
    return _json(
        {"tenant": tenant_summary(tenant, registry.key_prefix(tenant.id)), "api_key": api_key},
        status=201,
        headers={"Location": f"/admin/tenants/{tenant.id}"},
    )


async def list_tenants(request: web.Request) -> web.Response:
    registry = _registry(request)
    return _json(
        {"tenants": [tenant_summary(t, registry.key_prefix(t.id)) for t in registry.list()]}
    )


async def get_tenant(request: web.Request) -> web.Response:
    registry = _registry(request)
    tenant = registry.get(request.match_info["tenant_id"])
    return _json(
        {
            **tenant_summary(tenant, registry.key_prefix(tenant.id)),
            "keys": await registry.aapi_keys(tenant.id),
        }
    )


async def patch_tenant(request: web.Request) -> web.Response:
    body = await _parse(request, TenantPatch)
    changes = body.model_dump(include=body.model_fields_set)
    if not changes:
        raise ApiError(400, f"nothing to change: give any of {', '.join(TenantPatch.model_fields)}")
    registry = _registry(request)
    tenant = await registry.aupdate(request.match_info["tenant_id"], **changes)
    return _json(tenant_summary(tenant, registry.key_prefix(tenant.id)))


async def rotate_key(request: web.Request) -> web.Response:
    await _parse(request, RotateKey, optional=True)
    registry = _registry(request)
    tenant_id = request.match_info["tenant_id"]
    api_key = await registry.arotate_key(tenant_id)
    tenant = registry.get(tenant_id)
    return _json(
        {"tenant": tenant_summary(tenant, registry.key_prefix(tenant_id)), "api_key": api_key}
    )


async def tenant_usage(request: web.Request) -> web.Response:
    tenant_id = request.match_info["tenant_id"]
    if tenant_id != DEFAULT_TENANT.id:  # the default tenant has figures too, while it serves
        _registry(request).get(tenant_id)
    figures = request.config_dict[USAGE](tenant_id)
    return _json({"tenant_id": tenant_id, "usage": figures})


def _limits_json(request: web.Request, tenant_id: str) -> dict[str, Any]:
    own = _registry(request).limits(tenant_id)
    defaults = Limits(**request.config_dict[SETTINGS].limits.model_dump())
    return {
        "tenant_id": tenant_id,
        "limits": own.as_dict(),  # the tenant's own (null: the default applies)
        "effective": own.over(defaults).as_dict(),
    }


async def get_limits(request: web.Request) -> web.Response:
    tenant_id = request.match_info["tenant_id"]
    _registry(request).get(tenant_id)
    return _json(_limits_json(request, tenant_id))


async def patch_limits(request: web.Request) -> web.Response:
    body = await _parse(request, LimitsPatch)
    changes = body.model_dump(include=body.model_fields_set)
    if not changes:
        raise ApiError(400, f"nothing to change: give any of {', '.join(LimitsPatch.model_fields)}")
    tenant_id = request.match_info["tenant_id"]
    await _registry(request).aset_limits(tenant_id, **changes)
    return _json(_limits_json(request, tenant_id))


async def usage_ledger(request: web.Request) -> web.Response:
    """The usage ledger (`?tenant=ID&from=&to=&group_by=hour|day|month|tenant`, `&by=model`
    per model as well; from and to as ISO 8601 dates or times, UTC unless they say otherwise,
    or Unix seconds; `to` exclusive), written batches and what is counted but not yet written
    alike."""
    query = request.query
    group_by = query.get("group_by", "hour")
    if group_by not in GROUPINGS:
        raise ApiError(400, f"group_by must be one of {', '.join(GROUPINGS)}")
    try:
        start = parse_time(query["from"]) if query.get("from") else None
        end = parse_time(query["to"]) if query.get("to") else None
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    by_model = query.get("by") == "model"
    meter = request.config_dict[METER]
    rows = await meter.rows(query.get("tenant") or None, start, end, by_model)
    grouped = aggregate(rows, group_by, by_model)  # type: ignore[arg-type]
    return _json({"group_by": group_by, "from": start, "to": end, "rows": grouped})


async def add_public_prefix(request: web.Request) -> web.Response:
    body = await _parse(request, PublicPrefixCreate)
    prefix = await _registry(request).aadd_public_prefix(body.name, body.tokens)
    return _json(
        _prefix_json(prefix, with_tokens=True),
        status=201,
        headers={"Location": f"/admin/public-prefixes/{prefix.id}"},
    )


async def list_public_prefixes(request: web.Request) -> web.Response:
    # ids and sizes only: the tokens of every prefix at once could be megabytes
    prefixes = _registry(request).public_prefixes()
    return _json({"public_prefixes": [_prefix_json(p, with_tokens=False) for p in prefixes]})


async def get_public_prefix(request: web.Request) -> web.Response:
    prefix = _registry(request).public_prefix(request.match_info["prefix_id"])
    return _json(_prefix_json(prefix, with_tokens=True))


async def delete_public_prefix(request: web.Request) -> web.Response:
    prefix_id = request.match_info["prefix_id"]
    await _registry(request).aremove_public_prefix(prefix_id)
    return web.Response(status=204)


async def list_archives(request: web.Request) -> web.Response:
    """Archived slot states, oldest first (`?tenant_id=` for one tenant's), and their totals."""
    store = _archive_store(request)
    tenant_id = request.query.get("tenant_id")
    return _json(await store.listing(tenant_id))


async def delete_archive(request: web.Request) -> web.Response:
    archive_id = request.match_info["archive_id"]
    if not await _archive_store(request).remove(archive_id):
        raise ApiError(404, f"no archive with id {archive_id[:64]!r}")
    return web.Response(status=204)


# -- middlewares ---------------------------------------------------------------------------


def _require_admin_key(admin_key: SecretStr | None) -> Middleware:
    @web.middleware
    async def require_admin_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        # the dashboard's two routes may carry the key as ?key= (a browser navigation cannot
        # send a header); every other path reads headers only
        check_admin_key(admin_credentials(request), admin_key)
        return await handler(request)

    return require_admin_key


@web.middleware
async def _registry_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The registry's refusals as 4xx; a database another process keeps locked as 503."""
    try:
        return await handler(request)
    except (UnknownTenant, UnknownPublicPrefix) as exc:
        raise ApiError(404, str(exc)) from exc
    except DuplicateName as exc:
        raise ApiError(409, str(exc), "invalid_request_error") from exc
    except InvalidField as exc:
        raise ApiError(400, str(exc)) from exc
    except DATABASE_ERRORS as exc:
        if not is_lock_timeout(exc) and "busy" not in str(exc):
            raise
        raise ApiError(
            503, "the tenant database is busy; try again", headers={"Retry-After": "1"}
        ) from exc


# -- helpers -------------------------------------------------------------------------------


def _registry(request: web.Request) -> TenantRegistry:
    """The registry; its reads answer from memory (re-read off the loop by the app's
    middleware), its changes and key listings are its async twins (on its worker thread)."""
    return request.config_dict[REGISTRY]


def _archive_store(request: web.Request) -> ArchiveStore:
    store = request.config_dict.get(ARCHIVES)
    if store is None:
        # llama-server's answer for a feature the server was started without
        raise ApiError(501, "the disk tier is off (disk.enabled = false)", "not_supported_error")
    return store


async def _read_bounded(request: web.Request, limit: int) -> bytes:
    """The body, refusing (413) more than `limit` bytes whether or not Content-Length says so."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"admin request bodies are limited to {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(64 << 10):
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"admin request bodies are limited to {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: web.Request, model: type[BodyModel], optional: bool = False) -> BodyModel:
    body = await _read_bounded(request, ADMIN_MAX_BODY_BYTES)
    if optional and not body.strip():
        return model()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        # the body may hold a key: its values are never echoed
        message = describe_validation_error(
            exc, "invalid request body", limit=MAX_PROBLEMS_SHOWN, top_level="body"
        )
        raise ApiError(400, message) from exc


def _prefix_json(prefix: PublicPrefix, with_tokens: bool) -> dict[str, Any]:
    figures: dict[str, Any] = {"id": prefix.id, "name": prefix.name, "n_tokens": len(prefix.tokens)}
    if with_tokens:
        figures["tokens"] = prefix.tokens
    return figures


def _json(
    document: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(document),
        content_type="application/json",
        # answers may carry a freshly issued key: no cache along the way may keep one
        headers={"Cache-Control": "no-store", **(headers or {})},
    )
