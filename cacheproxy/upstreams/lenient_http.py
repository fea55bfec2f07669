"""A connector whose connections read llama-server's bodiless answers as its clients read them,
and reach an upstream on a unix socket.

llama-server relays some empty answers (a 204 from the MCP target behind its `/cors-proxy`) with
`Transfer-Encoding: chunked` and the chunk terminator `0\\r\\n\\r\\n` after the head. A 204 or a
304 ends at its head (RFC 9112 section 6.3), so aiohttp reads those five bytes as the next
answer's status line and fails the exchange ("Bad status line"), where curl, requests and
browsers ignore them. The connections made here drop exactly that terminator, once, after the
head of a 204 or 304 that announced chunked coding; every other byte is parsed as before.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Any

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.tracing import Trace

from cacheproxy.upstreams.unix_sockets import socket_path

CHUNK_TERMINATOR = b"0\r\n\r\n"
_BODILESS_HEAD = re.compile(rb"^HTTP/1\.[01] (204|304)[ \r]")
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*[^\r\n]*chunked", re.IGNORECASE)


def drop_bodiless_terminator(data: bytes) -> tuple[bytes, bool]:
    """`data` without the terminator that follows a bodiless answer's head, and whether the
    terminator is still to come (the head ended the read)."""
    if _BODILESS_HEAD.match(data) is None:
        return data, False
    end = data.find(b"\r\n\r\n")
    if end < 0 or _CHUNKED.search(data, 0, end + 2) is None:
        return data, False
    end += 4
    rest = data[end:]
    if rest.startswith(CHUNK_TERMINATOR):
        return data[:end] + rest[len(CHUNK_TERMINATOR) :], False
    return data, not rest


class LenientResponseHandler(ResponseHandler):
    _terminator_due = False

    def data_received(self, data: bytes) -> None:
        if self._terminator_due and data:
            self._terminator_due = False
            if data.startswith(CHUNK_TERMINATOR):
                data = data[len(CHUNK_TERMINATOR) :]
                if not data:
                    return
        data, self._terminator_due = drop_bodiless_terminator(data)
        super().data_received(data)


class LenientConnector(aiohttp.TCPConnector):
    """aiohttp's TCP connector with the connections above, which also opens a unix connection
    for an upstream on a unix socket (its host name spells the path, unix_sockets.py), as
    aiohttp's `UnixConnector` does for its one path."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(LenientResponseHandler, loop=self._loop)

    async def _create_connection(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> ResponseHandler:
        path = socket_path(req.host)
        if path is None:
            return await super()._create_connection(req, traces, timeout)
        try:
            async with asyncio.timeout(timeout.sock_connect):
                _, handler = await self._loop.create_unix_connection(self._factory, path)
        except OSError as exc:
            if isinstance(exc, TimeoutError):
                raise
            raise UnixClientConnectorError(path, req.connection_key, exc) from exc
        return handler
