"""Logging set-up, and the one line each request leaves: who, where, how much was reused, how long.

Request lines carry numbers and ids only, never prompt text. With `log_format = "json"` every
line is a JSON object (the request fields as keys), ready for a log pipeline.

No line carries a secret: paths are logged without their query (the dashboard takes its key as
`?key=`), and every line is passed through `redact_secrets` on its way out as a last guard, so a
key that a library puts in a message (a URL, a header, a command line) is masked too. A client's
mistake (a 4xx, malformed HTTP included) is one line without a traceback; an unexpected error
keeps its one traceback.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Literal

import orjson
from aiohttp.http_exceptions import HttpProcessingError

REQUEST_LOG = "cacheproxy.requests"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REDACTED = "***"
# aiohttp's logger for errors it answers itself (malformed HTTP, handler exceptions)
AIOHTTP_SERVER_LOG = "aiohttp.server"

_SECRET_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # ?key=..., &api_key=..., ?access_token=... in any URL or query string
    (
        re.compile(
            r"([?&;](?:[\w.-]*[_-])?(?:key|apikey|token|secret|password|passwd|sig|signature)"
            r"=)[^&;\s\"'<>]+",
            re.IGNORECASE,
        ),
        r"\1" + REDACTED,
    ),
    # Authorization: Bearer ..., Basic ..., and a bare header value after X-Api-Key
    (re.compile(r"\b(Bearer|Basic)\s+[^\s\"',;]+", re.IGNORECASE), r"\1 " + REDACTED),
    (re.compile(r"(X-Api-Key['\"]?\s*[:=,]\s*['\"]?)[^\s\"',;]+", re.IGNORECASE), r"\1" + REDACTED),
    # --api-key VALUE or --api-key=VALUE on a logged command line
    (re.compile(r"(--api-key(?:\s+|=))(?!-)\S+"), r"\1" + REDACTED),
    # user:password@ in a URL
    (
        re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+@", re.IGNORECASE),
        r"\1" + REDACTED + "@",
    ),
)


def redact_secrets(text: str) -> str:
    """`text` with keys, tokens and passwords it carries (in URLs, headers, flags) masked."""
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return redact_secrets(orjson.dumps(line, default=str).decode())


class ClientErrorsWithoutTraceback(logging.Filter):
    """aiohttp logs a request it could not even parse (a bad request line, a broken header,
    a malformed chunked body) with a full traceback, though it is the client's mistake and
    answered 400: keep it to one line naming the error."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and 400 <= error.code < 500:
            # aiohttp's message spans lines (the bad bytes, a caret under them): one line here
            record.msg = f"{record.getMessage()}: {error.code} {' '.join(error.message.split())}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def configure_logging(level: str, log_format: Literal["text", "json"]) -> None:
    handler = logging.StreamHandler()
    formatter = JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    server_log = logging.getLogger(AIOHTTP_SERVER_LOG)
    if not any(isinstance(f, ClientErrorsWithoutTraceback) for f in server_log.filters):
        server_log.addFilter(ClientErrorsWithoutTraceback())


def log_request(logger: logging.Logger, **fields: Any) -> None:
    """One line per request, `key=value` in text and the same keys in JSON."""
    if not logger.isEnabledFor(logging.INFO):
        return  # nothing formatted for a line nobody reads
    text = " ".join(f"{key}={value}" for key, value in fields.items())
    logger.info("request %s", text, extra={"fields": fields})


def log_refused(logger: logging.Logger, method: str, path: str, status: int, message: str) -> None:
    """One line for a request the proxy answered with an error: no traceback, and the path
    without its query string (where a dashboard key may be)."""
    fields = {"method": method, "path": path, "status": status, "error": message}
    level = logging.WARNING if status >= 500 else logging.INFO
    logger.log(
        level, "refused %s %s %d: %s", method, path, status, message, extra={"fields": fields}
    )
