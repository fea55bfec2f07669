"""Forward one request to an upstream and relay its answer, streaming SSE chunk by chunk.

This is the only place that copies bytes between the client and a llama-server. It holds no policy:
which upstream, and what body, are decided by the caller.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from types import TracebackType
from typing import Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from cacheproxy.errors import ApiError, error_body
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.http1 import Answer, SentHook, UpstreamClosed, UpstreamUnreachable
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.spliced_body import FileBody

log = logging.getLogger(__name__)

# The canonical path and query that were authorized and routed (set by the `canonical_paths`
# middleware): the only target ever sent upstream, never re-derived from the raw request.
UPSTREAM_TARGET = web.RequestKey("upstream_target", str)

# RFC 9110 section 7.6.1, plus headers whose value the proxy recomputes itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# X-Conversation-Id makes llama-server keep a stream alive after the client leaves, which would
# keep the slot busy behind the proxy's back; Accept-Encoding is dropped so bodies arrive plain.
DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {"x-conversation-id", "accept-encoding"}
DROPPED_RESPONSE_HEADERS = HOP_BY_HOP | {"content-encoding"}
CLIENT_KEY_HEADERS = frozenset({"authorization", "x-api-key"})
# tries of a request on pooled connections that turn out closed (send_upstream)
SEND_ATTEMPTS = 4


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """Header names that the Connection header marks as hop-by-hop for this message."""
    value = headers.get("Connection")
    if not value:
        return set()
    return {token.strip().lower() for token in value.split(",") if token.strip()}


def upstream_request_headers(
    client_headers: Mapping[str, str],
    upstream_api_key: str | None,
    forward_client_key: bool = True,
) -> CIMultiDict[str]:
    dropped = DROPPED_REQUEST_HEADERS | _connection_tokens(client_headers)
    if upstream_api_key is not None or not forward_client_key:
        dropped = dropped | CLIENT_KEY_HEADERS
    # a list, not a generator: one frame, not one resumption per header
    headers = CIMultiDict(
        [(name, value) for name, value in client_headers.items() if name.lower() not in dropped]
    )
    if upstream_api_key is not None:
        headers["Authorization"] = f"Bearer {upstream_api_key}"
    return headers


def client_response_headers(upstream_headers: Mapping[str, str]) -> CIMultiDict[str]:
    dropped = DROPPED_RESPONSE_HEADERS | _connection_tokens(upstream_headers)
    return CIMultiDict(
        [(name, value) for name, value in upstream_headers.items() if name.lower() not in dropped]
    )


class ResponseObserver(Protocol):
    """Reads an answer on its way to the client, and may rewrite what the client is shown."""

    def rewrite_body(self, status: int, payload: bytes) -> bytes: ...

    def relay_chunk(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


def upstream_url(request: web.Request, upstream: Upstream, target: str | None = None) -> URL:
    """The upstream URL for the request's authorized target (or the one the caller chose),
    taken as it is: yarl must not re-normalise it (it would remove dot segments of a path
    nobody authorized)."""
    target = target or request.get(UPSTREAM_TARGET)
    if target is None:
        raise ApiError(500, "request path was not canonicalised before forwarding")
    return URL(upstream.transport_base + target, encoded=True)


def is_event_stream(response: aiohttp.ClientResponse | Answer) -> bool:
    return response.content_type == "text/event-stream"


async def forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    upstream: Upstream,
    body: bytes | FileBody | None,
    upstream_api_key: str | None = None,
    streams: bool = False,
    observer: ResponseObserver | None = None,
    forward_client_key: bool = True,
    target: str | None = None,
    extra_headers: Mapping[str, str] | None = None,
    connections: UpstreamConnections | None = None,
    on_sent: SentHook | None = None,
) -> web.StreamResponse:
    """Send `body` (or no body; a big one from the file it was spilled to) to `upstream` at the
    request's canonical target (or `target`, a route the proxy translated the request to) and
    relay the answer, an event stream as it arrives.

    What `connections` carries (http, and https given its TLS context) goes over it, whose
    client costs far less per request (and per streamed chunk) than aiohttp's; HEAD (its
    answer has no body whatever its headers say) and anything else go through `session`.

    If the client goes away, aiohttp cancels this coroutine (the app runs with handler
    cancellation); either client then closes the upstream connection, and llama-server cancels
    the task and frees the slot. `on_sent` is told once the whole request is on its way: the
    server has it, even should the client leave before its answer (what it computed is then
    charged, slots/cut_tasks.py).
    """
    headers = upstream_request_headers(request.headers, upstream_api_key, forward_client_key)
    headers.update(extra_headers or {})
    if streams:
        # llama-server closes the connection after every stream although it announces
        # keep-alive; a pooled copy of it would fail the next request that took it.
        headers["Connection"] = "close"
    with upstream_errors(upstream):
        url = upstream_url(request, upstream, target)
        response = await send_either(
            session, connections, request.method, url, body, headers, on_sent
        )
        async with response:
            if is_event_stream(response):
                return await _relay_stream(request, response, upstream, observer)
            payload = await response.read()
            if observer is not None:
                payload = observer.rewrite_body(response.status, payload)
            return web.Response(
                status=response.status,
                reason=response.reason,
                body=payload,
                headers=client_response_headers(response.headers),
            )


class upstream_errors:  # lower case, as `contextlib.suppress`: used as a function
    """Count an exchange with `upstream` in flight, and turn its failures into the proxy's
    answers: 502 unreachable or broken off, 504 too slow. A class, not a generator context
    manager: entered by every forwarded request, it costs two calls instead of five."""

    __slots__ = ("upstream",)

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def __enter__(self) -> None:
        self.upstream.in_flight += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        upstream = self.upstream
        upstream.in_flight -= 1
        if exc is not None and (answer := _proxy_answer(upstream, exc)) is not None:
            raise answer from exc


def _proxy_answer(upstream: Upstream, exc: BaseException) -> ApiError | None:
    """The proxy's answer to a failed exchange with `upstream` (None: not an upstream's fault)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ApiError(502, f"upstream {upstream.base_url} is unreachable: {exc.os_error}")
    if isinstance(exc, UpstreamUnreachable):
        return ApiError(502, f"upstream {upstream.base_url} is unreachable: {exc}")
    if isinstance(
        exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | UpstreamClosed
    ):
        return ApiError(502, f"upstream {upstream.base_url} closed the connection: {exc}")
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return ApiError(504, f"upstream {upstream.base_url} did not answer in time")
    if isinstance(exc, aiohttp.ClientError):
        return ApiError(502, f"upstream {upstream.base_url} failed: {exc}")
    return None


