"""What a task body may carry before the proxy does any work on it: valid token ids, and
prompts that fit the largest slot's context. Pure: no I/O, so a worker process can run it.

llama-server reads token ids wherever a prompt may be given as ids (`tokenize_input_prompts`,
`tokenize_mixed`): a prompt is a string, an id array, a mixed array of strings and ids, or an
object with `prompt_string`; an array holding no id at its top level is a batch of such prompts.
Ids outside `[0, n_vocab)` are refused at slot launch with 400 "Prompt contains invalid tokens";
the proxy refuses them (and floats, booleans, nested arrays where an id belongs) before hashing,
routing or forwarding anything, with the same answer.

A prompt of `n` tokens on a slot of `n_ctx` is refused by llama-server when `n >= n_ctx`
(`exceed_context_size_error`, with `n_prompt_tokens` and `n_ctx` in the error). Id arrays are
counted here. Text gets two cheap bounds: a floor (no token is longer than MAX_TOKEN_BYTES), which
refuses a text far too long before llama-server spends minutes tokenizing it, and a ceiling (no
string has more tokens than bytes plus specials), which spares the mirror's exact count after
tokenizing for texts that fit anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from cacheproxy.errors import ApiError

INVALID_TOKENS = "Prompt contains invalid tokens"  # tools/server/server-context.cpp, launch_slot
INVALID_REQUEST = "invalid_request_error"
EXCEED_CONTEXT = "exceed_context_size_error"
# BOS, EOS and the like a tokenizer may add around a text, beyond one token per byte
SPECIAL_TOKENS_MARGIN = 4
# No token is longer: the longest in every vocabulary of the pinned llama.cpp tree
# (models/ggml-vocab-*.gguf) is 1024 bytes as stored (gpt-neox, mpt, command-r, aquila).
MAX_TOKEN_BYTES = 1024
# llama_token is int32: anything past it is no id, whatever the vocabulary
TOKEN_ID_LIMIT = 2**31

COMPLETION_ROUTES = frozenset({"/completion", "/completions", "/v1/completions"})
EMBEDDING_ROUTES = frozenset({"/embedding", "/embeddings", "/v1/embeddings"})
INFILL_ROUTE = "/infill"


@dataclass(frozen=True)
class PromptLimits:
    """What the upstreams accept; None where it is not known (nothing is checked against it)."""

    n_vocab: int | None = None
    n_ctx: int | None = None  # the largest slot context of any upstream

    @property
    def id_limit(self) -> int:
        return self.n_vocab if self.n_vocab is not None else TOKEN_ID_LIMIT


class RequestRejected(Exception):
    """A request llama-server would refuse; answered 400 in its envelope, with `fields` added
    to the error object (`n_prompt_tokens`, `n_ctx` for a prompt over the context)."""

    def __init__(
        self, message: str, error_type: str = INVALID_REQUEST, fields: dict | None = None
    ) -> None:
        super().__init__(message, error_type, fields)  # all args: it must pickle across processes
        self.message = message
        self.error_type = error_type
        self.fields = fields or {}

    def as_api_error(self) -> ApiError:
        """The answer: a 400 in llama-server's envelope."""
        return ApiError(400, self.message, self.error_type, fields=self.fields)


