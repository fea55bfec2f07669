"""llama-server's error envelope, `{"error": {"code", "message", "type"}}`, for all our errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

# llama-server's error types by status (tools/server/server-common.cpp); 413 and 502 are the
# proxy's own statuses and take the closest llama-server type.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    502: "unavailable_error",
    503: "unavailable_error",
    504: "unavailable_error",
}


def error_body(
    status: int, message: str, error_type: str | None = None, fields: dict | None = None
) -> bytes:
    """`fields` are added to the error object, as llama-server adds `n_prompt_tokens` and
    `n_ctx` to an exceed_context_size_error."""
    error_type = error_type or ERROR_TYPES.get(status, "server_error")
    error = {"code": status, "message": message, "type": error_type, **(fields or {})}
    return orjson.dumps({"error": error})


def error_response(
    status: int,
    message: str,
    error_type: str | None = None,
    headers: dict[str, str] | None = None,
    fields: dict | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, error_type, fields),
        content_type="application/json",
        headers=headers,
    )


class ProxyError(Exception):
    """An error the proxy answers itself, in the envelope, with the given status."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
        fields: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.headers = headers
        self.fields = fields


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer `ProxyError` and aiohttp's own errors (404, 413...) in llama-server's envelope."""
    try:
        return await handler(request)
    except ProxyError as exc:
        return error_response(exc.status, exc.message, exc.error_type, exc.headers, exc.fields)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return error_response(exc.status, message, headers=_allow_header(exc))


def _allow_header(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else None
