"""Request bodies read (task bodies checked too) without stalling the event loop, big ones never
held in memory.

A small body (under 1 MiB) is parsed in place. A bigger one is spilled: written to a file of
the spill folder (http/spill_folder.py, on disk) as it arrives, off the loop, its bytes reserved
first in the spill budget (http/spill_budget.py: past a bound, 429 or 503 at once). Then:

- a completion whose prompt is a huge id array is refused from the file's bytes, in a thread
  (slots/huge_prompt.py): a few passes at C speed, no worker, no Python int per id;
- anything else is parsed in a worker process, which also checks its prompts: orjson keeps the
  GIL for a whole parse, so a thread would stall the loop just the same, and what the worker
  refuses never exists in this process. It hands back the document less the big members the
  proxy does not read (slots/read_fields.py), so an accepted 60 MB body is a few bytes here;
- an accepted body is forwarded from its file (upstreams/spliced_body.py), as is a big body of
  a route the proxy passes through as it is (`read_body`, not parsed). Its name is
  removed, and the proxy keeps it open until the request ends (`SpilledFile.close()`, which
  gives its bytes back to the budget): nothing of it outlives the process.

One worker, so a burst of big bodies is parsed one at a time, and the memory they take is
bounded by one body's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import multiprocessing
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import BinaryIO, TypeVar

from aiohttp import web

from cacheproxy.errors import ApiError
from cacheproxy.http.body_worker import ParsedBody, model_in_file, parse_file_and_check
from cacheproxy.http.spill_budget import SpillBudget
from cacheproxy.http.spill_folder import SpillFolder
from cacheproxy.slots.huge_prompt import refuse_huge_id_prompt
from cacheproxy.slots.prompt_bounds import PromptLimits, RequestRejected, parse_and_check
from cacheproxy.upstreams.spliced_body import SpilledFile, SpilledJson

log = logging.getLogger(__name__)
T = TypeVar("T")

BIG_BODY_BYTES = 1 << 20
WORKER_NICENESS = 10
READ_YIELD_BYTES = 4 << 20
# a spilled body is written in pieces of at least this much (one hop to the writer thread each)
WRITE_BYTES = 1 << 20


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
    """A big body being written to a private file of the spill folder as it arrives, its bytes
    reserved in the budget (all at once when `reserved` is its declared length, else as they
    come). Writes go to `writer`'s thread: a disk may make a write wait."""

    def __init__(
        self,
        folder: SpillFolder,
        budget: SpillBudget,
        tenant: str,
        reserved: int,
        writer: Executor,
    ) -> None:
        budget.reserve(tenant, reserved)
        try:
            self.handle, self.path = folder.new_file()
        except BaseException:
            budget.release(tenant, reserved)
            raise
        self.budget = budget
        self.tenant = tenant
        self.reserved = reserved
        self.size = 0
        self.commas = 0  # a prompt of n ids has n - 1: fewer than the context needs, no scan
        self._writer = writer
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    async def write(self, chunk: bytes) -> None:
        beyond = self.size + len(chunk) - self.reserved
        if beyond > 0:
            self.budget.reserve(self.tenant, beyond)
            self.reserved += beyond
        self.size += len(chunk)
        self.commas += chunk.count(b",")
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        if self._pending_bytes >= WRITE_BYTES:
            await self.flush()

    async def flush(self) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        if pending:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._writer, _write_all, self.handle, pending)
            except OSError as exc:  # the spill folder's disk is full, say: not the client's fault
                log.warning("could not spill a request body to %s: %s", self.path, exc)
                raise ApiError(503, "server busy: no room to receive the request body") from exc

    async def accepted(self, parsed: ParsedBody) -> SpilledJson:
        """The body to forward: open, its name removed; closing it gives its bytes back."""
        file, release = await self._opened()
        return SpilledJson(
            file, self.size, parsed.object_end, parsed.document, parsed.left_in_file, release
        )

    async def as_file(self) -> SpilledFile:
        """The body to forward as the client sent it: as `accepted`, unparsed."""
        file, release = await self._opened()
        return SpilledFile(file, self.size, release)

    async def _opened(self) -> tuple[BinaryIO, Callable[[], None]]:
        """The file, open and nameless, and what gives its bytes back to the budget."""
        await asyncio.get_running_loop().run_in_executor(self._writer, os.unlink, self.path)
        # wraps the descriptor already open (no I/O); the caller's body closes it
        file = open(self.handle, "rb", buffering=0, closefd=True)  # noqa: ASYNC230
        self.handle = -1  # the file owns it now
        return file, functools.partial(self.budget.release, self.tenant, self.reserved)

    def discard(self) -> None:
        """A body refused or cut: its file goes, its bytes are given back."""
        if self.handle >= 0:
            handle, self.handle = self.handle, -1
            with contextlib.suppress(OSError):
                os.close(handle)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.budget.release(self.tenant, self.reserved)


