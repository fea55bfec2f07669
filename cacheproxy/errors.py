"""The one error shape every part of cacheproxy answers with, and the one validation formatter.

`ApiError` is an error in llama-server's envelope, `{"error": {"code", "message", "type"}}`:
the proxy raises it as it is, the embedded engine as its subclass
`EngineError`, both with the same arguments (status, message, type). It needs no web framework,
so the engine's core can raise it without importing aiohttp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from pydantic import ValidationError

# llama-server's error types by status (tools/server/server-common.cpp); 413, 431 and 502 are
# the proxy's own statuses and take the closest llama-server type.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    502: "unavailable_error",
    503: "unavailable_error",
    504: "unavailable_error",
}


def error_type_for(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error")


def error_envelope_body(
    status: int, message: str, error_type: str | None = None, fields: dict | None = None
) -> dict[str, Any]:
    """`fields` are added to the error object, as llama-server adds `n_prompt_tokens` and
    `n_ctx` to an exceed_context_size_error."""
    error_type = error_type or error_type_for(status)
    return {"error": {"code": status, "message": message, "type": error_type, **(fields or {})}}


def error_body(
    status: int, message: str, error_type: str | None = None, fields: dict | None = None
) -> bytes:
    return orjson.dumps(error_envelope_body(status, message, error_type, fields))


class ApiError(Exception):
    """An error answered in llama-server's envelope with `status`; `error_type` defaults to the
    type llama-server gives that status. `headers` go on the answer (e.g. Retry-After), `fields`
    into the error object."""

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
        self.error_type = error_type or error_type_for(status)
        self.headers = headers
        self.fields = fields

    def envelope(self) -> dict[str, Any]:
        return error_envelope_body(self.status, self.message, self.error_type, self.fields)

    def body(self) -> bytes:
        return orjson.dumps(self.envelope())


def describe_validation_error(
    error: ValidationError,
    subject: str,
    *,
    show_input: bool | Callable[[tuple[int | str, ...], Any], str] = False,
    limit: int | None = None,
    one_per_line: bool = False,
    top_level: str = "(top level)",
) -> str:
    """`subject` and each problem as `field.path: message`, on one line or one per line.

    `show_input` adds the value given (settings an operator wrote; never a client's body, which
    may hold a key), or, as a function of the field's location and value, what to say of it
    (so that a secret is never shown); `limit` caps the problems listed, saying how many more
    there are; `top_level` names a problem with the whole document.
    """
    items = error.errors(include_url=False, include_input=bool(show_input))
    problems = []
    for item in items[:limit]:
        where = ".".join(str(part)[:64] for part in item["loc"]) or top_level
        got = ""
        if callable(show_input) and "input" in item:
            got = f" ({show_input(item['loc'], item['input'])})"
        elif show_input and "input" in item:
            got = f" (got {item['input']!r})"
        problems.append(f"{where}: {item['msg']}{got}")
    more = error.error_count() - len(problems)
    if one_per_line:
        heading = f"{subject} ({error.error_count()} problem(s)):"
        return "\n  ".join([heading, *problems, *([f"(and {more} more)"] if more else [])])
    return f"{subject}: " + "; ".join(problems) + (f" (and {more} more)" if more else "")
