"""The top-level members of a task body the proxy reads, by route; of a big body, what else it
holds stays in the file the body was spilled to, and is forwarded from there.

Every value under LEFT_IN_FILE_BYTES (as JSON) is kept, whatever its name: flags, counts, ids
and the like are read as they are. A bigger value is kept only when the proxy reads it on that
route: the prompt-bearing members (their ids are checked, their tokens mirrored, their start
hashed for the cluster's hand-off) and, on chat routes, what llama-server's chat parser reads
(the mirror sends the body to `/apply-template`). Any other big member (a client's own field,
a big grammar on a completion) is the server's alone to read.

Pure and free of aiohttp, for the body parser's worker process.
"""

from __future__ import annotations

from typing import Any

import orjson

from cacheproxy.slots.prompt_bounds import COMPLETION_ROUTES, EMBEDDING_ROUTES, INFILL_ROUTE

LEFT_IN_FILE_BYTES = 64 << 10

# oaicompat_chat_params_parse (tools/server/server-common.cpp) reads these before it copies
# every member through to the task's parameters
CHAT_PARSER_FIELDS = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stop",
        "json_schema",
        "grammar",
        "response_format",
        "add_generation_prompt",
        "continue_final_message",
        "reasoning_format",
        "reasoning_effort",
        "reasoning_budget_tokens",
        "thinking_budget_tokens",
        "reasoning_budget_message",
        "reasoning_control",
        "chat_template_kwargs",
        "logprobs",
        "top_logprobs",
    }
)
CHAT_ROUTES = frozenset({"/chat/completions", "/v1/chat/completions"})
# routes whose tasks reuse nothing and whose body the proxy forwards as it is
RERANK_ROUTES = frozenset({"/rerank", "/reranking", "/v1/rerank", "/v1/reranking"})


def fields_read(path: str) -> frozenset[str] | None:
    """The big members the proxy reads on `path`; None: all of them (a body the proxy converts
    whole: an Anthropic or Responses body, or a route not named here)."""
    if path in COMPLETION_ROUTES:
        return frozenset({"prompt"})
    if path == INFILL_ROUTE:
        return frozenset({"prompt", "input_prefix", "input_suffix", "input_extra"})
    if path in EMBEDDING_ROUTES:
        return frozenset({"input", "content"})
    if path in CHAT_ROUTES:
        return CHAT_PARSER_FIELDS
    if path in RERANK_ROUTES:
        return frozenset()
    return None


def leave_in_file(path: str, document: dict) -> tuple[dict, frozenset[str]]:
    """`document` without the big members the proxy does not read on `path`, and their names."""
    read = fields_read(path)
    if read is None:
        return document, frozenset()
    left = frozenset(key for key, value in document.items() if key not in read and _is_big(value))
    if not left:
        return document, left
    return {key: value for key, value in document.items() if key not in left}, left


def _is_big(value: Any) -> bool:
    if isinstance(value, str):  # at least a byte a character: no copy made to tell
        return len(value) >= LEFT_IN_FILE_BYTES
    if isinstance(value, list | dict):
        return len(orjson.dumps(value)) >= LEFT_IN_FILE_BYTES
    return False
