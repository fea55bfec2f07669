"""Request bodies sent from a file, never read into memory whole: the file a big request body
was spilled to (http/body_parse.py), as the client sent it or with top-level members of the
proxy's own appended.

Over a plain socket (upstreams/http1.py) the file's ranges go by `loop.sendfile`: the kernel
copies them, the proxy holds none of their bytes. Over TLS, or on a loop without sendfile, the
proxy's client, like aiohttp's (HEAD), reads them in blocks off the event loop.

A changed body is the client's bytes up to the object's closing brace, then each member the
proxy adds or changes: llama-server keeps the last of two members with one key (nlohmann's
parser assigns through `object->operator[](key)`, vendor/nlohmann/json.hpp, json_sax_dom_parser
`key()` and `handle_value()`), as orjson does, so the server reads what the proxy decided and
the proxy never re-serialises the 60 MB it did not change.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import orjson

READ_BLOCK_BYTES = 1 << 20
# Members llama-server reads as absent when null (server-schema.cpp: a field whose value is null
# keeps its default): the only members the proxy drops from a task body, said by appending them
# as null: `n_cmpl`, alias `n` (a split request's tasks, slots/fanout.py), `response_fields`
# (the proxy projects the answer itself, apis/response_fields.py).
NULL_MEANS_ABSENT = frozenset({"n", "n_cmpl", "response_fields"})


@dataclass(frozen=True)
class FileRange:
    offset: int
    length: int


class FileBody:
    """A request body: bytes of the proxy's own and ranges of an open file, in order."""

    def __init__(self, file: BinaryIO, parts: Sequence[bytes | FileRange]) -> None:
        self.file = file
        self.parts = tuple(part for part in parts if _part_length(part))
        self.size = sum(map(_part_length, self.parts))

    def __len__(self) -> int:
        return self.size

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body in blocks, the file read off the event loop (for aiohttp's client)."""
        for part in self.parts:
            if isinstance(part, bytes):
                yield part
            else:
                async for block in self._blocks(part):
                    yield block

    async def _blocks(self, part: FileRange) -> AsyncIterator[bytes]:
        handle = self.file.fileno()
        offset, end = part.offset, part.offset + part.length
        while offset < end:
            block = await asyncio.to_thread(
                os.pread, handle, min(READ_BLOCK_BYTES, end - offset), offset
            )
            if not block:
                raise OSError(f"{self.file.name}: shorter than the body it holds")
            offset += len(block)
            yield block

    async def send_over(
        self, transport: asyncio.Transport, drain: Callable[[], Awaitable[None]]
    ) -> None:
        """Write the body to `transport`, the file's ranges by sendfile (after what was written
        before them has gone: asyncio waits for the transport's buffer to empty first). A loop
        without sendfile (uvloop), or a transport it cannot send a file over (TLS), gets them
        in blocks read off the loop, each written once `drain` says the transport has room.
        (Not asyncio's own fallback for TLS: it swaps the transport's protocol for its own while
        it writes, and the request never ended.)"""
        loop = asyncio.get_running_loop()
        over_tls = transport.get_extra_info("ssl_object") is not None
        for part in self.parts:
            if isinstance(part, bytes):
                transport.write(part)
                continue
            if not over_tls:
                try:
                    await loop.sendfile(transport, self.file, part.offset, part.length)
                    continue
                except NotImplementedError:
                    pass
            async for block in self._blocks(part):
                await drain()
                transport.write(block)


def _part_length(part: bytes | FileRange) -> int:
    return len(part) if isinstance(part, bytes) else part.length


class SpilledFile(FileBody):
    """A body as the client sent it, held in a spill file (open, its name already removed: the
    kernel frees it with the last descriptor, a crash included). `close()` (or, failing that,
    garbage collection) closes the file and calls `on_close`, once."""

    def __init__(
        self, file: BinaryIO, size: int, on_close: Callable[[], None] = lambda: None
    ) -> None:
        super().__init__(file, [FileRange(0, size)])
        self._closer = weakref.finalize(self, _close, file, on_close)

    def close(self) -> None:
        self._closer()


class SpilledJson(SpilledFile):
    """A JSON object body as the client sent it, held in a spill file.

    `parsed` is the object as the proxy read it, less `left_in_file`: the members too big to be
    worth holding that the proxy never reads (slots/read_fields.py). `object_end` is the offset
    of the object's closing brace.
    """

    def __init__(
        self,
        file: BinaryIO,
        size: int,
        object_end: int,
        parsed: dict,
        left_in_file: frozenset[str],
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(file, size, on_close)
        self.object_end = object_end
        self.parsed = dict(parsed)  # its own: a member put into the caller's dict is a change
        self.left_in_file = left_in_file

    def with_document(self, document: dict) -> FileBody:
        """This body as the server must read `document`: the client's members, then those
        `document` adds or changes (a value that is not the very object parsed), and those it
        drops (NULL_MEANS_ABSENT only) as null. ValueError for another dropped member."""
        parsed = self.parsed
        added = [
            orjson.dumps({key: value})[1:-1]
            for key, value in document.items()
            if key not in parsed or parsed[key] is not value
        ]
        for key in parsed.keys() - document.keys():
            if key not in NULL_MEANS_ABSENT:
                raise ValueError(f"a spilled body cannot be forwarded without its {key!r}")
            added.append(orjson.dumps({key: None})[1:-1])
        if not added:
            return self
        members = b",".join(added)
        if parsed or self.left_in_file:  # the client's object has members: one comma between
            members = b"," + members
        return FileBody(self.file, [FileRange(0, self.object_end), members + b"}"])


def _close(file: BinaryIO, on_close: Callable[[], None]) -> None:
    try:
        file.close()
    finally:
        on_close()
