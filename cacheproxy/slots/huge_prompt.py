"""A completion whose prompt is a huge array of token ids, refused from its bytes.

Parsing such a body takes what its millions of Python ints take: a 5-million-id prompt (28 MB)
cost 0.6 to 1 s of CPU to parse and check (orjson 0.3 s, then the type, min and max passes over
the list), and ten seconds on a busy machine, where the parser's worker runs niced. Here the
array is counted and checked in blocks with byte operations and numpy's parser (a few passes
at C speed, no Python object per id), and refused only when the refusal is certain and the
same as `prompt_bounds.check_task_body` gives after a full parse:

- the array holds nothing but ids written plainly (digits and commas, a space after a comma;
  anything else is left to the full parse), so how many there are and whether every one is
  below the vocabulary's size is known;
- it is the value of the body's top-level `prompt`, the last one: the body with the array
  replaced by a random string parses (orjson) to an object whose `prompt` is that string.
  Nothing else could have put the string there, so the array sits where `prompt`'s value does,
  however the key is spelled or placed, and the whole body parses as well (a value swapped for
  another value).

What does not fit this (a batch, a mixed or nested prompt, ids in another layout) is parsed.
Pure: no I/O; `buffer` is bytes or an mmap of the spilled body.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any, Protocol

import orjson

from cacheproxy.slots.prompt_bounds import (
    COMPLETION_ROUTES,
    INVALID_TOKENS,
    PromptLimits,
    RequestRejected,
    exceeds_context,
)

DIGITS = b"0123456789"
WHITESPACE = b" \t\r\n"
BLOCK_BYTES = 1 << 20
# `]` looked at before the search for the array gives up (each is one step in Python)
MAX_CANDIDATES = 50_000
# the body less the array is parsed to prove where the array is: a small one only
MAX_REST_BYTES = 1 << 20


class Buffer(Protocol):
    def find(self, sub: bytes, start: int = ..., end: int = ...) -> int: ...
    def rfind(self, sub: bytes, start: int = ..., end: int = ...) -> int: ...
    def __getitem__(self, index: slice) -> bytes: ...
    def __len__(self) -> int: ...


def refuse_huge_id_prompt(
    buffer: Buffer, path: str, limits: PromptLimits
) -> RequestRejected | None:
    """The refusal of a body on `path` whose prompt is an id array over the context (or with
    an invalid id) when it is certain; None: the full parse decides."""
    n_ctx = limits.n_ctx
    if path not in COMPLETION_ROUTES or not n_ctx:
        return None
    for start, end in _long_arrays(buffer, n_ctx):
        if not _is_the_prompt(buffer, start, end):
            continue
        counted = _count_ids(buffer, start + 1, end, limits.id_limit)
        if counted is None:
            return None
        count, valid = counted
        if not valid:
            return RequestRejected(INVALID_TOKENS)
        return exceeds_context(count, n_ctx) if count >= n_ctx else None
    return None


def _long_arrays(buffer: Buffer, n_ctx: int) -> Iterator[tuple[int, int]]:
    """Where the arrays without nested arrays and with at least `n_ctx` - 1 commas are: each
    one's `[` and `]`."""
    position = 0
    for _ in range(MAX_CANDIDATES):
        end = buffer.find(b"]", position)
        if end < 0:
            return
        start = buffer.rfind(b"[", position, end)
        position = end + 1
        if start >= 0 and _count(buffer, b",", start, end) + 1 >= n_ctx:
            yield start, end


def _count(buffer: Buffer, sub: bytes, start: int, end: int) -> int:
    """bytes.count, in blocks (an mmap has none)."""
    return sum(
        buffer[offset : min(offset + BLOCK_BYTES, end)].count(sub)
        for offset in range(start, end, BLOCK_BYTES)
    )


def _count_ids(buffer: Buffer, start: int, end: int, id_limit: int) -> tuple[int, bool] | None:
    """The number of ids between `start` and `end` and whether all are below `id_limit`, when
    they are written plainly; None otherwise. In blocks cut after a comma, each a list of its
    own."""
    import numpy  # only here: the proxy otherwise never needs it

    count, largest = 0, 0
    while start < end:
        cut = buffer.find(b",", min(start + BLOCK_BYTES, end), end)
        cut = end if cut < 0 else cut
        block = _plain_block(buffer[start:cut])
        if block is None:
            return None
        try:  # its own parser: ",," or a leading comma raise, as anything it cannot read
            ids = numpy.fromstring(block, dtype=numpy.int64, sep=",")
        except ValueError:
            return None
        if not _canonical(block, ids):
            return None
        count += len(ids)
        largest = max(largest, int(ids.max()))
        start = cut + 1
        if start == end:  # a comma before the `]`
            return None
    return (count, largest < id_limit) if count else None


def _plain_block(block: bytes) -> bytes | None:
    """The block as digits and commas (a space after a comma taken out), or None."""
    block = block.strip(WHITESPACE)
    if block.translate(None, DIGITS + b","):
        block = block.replace(b", ", b",")
        if block.translate(None, DIGITS + b","):
            return None
    return block


def _canonical(block: bytes, ids: Any) -> bool:
    """Whether `block` is exactly `ids` in decimal, one comma between: nothing numpy's lenient
    parser let through (a leading zero, a trailing comma, a number past int64) is JSON's."""
    largest = int(ids.max())
    digits = len(ids)  # every id has a first digit; each power of ten it reaches adds one
    power = 10
    while power <= largest:
        digits += int((ids >= power).sum())
        power *= 10
    return len(block) == digits + len(ids) - 1


def _is_the_prompt(buffer: Buffer, start: int, end: int) -> bool:
    """Whether the array at `start`..`end` is the value of the body's top-level `prompt`."""
    if len(buffer) - (end + 1 - start) > MAX_REST_BYTES:
        return False
    marker = "x" + secrets.token_hex(16)
    rest = buffer[:start] + orjson.dumps(marker) + buffer[end + 1 :]
    try:
        document = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return False
    return isinstance(document, dict) and document.get("prompt") == marker