def _write_all(handle: int, pieces: list[bytes]) -> None:
    for piece in pieces:
        view = memoryview(piece)
        while view:
            view = view[os.write(handle, view) :]


def _refusal_of_file(body_path: str, request_path: str, limits: PromptLimits) -> ApiError | None:
    with open(body_path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
        refusal = refuse_huge_id_prompt(m, request_path, limits)
    return refusal.as_api_error() if refusal is not None else None


class BodyParser:
    """Reads task bodies: big ones spilled to `folder` within `budget`, parsed in a worker
    process started on first use."""

    def __init__(
        self, folder: SpillFolder, budget: SpillBudget, big_body_bytes: int = BIG_BODY_BYTES
    ) -> None:
        self.folder = folder
        self.budget = budget
        self.big_body_bytes = big_body_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="body-spill")

    async def read_task_body(
        self, request: web.Request, limit: int, path: str, limits: PromptLimits, tenant: str
    ) -> tuple[bytes | SpilledJson, dict]:
        """The body (a big one: open in its spill file, to be closed when the request ends)
        and its JSON object with checked prompts; 400 (ApiError), 413, 429 or 503."""
        received = await self._receive(request, limit, tenant)
        if isinstance(received, bytes):
            return received, _parsed_here(received, path, limits)
        try:
            if limits.n_ctx and received.commas + 1 >= limits.n_ctx:
                refusal = await asyncio.to_thread(_refusal_of_file, received.path, path, limits)
                if refusal is not None:
                    raise refusal
            parsed = await self._in_worker(received.path, path, limits)
            return await received.accepted(parsed), parsed.document
        except BaseException:
            received.discard()
            raise

    async def read_body(
        self, request: web.Request, limit: int, tenant: str
    ) -> tuple[bytes | SpilledFile | None, str | None]:
        """A body to forward as it is (none: None); a big one spilled as a task's is, within
        the same bounds, and sent from its file (to be closed when the request ends), with the
        model it names, read in the worker (None for a small one: read where it is used)."""
        if not request.body_exists:
            return None, None
        received = await self._receive(request, limit, tenant)
        if isinstance(received, bytes):
            return received, None
        try:
            model = await self._run_in_worker(model_in_file, received.path)
            return await received.as_file(), model
        except BaseException:
            received.discard()
            raise

    async def _receive(self, request: web.Request, limit: int, tenant: str) -> bytes | SpilledBody:
        """The whole body, or a big one spilled and flushed (discarded on a failure here)."""
        buffered = whole_small_body(request, min(limit, self.big_body_bytes))
        if buffered is not None:
            return buffered
        declared = request.content_length
        if declared is not None and declared >= limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=declared)
        spilled = None
        if declared is not None and declared >= self.big_body_bytes:
            spilled = self._spill(tenant, declared)  # refused before a byte is read
        try:
            head: list[bytes] = []
            size = 0
            async for chunk in body_chunks(request, limit):
                if spilled is not None:
                    await spilled.write(chunk)
                    continue
                head.append(chunk)
                size += len(chunk)
                if size >= self.big_body_bytes:
                    spilled = self._spill(tenant, 0)
                    for piece in head:
                        await spilled.write(piece)
                    head = []
            if spilled is None:
                return b"".join(head)
            await spilled.flush()
            return spilled
        except BaseException:
            if spilled is not None:
                spilled.discard()
            raise

    def _spill(self, tenant: str, reserved: int) -> SpilledBody:
        return SpilledBody(self.folder, self.budget, tenant, reserved, self._writer)

    async def _in_worker(self, body_path: str, path: str, limits: PromptLimits) -> ParsedBody:
        try:
            return await self._run_in_worker(parse_file_and_check, body_path, path, limits)
        except RequestRejected as rejected:
            raise rejected.as_api_error() from None

    async def _run_in_worker(self, call: Callable[..., T], *args: object) -> T:
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
            return await loop.run_in_executor(self._pool, call, *args)
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
        """Stop the worker and the writer and wait for them (off the loop: joining blocks)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
        await asyncio.to_thread(self._writer.shutdown, wait=True)


def _parsed_here(body: bytes, path: str, limits: PromptLimits) -> dict:
    try:
        return parse_and_check(body, path, limits)
    except RequestRejected as rejected:
        raise rejected.as_api_error() from None
