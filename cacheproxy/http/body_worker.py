"""What the body parser's worker process runs: kept apart so that the worker imports only
orjson and the pure prompt checks, not aiohttp."""

from __future__ import annotations

from pathlib import Path

from cacheproxy.slots.prompt_bounds import PromptLimits, parse_and_check


def parse_file_and_check(body_path: str, request_path: str, limits: PromptLimits) -> dict:
    """`parse_and_check` on a body the proxy spilled to a file (see BodyParser)."""
    return parse_and_check(Path(body_path).read_bytes(), request_path, limits)
