"""HTTP/1.1 to the upstreams over pooled keep-alive connections, parsed by httptools.

aiohttp's client does much per request that forwarding does not need (cookies, redirects,
tracing signals, timeout objects, a stream reader per answer); here a request is one write and
its answer one parse by llhttp, as uvicorn parses. Over http, or https (a TLS transport under
the same protocol); the connections are pooled in upstreams/connection_pool.py.

Faults, as the proxy's answers name them:
- `UpstreamUnreachable`: no connection could be made (refused, no route): raised at once.
- `UpstreamClosed`: the connection ended, or sent what is not HTTP, before the answer was whole.
  A *reused* connection that ends before any byte of the answer was closed by the server as it
  was taken (its keep-alive ran out): the request never reached it and is sent again on
  another connection. A new connection is never retried, nor an answer that had begun.
- `UpstreamTimeout`: no connection within the connect timeout, or an upstream silent for
  longer than the read timeout.

Cancelling the task that awaits an answer closes its connection: llama-server notices, cancels
the task and frees its slot. An answer is read whole (`read`) or as it arrives (`iter_any`,
for an event stream); either way the connection goes back to the pool as soon as the answer's
last byte is in, unless the answer ends the connection (`Connection: close`, an event stream,
which llama-server closes after, or a 204/304 that announced chunked coding, after whose head
llama-server sends a chunk terminator that belongs to no answer).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import cast

import httptools
from multidict import CIMultiDict
from yarl import URL

from cacheproxy.upstreams.batched_writes import BatchedWrites
from cacheproxy.upstreams.spliced_body import FileBody

# set from the URL and the body, whatever the caller's headers say; bodies are asked for plain
# (a request without Accept-Encoding would accept any coding), as nothing here decodes them
OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "accept-encoding"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # Content-Length: 0 when sent without body
BODILESS_STATUSES = frozenset({204, 304})
IDLE_S = 4.0  # llama-server drops an idle keep-alive connection after 5 s


class UpstreamUnreachable(ConnectionError):
    """No connection to the upstream could be made."""


class UpstreamClosed(ConnectionError):
    """The connection ended before the answer was whole."""


class ClosedUnanswered(UpstreamClosed):
    """The connection ended before any byte of the answer: the request may not have arrived."""


class UpstreamTimeout(TimeoutError):
    """No connection in time, or no byte of the answer in time."""


ConnectionKey = tuple[str, str, int]  # scheme, host, port
# told once a request is handed whole to its connection: the server will have all of it
SentHook = Callable[[], None]


class Answer:
    """One answer: status, reason and headers once `UpstreamConnections.send` returns, the
    body as it arrives. Use it with `async with`, so an answer left unread closes its
    connection."""

    def __init__(self, connection: UpstreamConnection) -> None:
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        # the media type, as aiohttp's `content_type` reads it (set with the headers: asked
        # twice an answer)
        self.content_type = ""
        self.keep_alive = False
        self.complete = False
        self.began = False  # a byte of it arrived
        self.last_read = connection.loop.time()
        self._connection = connection
        # the parser holds this answer's callbacks: a cycle, undone once the answer is whole
        # (left to the garbage collector, it made up all of a request's cyclic garbage)
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._raw_headers: list[tuple[str, str]] = []
        self._head_done = False
        self._interim = False  # a 1xx answer is being parsed: the real one follows it
        self._until_close = False  # the body has no length: it ends with the connection
        self._chunks: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    async def read(self) -> bytes:
        """The whole body."""
        while not self.complete:
            await self._wait()
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives: whatever came since the last step, never held back."""
        while True:
            if self._chunks:
                chunk = b"".join(self._chunks)
                self._chunks.clear()
                yield chunk
            elif self.complete:
                return
            else:
                await self._wait()

    def close(self) -> None:
        """Give up an answer not yet whole: its connection is closed."""
        if not self.complete:
            self._connection.close()

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    async def wait_head(self) -> None:
        while not self._head_done:
            await self._wait()

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._connection.loop.create_future()
        try:
            await waiter
        except asyncio.CancelledError:
            self.close()  # the client left: the upstream must notice too
            raise
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        if self._error is None and not self.complete:
            self._error = error
            self._wake()

    def feed(self, data: bytes) -> bool:
        """Parse `data`; False if it is not HTTP (the connection cannot be used further)."""
        self.began = True
        self.last_read = self._connection.loop.time()
        parser = self._parser
        if parser is None:  # whole already: these bytes belong to no answer
            return False
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # after the end, bytes that belong to no answer (see the module docstring);
            # before it, a broken answer
            self.fail(UpstreamClosed(f"the answer is not valid HTTP/1.1: {exc}"))
            return False
        if self.complete:
            self._parser = None
        return True

    def connection_lost(self) -> None:
        if self._head_done and self._until_close:
            self.on_message_complete()
        elif not self.began:
            self.fail(ClosedUnanswered("the upstream closed the connection before answering"))
        else:
            self.fail(UpstreamClosed("the upstream closed the connection mid-answer"))

    # httptools' callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: stop parsing
            raise UpstreamClosed("bytes after the answer")

    def on_status(self, reason: bytes) -> None:
        self.reason = reason.decode("utf-8", "surrogateescape")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append(
            (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        )

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # called by it
        self.status = parser.get_status_code()
        if 100 <= self.status < 200 and self.status != 101:
            # "100 Continue" to a client's `Expect: 100-continue`, which is passed on
            self._interim = True
            self._raw_headers.clear()
            return
        self.headers = headers = CIMultiDict(self._raw_headers)
        self.content_type = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        self.keep_alive = (
            parser.should_keep_alive()
            and not (self.status in BODILESS_STATUSES and chunked)
            and self.content_type != "text/event-stream"
        )
        self._until_close = (
            not chunked
            and "Content-Length" not in headers
            and self.status not in BODILESS_STATUSES
            and self.status >= 200
        )
        self._head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._wake()


class UpstreamConnection(asyncio.Protocol):
    """One TCP connection to an upstream, carrying one exchange at a time."""

    def __init__(
        self,
        key: ConnectionKey,
        loop: asyncio.AbstractEventLoop,
        read_timeout_s: float,
        on_free: Callable[[UpstreamConnection], None],
        on_lost: Callable[[UpstreamConnection], None],
        writes: BatchedWrites,
    ) -> None:
        self.key = key
        self.loop = loop
        self.writes = writes  # the pool's: each loop step's requests written together
        self.read_timeout_s = read_timeout_s
        # One timer for the read timeout and one for the idle timeout, each kept armed across
        # exchanges and moved on when it fires early, instead of two timers made and cancelled
        # an exchange (each push onto and pop off the loop's heap compares in Python).
        self.idle_timer: asyncio.TimerHandle | None = None
        self.idle_s = IDLE_S
        self.idle_since: float | None = None  # in the pool since then; None: in use
        self._on_free = on_free
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._answer: Answer | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future[None] | None = None  # set while the transport is full

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport is a transport, though not a subclass of asyncio.Transport
        self._transport = cast(asyncio.Transport, transport)

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    async def drain(self) -> None:
        """Until the transport's buffer is below its high-water mark again (a body written
        in blocks, where the loop has no sendfile)."""
        if self._writable is not None:
            await self._writable
        if self.is_closing:
            raise ConnectionResetError("the upstream closed the connection")

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None:  # bytes no request asked for: nothing after them can be trusted
            self.close()
            return
        parsed = answer.feed(data)
        if answer.complete or not parsed:
            self._answer = None  # the read timer, when it fires, finds none and stops
            if parsed and answer.keep_alive:
                self._on_free(self)
            else:
                self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_timer()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        answer, self._answer = self._answer, None
        if answer is not None:
            answer.connection_lost()
        self.resume_writing()  # a body's writer waiting for room finds the connection gone
        self._on_lost(self)

    @property
    def is_closing(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def exchange(
        self, message: bytes, body: FileBody | None = None, on_sent: SentHook | None = None
    ) -> Answer:
        """Send one request (`message`, then `body` from its file); its answer once the head
        arrived. `on_sent` is told once the whole request is handed to the transport (which
        sends what it holds before it closes, should the caller leave now). A request in one
        piece is handed over at the end of the loop step, before the caller can be resumed
        for anything, a cancellation included (upstreams/batched_writes.py)."""
        if self.is_closing:  # closed while it waited in the pool
            raise ClosedUnanswered("the connection was closed before the request")
        answer = self._answer = Answer(self)
        assert self._transport is not None
        if body is None:
            # with the others of this loop step, at its end (upstreams/batched_writes.py)
            self.writes.add(self.loop, functools.partial(self._write, message, on_sent))
        else:
            self._transport.write(message)
            await self._send_body(body)
            if on_sent is not None:
                on_sent()
        if self._read_timer is None:  # else one still armed fires sooner, and looks again
            self._read_timer = self.loop.call_at(
                answer.last_read + self.read_timeout_s, self._check_silence
            )
        await answer.wait_head()
        return answer

    def _write(self, message: bytes, on_sent: SentHook | None) -> None:
        """Hand a whole request to the transport, its sender told; nothing if the connection
        was closed meanwhile (its answer fails: the request never arrived)."""
        if self.is_closing:
            return
        assert self._transport is not None
        self._transport.write(message)
        if on_sent is not None:
            try:
                on_sent()
            except Exception as exc:  # the request's own failure, not the other writes'
                if self._answer is not None:
                    self._answer.fail(exc)
                self.close()

    async def _send_body(self, body: FileBody) -> None:
        assert self._transport is not None
        try:
            await body.send_over(self._transport, self.drain)
        except ConnectionError:
            # the upstream stopped reading (it may have answered already, a 413 say): its
            # answer, or the connection's end, tells the rest
            return
        except BaseException:
            self.close()  # part of a body was sent: nothing else can follow it
            raise

    def _check_silence(self) -> None:
        answer = self._answer
        if answer is None:  # no exchange under way: the next one arms the timer again
            self._read_timer = None
            return
        silent_until = answer.last_read + self.read_timeout_s
        if self.loop.time() < silent_until:  # data came meanwhile: look again when due
            self._read_timer = self.loop.call_at(silent_until, self._check_silence)
            return
        self._read_timer = None
        answer.fail(UpstreamTimeout(f"no answer within {self.read_timeout_s:g} s"))
        self.close()

    def given_back(self, idle_s: float) -> None:
        """Back in the pool: closed once idle for `idle_s`."""
        self.idle_since = self.loop.time()
        self.idle_s = idle_s
        deadline = self.idle_since + idle_s
        if self.idle_timer is None:  # else one still armed fires sooner, and looks again
            self.idle_timer = self.loop.call_at(deadline, self._check_idle)
        elif self.idle_timer.when() > deadline:  # given a shorter idle time than before
            self.idle_timer.cancel()
            self.idle_timer = self.loop.call_at(deadline, self._check_idle)

    def _check_idle(self) -> None:
        if self.idle_since is None:  # in use: armed again when given back
            self.idle_timer = None
            return
        idle_until = self.idle_since + self.idle_s
        if self.loop.time() < idle_until:  # used and given back meanwhile
            self.idle_timer = self.loop.call_at(idle_until, self._check_idle)
            return
        self.idle_timer = None
        self.close()

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None


def request_bytes(
    method: str, url: URL, headers: Mapping[str, str], body: bytes | FileBody | None
) -> bytes:
    """The request as sent: head and body in one piece (a body from a file: the head alone).
    Header values come from aiohttp's parser or the proxy's own code, so they hold no line
    breaks."""
    lines = [
        f"{method} {url.raw_path_qs} HTTP/1.1\r\nHost: {url.host_port_subcomponent}\r\n"
        "Accept-Encoding: identity\r\n"
    ]
    for name, value in headers.items():
        if name.lower() not in OWN_HEADERS:
            lines.append(f"{name}: {value}\r\n")
    if body is not None or method in BODY_METHODS:
        lines.append(f"Content-Length: {len(body or b'')}\r\n")
    lines.append("\r\n")
    head = "".join(lines).encode("utf-8", "surrogateescape")
    return head + body if isinstance(body, bytes) and body else head