def send_either(
    session: aiohttp.ClientSession,
    connections: UpstreamConnections | None,
    method: str,
    url: URL,
    body: bytes | FileBody | None,
    headers: CIMultiDict[str],
    on_sent: SentHook | None = None,
) -> Awaitable[aiohttp.ClientResponse | Answer]:
    """Send over `connections` a request to an upstream it carries, streamed or not, and
    anything else (HEAD, a scheme it does not carry, or no `connections`) over `session`. The
    chosen client's coroutine itself, to be awaited: no coroutine of its own for every await to
    pass through.
    `on_sent`: told once the whole request is on its way (over `session`, which tells nothing
    of it, as it starts: a request taken as sent is charged what the server computed)."""
    if connections is not None and method != "HEAD" and connections.carries(url):
        return connections.send(method, url, headers, body, on_sent)
    if on_sent is not None:
        on_sent()
    return send_upstream(session, method, url, body, headers)


def body_pieces(response: aiohttp.ClientResponse | Answer) -> AsyncIterator[bytes]:
    """The answer's body as it arrives: each read handed over at once, never held back to
    fill a buffer."""
    return (response if isinstance(response, Answer) else response.content).iter_any()


async def send_upstream(
    session: aiohttp.ClientSession,
    method: str,
    url: URL,
    body: bytes | FileBody | None,
    headers: CIMultiDict[str],
) -> aiohttp.ClientResponse:
    """Send the request, again on another connection while pooled ones turn out dead.

    A pooled connection can be closed by the server as it is taken (its keep-alive ran out, or
    it ended a stream); the request then never reached it, and sending again is safe. Under
    load several such connections come in a row (chunked prefill doubles the requests), so a
    few are tried. A refused connection is not retried: the server is down.
    """
    send = functools.partial(
        session.request, method, url, data=body, headers=headers, allow_redirects=False
    )
    if isinstance(body, FileBody):  # read from its file again for every try
        headers = CIMultiDict(headers)
        headers["Content-Length"] = str(len(body))  # sent as it is, not chunked
        send = functools.partial(_send_from_file, session, method, url, body, headers)
    for _ in range(SEND_ATTEMPTS - 1):
        try:
            return await send()
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            continue
    return await send()


def _send_from_file(
    session: aiohttp.ClientSession,
    method: str,
    url: URL,
    body: FileBody,
    headers: CIMultiDict[str],
) -> Awaitable[aiohttp.ClientResponse]:
    return session.request(method, url, data=body.pieces(), headers=headers, allow_redirects=False)


async def _relay_stream(
    request: web.Request,
    response: aiohttp.ClientResponse | Answer,
    upstream: Upstream,
    observer: ResponseObserver | None,
) -> web.StreamResponse:
    relay = web.StreamResponse(
        status=response.status,
        reason=response.reason,
        headers=client_response_headers(response.headers),
    )
    await relay.prepare(request)
    try:
        async for chunk in body_pieces(response):  # every event passed on as it arrives
            shown = chunk if observer is None else observer.relay_chunk(chunk)
            if shown:
                await relay.write(shown)
        if observer is not None and (rest := observer.finish()):
            await relay.write(rest)
    except (
        TimeoutError,
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        UpstreamClosed,
    ) as exc:
        # Headers are gone already: end the stream the way llama-server reports a late error.
        log.warning("upstream %s broke off a stream: %r", upstream.base_url, exc)
        message = f"upstream {upstream.base_url} broke off the stream"
        late = b"data: " + error_body(502, message) + b"\n\n"
        if observer is not None:  # shown in the stream's own form (an Anthropic `error` event)
            late = observer.relay_chunk(late)
        await relay.write(late)
    await relay.write_eof()
    return relay
