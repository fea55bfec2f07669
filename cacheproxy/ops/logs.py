"""Logging set-up, and the one line each request leaves: who, where, how much was reused, how long.

Request lines carry numbers and ids only, never prompt text. With `log_format = "json"` every
line is a JSON object (the request fields as keys), ready for a log pipeline.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import orjson

REQUEST_LOG = "cacheproxy.requests"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
        return orjson.dumps(line, default=str).decode()


def configure_logging(level: str, log_format: Literal["text", "json"]) -> None:
    handler = logging.StreamHandler()
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_request(logger: logging.Logger, **fields: Any) -> None:
    """One line per request, `key=value` in text and the same keys in JSON."""
    text = " ".join(f"{key}={value}" for key, value in fields.items())
    logger.info("request %s", text, extra={"fields": fields})
