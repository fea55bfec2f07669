"""Task bodies parsed and checked without stalling the event loop.

A small body is parsed in place. A big one (an id array of 90 MB is 15 million ints) would hold
the event loop for seconds: orjson keeps the GIL for the whole parse, so a worker *thread*
stalls the loop just the same. It is parsed in a worker process instead, which also checks its
prompts (token ids, id prompts over the context): what it refuses never exists in this process,
and what it accepts has bounded id prompts. One worker, so a burst of big bodies is parsed one
at a time, and the memory they take is bounded by one body's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from cacheproxy.http.body_worker import parse_file_and_check
from cacheproxy.http.errors import ProxyError
from cacheproxy.slots.prompt_bounds import PromptLimits, RequestRejected, parse_and_check

log = logging.getLogger(__name__)

BIG_BODY_BYTES = 1 << 20
WORKER_NICENESS = 10
SPILL_DIR = "/dev/shm"


def _spill(body: bytes) -> str:
    """Write the body to a private temporary file (in RAM where /dev/shm exists)."""
    folder = SPILL_DIR if os.access(SPILL_DIR, os.W_OK) else None
    handle, path = tempfile.mkstemp(prefix="cacheproxy-body-", dir=folder)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(handle, view) :]
    finally:
        os.close(handle)
    return path


def rejected_as_proxy_error(rejected: RequestRejected) -> ProxyError:
    return ProxyError(400, rejected.message, rejected.error_type, fields=rejected.fields)


class BodyParser:
    """Parses task bodies: big ones in a worker process, started on first use."""

    def __init__(self, big_body_bytes: int = BIG_BODY_BYTES) -> None:
        self.big_body_bytes = big_body_bytes
        self._pool: ProcessPoolExecutor | None = None

    async def parse_task_body(self, body: bytes, path: str, limits: PromptLimits) -> dict:
        """The body as a JSON object with checked prompts; a 400 ProxyError otherwise."""
        try:
            if len(body) < self.big_body_bytes:
                return parse_and_check(body, path, limits)
            return await self._in_worker(body, path, limits)
        except RequestRejected as rejected:
            raise rejected_as_proxy_error(rejected) from None

    async def _in_worker(self, body: bytes, path: str, limits: PromptLimits) -> dict:
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
        # The body goes through a file, not a pipe: pickling 90 MB for the pipe is a copy made
        # holding the GIL (the event loop waits), while write() lets go of it.
        body_path = await asyncio.to_thread(_spill, body)
        try:
            return await loop.run_in_executor(
                self._pool, parse_file_and_check, body_path, path, limits
            )
        except BrokenProcessPool as exc:
            # the worker died (killed, out of memory): start another for the next body
            log.error("body parser worker died: %s", exc)
            self.close()
            raise ProxyError(500, "the request body could not be parsed") from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(body_path)

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
