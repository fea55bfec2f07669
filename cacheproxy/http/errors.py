"""llama-server's error envelope, `{"error": {"code", "message", "type"}}`, on aiohttp: the
response, the proxy's own error, and the answers the front door (`http/front_door.py`) gives
every error in it: `ApiError`s and aiohttp's own errors (404, 413...).

Each leaves one log line and no traceback: they are answers, not failures of the proxy. Anything
else goes on to aiohttp, which logs it with its traceback (once) and answers 500."""

from __future__ import annotations

import logging

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


def refused(request: web.Request, status: int, message: str) -> None:
    """The log line of a request answered with an error."""
    log_refused(request_log, request.method, request.path, status, message)


def api_error_response(request: web.Request, exc: ApiError) -> web.Response:
    """The proxy's own error, logged and in the envelope."""
    refused(request, exc.status, exc.message)
    return error_response(exc.status, exc.message, exc.error_type, exc.headers, exc.fields)


def http_exception_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own error (a status of 400 or more), logged and in the envelope."""
    message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
    refused(request, exc.status, message)
    return error_response(exc.status, message, headers=_allow_header(exc))


def _allow_header(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else None