def exceeds_context(n_prompt_tokens: int, n_ctx: int, at_least: bool = False) -> RequestRejected:
    """llama-server's answer to a prompt that does not fit a slot (update_slots)."""
    count = f"at least {n_prompt_tokens}" if at_least else str(n_prompt_tokens)
    return RequestRejected(
        f"request ({count} tokens) exceeds the available context size ({n_ctx} tokens),"
        " try increasing it",
        EXCEED_CONTEXT,
        {"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx},
    )


def text_token_ceiling(text: str) -> int:
    """At most this many tokens: one per UTF-8 byte (at most 4 per character) plus specials."""
    return 4 * len(text) + SPECIAL_TOKENS_MARGIN


def parse_and_check(body: bytes | memoryview, path: str, limits: PromptLimits) -> dict:
    """The body as a JSON object whose prompts passed `check_task_body`; raise RequestRejected.

    Module-level and free of aiohttp, so that a worker process can run it on a big body.
    """
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # not the exception itself: it holds the whole body, and crosses a process boundary
        raise RequestRejected(f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise RequestRejected("request body must be a JSON object")
    check_task_body(path, document, limits)
    return document


def check_task_body(path: str, document: dict, limits: PromptLimits) -> None:
    """Raise RequestRejected for invalid ids anywhere a prompt may carry them, and for a
    completion prompt that cannot fit any slot (exactly for ids, by a floor for text)."""
    if path in COMPLETION_ROUTES:
        prompts = _subprompts(document.get("prompt"))
        for single in prompts:  # every prompt's ids first, as llama-server checks them
            _check_ids(single, limits)
        if limits.n_ctx:
            for single in prompts:
                _check_fits(single, limits.n_ctx)
        return
    for value in _id_bearing_fields(path, document):
        for single in _subprompts(value):
            _check_ids(single, limits)
    if path == INFILL_ROUTE:
        _check_input_extra(document.get("input_extra"))


def _check_fits(prompt: Any, n_ctx: int) -> None:
    if isinstance(prompt, list) and set(map(type, prompt)) == {int}:
        if len(prompt) >= n_ctx:
            raise exceeds_context(len(prompt), n_ctx)
        return
    floor = _token_floor(prompt)
    if floor >= n_ctx:
        # text too long to be worth tokenizing (llama-server takes minutes over 90 MB): the
        # count is a floor, and the message says so
        raise exceeds_context(floor, n_ctx, at_least=True)


def _token_floor(prompt: Any) -> int:
    """At least this many tokens: no token is longer than MAX_TOKEN_BYTES, and a character is
    at least a byte (len() of a str counts characters: no copy of a big text is made)."""
    if isinstance(prompt, str):
        return -(-len(prompt) // MAX_TOKEN_BYTES)
    if isinstance(prompt, dict):
        return _token_floor(prompt.get("prompt_string"))
    if isinstance(prompt, list):
        return sum(_token_floor(item) if isinstance(item, str) else 1 for item in prompt)
    return 0


def _id_bearing_fields(path: str, document: dict) -> tuple[Any, ...]:
    """The fields of a request on an infill or embedding route that may carry token ids
    (completion routes: `prompt`, read by `check_task_body` itself)."""
    if path == INFILL_ROUTE:
        return document.get("prompt"), document.get("input_prefix"), document.get("input_suffix")
    if path in EMBEDDING_ROUTES:
        # llama-server reads `input`, else `content`
        return (document["input"] if "input" in document else document.get("content"),)
    return ()


def _subprompts(prompt: Any) -> list[Any]:
    """Each prompt in `prompt`: itself, or the items of a batch (an array without an id)."""
    if isinstance(prompt, list) and not _contains_ids(prompt):
        return prompt
    return [prompt]


def _check_ids(prompt: Any, limits: PromptLimits) -> None:
    if isinstance(prompt, dict):
        # {"prompt_string": ...}: read as a mixed prompt; OAI content parts are strings and media
        if "prompt_string" in prompt:
            _check_ids(prompt["prompt_string"], limits)
        return
    if isinstance(prompt, int | float):  # bool too: a lone number is never a prompt
        raise RequestRejected(INVALID_TOKENS)
    if not isinstance(prompt, list):
        return  # a string, or a shape llama-server refuses with its own message
    if set(map(type, prompt)) == {int}:  # C-speed for the common, long case
        if min(prompt) < 0 or max(prompt) >= limits.id_limit:
            raise RequestRejected(INVALID_TOKENS)
        return
    # mixed: strings are text, everything else must be an id (bool is no id to llama-server)
    for item in prompt:
        if isinstance(item, str):
            continue
        if type(item) is not int or not 0 <= item < limits.id_limit:
            raise RequestRejected(INVALID_TOKENS)


def _contains_ids(prompt: list) -> bool:
    """llama-server's json_is_array_and_contains_numbers: any integer (not a float or bool)."""
    return any(type(item) is int for item in prompt)


def _check_input_extra(chunks: Any) -> None:
    """/infill's extra context is text only; llama-server's own messages for the rest."""
    if chunks is None:
        return
    if not isinstance(chunks, list):
        raise RequestRejected(
            '"input_extra" must be an array of {"filename": string, "text": string}'
        )
    for chunk in chunks:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise RequestRejected(
                'extra_context chunk must contain a "text" field with a string value'
            )
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise RequestRejected('extra_context chunk\'s "filename" field must be a string')
