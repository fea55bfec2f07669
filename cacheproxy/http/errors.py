"""llama-server's error envelope, `{"error": {"code", "message", "type"}}`, on aiohttp: the
response, the proxy's own error and the middleware that answers every error in it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from cacheproxy.errors import ApiError, error_body
from cacheproxy.ops.logs import REQUEST_LOG, log_refused

request_log = logging.getLogger(REQUEST_LOG)


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


class ProxyError(ApiError):
    """An error the proxy answers itself, in the envelope, with the given status."""


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer `ApiError`s and aiohttp's own errors (404, 413...) in llama-server's envelope.

    Each leaves one log line and no traceback: they are answers, not failures of the proxy.
    Anything else goes on to aiohttp, which logs it with its traceback (once) and answers 500.
    """
    try:
        return await handler(request)
    except ApiError as exc:
        log_refused(request_log, request.method, request.path, exc.status, exc.message)
        return error_response(exc.status, exc.message, exc.error_type, exc.headers, exc.fields)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        log_refused(request_log, request.method, request.path, exc.status, message)
        return error_response(exc.status, message, headers=_allow_header(exc))


def _allow_header(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else None
