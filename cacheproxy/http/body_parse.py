"""Task bodies parsed and checked without stalling the event loop.

A small body is parsed in place. A big one (an id array of 90 MB is 15 million ints) would hold
the event loop for seconds: orjson keeps the GIL for the whole parse, so a worker *thread*
stalls the loop just the same. It is parsed in a worker process instead, which also checks its
prompts (token ids, id prompts over the context): what it refuses never exists in this process,
and what it accepts has bounded id prompts. The body reaches it through a file written as the
body arrives (in /dev/shm where it exists), never as one 90 MB bytes object here, nor pickled
into a pipe (a copy made holding the GIL). One worker, so a burst of big bodies is parsed one
at a time, and the memory they take is bounded by one body's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import tempfile
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from aiohttp import web

from cacheproxy.errors import ApiError
from cacheproxy.http.body_worker import parse_file_and_check
from cacheproxy.slots.prompt_bounds import PromptLimits, RequestRejected, parse_and_check

log = logging.getLogger(__name__)

BIG_BODY_BYTES = 1 << 20
WORKER_NICENESS = 10
SPILL_DIR = "/dev/shm"
READ_YIELD_BYTES = 4 << 20


async def body_chunks(request: web.Request, limit: int) -> AsyncIterator[bytes]:
    """The request body's chunks, refused (413) past `limit` as aiohttp's read() refuses it,
    with a pause every few MiB: a body that arrived while the handler waited is all buffered,
    and would otherwise be taken in one step of the event loop."""
    size = unyielded = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size >= limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        yield chunk
        unyielded += len(chunk)
        if unyielded >= READ_YIELD_BYTES:
            unyielded = 0
            await asyncio.sleep(0)  # let /health and the others in


def whole_small_body(request: web.Request, below: int) -> bytes | None:
    """The whole body when it is all here already and shorter than `below` bytes (a small
    body arrives with the request head): taken at once, without the chunk loop of
    `body_chunks`. None otherwise: the body is read chunk by chunk."""
    content = request.content
    if not content.is_eof() or content.total_bytes >= below:
        return None
    return content.read_nowait()


class SpilledBody:
    """A big body written to a private temporary file as it arrives (in RAM where /dev/shm
    exists): never joined into one 90 MB bytes in this process unless it is accepted."""

    def __init__(self, head: list[bytes]) -> None:
        folder = SPILL_DIR if os.access(SPILL_DIR, os.W_OK) else None
        self._handle, self.path = tempfile.mkstemp(prefix="cacheproxy-body-", dir=folder)
        for chunk in head:
            self.write(chunk)

    def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:  # write() lets go of the GIL while the kernel copies
            view = view[os.write(self._handle, view) :]

    def close(self) -> None:
        handle, self._handle = self._handle, -1
        if handle >= 0:  # once: a second close could hit a descriptor reused since
            os.close(handle)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class BodyParser:
    """Parses task bodies: big ones in a worker process, started on first use."""

    def __init__(self, big_body_bytes: int = BIG_BODY_BYTES) -> None:
        self.big_body_bytes = big_body_bytes
        self._pool: ProcessPoolExecutor | None = None

    async def read_task_body(
        self, request: web.Request, limit: int, path: str, limits: PromptLimits
    ) -> tuple[bytes, dict]:
        """The body and its JSON object with checked prompts; 400 (ApiError) or 413."""
        buffered = whole_small_body(request, min(limit, self.big_body_bytes))
        if buffered is not None:
            try:
                return buffered, parse_and_check(buffered, path, limits)
            except RequestRejected as rejected:
                raise rejected.as_api_error() from None
        head: list[bytes] = []
        size = 0
        spilled: SpilledBody | None = None
        try:
            async for chunk in body_chunks(request, limit):
                if spilled is not None:
                    spilled.write(chunk)
                    continue
                head.append(chunk)
                size += len(chunk)
                if size >= self.big_body_bytes:
                    spilled, head = SpilledBody(head), []
            if spilled is None:
                body = b"".join(head)
                return body, parse_and_check(body, path, limits)
            spilled.close()
            document = await self._in_worker(spilled.path, path, limits)
            # accepted, hence bounded (ids fit the context): the bytes are needed to forward it
            return await asyncio.to_thread(Path(spilled.path).read_bytes), document
        except RequestRejected as rejected:
            raise rejected.as_api_error() from None
        finally:
            if spilled is not None:
                spilled.close()
                spilled.remove()

    async def _in_worker(self, body_path: str, path: str, limits: PromptLimits) -> dict:
        if self._pool is None:
            # spawn, not fork: this process runs threads (the event loop's executor, aiohttp's)
            self._pool = ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                # parsing is background work: on a busy machine, serving comes first
                initializer=os.nice,
                initargs=(WORKER_NICENESS,),
            )
        loop = asyncio.get_running_loop()
        try:
            # a path, not the bytes: pickling 90 MB for the pipe is a copy made holding the GIL
            return await loop.run_in_executor(
                self._pool, parse_file_and_check, body_path, path, limits
            )
        except BrokenProcessPool as exc:
            # the worker died (killed, out of memory): start another for the next body
            log.error("body parser worker died: %s", exc)
            self.close()
            raise ApiError(500, "the request body could not be parsed") from exc

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        """Stop the worker and wait for it to exit (off the loop: joining blocks)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
