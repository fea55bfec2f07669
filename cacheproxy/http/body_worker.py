"""What the body parser's worker process runs: kept apart so that the worker imports only
orjson and the pure prompt checks, not aiohttp."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import orjson

from cacheproxy.slots.model_choice import named_model
from cacheproxy.slots.prompt_bounds import PromptLimits, parse_and_check
from cacheproxy.slots.read_fields import leave_in_file

JSON_WHITESPACE = b" \t\r\n"


@dataclass(frozen=True)
class ParsedBody:
    """A spilled body as the proxy keeps it: its document less the big members it does not
    read (slots/read_fields.py), their names, and where the object's closing brace is."""

    document: dict
    left_in_file: frozenset[str]
    object_end: int


def parse_file_and_check(body_path: str, request_path: str, limits: PromptLimits) -> ParsedBody:
    """`parse_and_check` on a body the proxy spilled to a file (see BodyParser), read through
    a mapping of the file rather than a copy of it."""
    with open(body_path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
        with memoryview(m) as body:
            document = parse_and_check(body, request_path, limits)
        end = len(m) - 1
        while m[end] in JSON_WHITESPACE:  # an object parsed: its last other byte is its `}`
            end -= 1
    kept, left = leave_in_file(request_path, document)
    return ParsedBody(kept, left, end)


def model_in_file(body_path: str) -> str | None:
    """The model a spilled body of a route the proxy does not read names (its JSON object's
    `"model"`; None: none, or no JSON object): the upstream it goes to, and whether the tenant
    may use it, depend on it as on a small body's."""
    with open(body_path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            with memoryview(m) as body:
                document = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None  # the upstream answers it as it would
    return named_model(document) if isinstance(document, dict) else None
