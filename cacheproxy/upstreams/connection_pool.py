"""The pool of keep-alive connections to the upstreams (upstreams/http1.py carries each one).

One pool per upstream (scheme, host, port; or a unix socket, unix_sockets.py), over http, or
https where the pool was given a TLS context (upstreams/tls.py); the most recently used idle
connection is taken first, so that the others may expire, and one idle for
`idle_s` is given up before llama-server drops it (after 5 s).

A connection given back is kept for `idle_s` only while the upstream has at most
`keep_at_most` open (busy or idle; unset: no bound), and otherwise for `BEYOND_IDLE_S`:
llama-server serves each connection on one thread of its HTTP pool for as long as the
connection stays open, and a new connection that finds every fixed thread taken waits for
another thread, which its pool sometimes does not start (two connections arriving together can
both be counted against one idle thread): it then waits until a kept-alive connection ends,
seconds later (docs/drop-in.md, "Connections").
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping

from yarl import URL

from cacheproxy.upstreams.batched_writes import BatchedWrites
from cacheproxy.upstreams.http1 import (
    IDLE_S,
    Answer,
    ClosedUnanswered,
    ConnectionKey,
    SentHook,
    UpstreamConnection,
    UpstreamTimeout,
    UpstreamUnreachable,
    request_bytes,
)
from cacheproxy.upstreams.spliced_body import FileBody
from cacheproxy.upstreams.unix_sockets import socket_path

# a connection beyond `keep_at_most`, given back, is given up after this long idle: soon enough
# to free the server's thread for a new connection, and long enough to carry the next request
# when as many are in flight again at once (opening one per request costs both sides more)
BEYOND_IDLE_S = 0.1


class UpstreamConnections:
    """Keep-alive connections to the upstreams, pooled by (scheme, host, port); https ones
    checked with `tls` (None: plain http only)."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        idle_s: float = IDLE_S,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.tls = tls
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_s = idle_s
        self._idle: dict[ConnectionKey, list[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        self._open_per_key: dict[ConnectionKey, int] = {}
        self._keep: dict[ConnectionKey, int] = {}
        # idle ones beyond the bound, given up after BEYOND_IDLE_S
        self._beyond: dict[ConnectionKey, set[UpstreamConnection]] = {}
        self._writes = BatchedWrites()  # each loop step's requests written together

    def carries(self, url: URL) -> bool:
        """Whether requests to `url` go over this pool (else over aiohttp's session)."""
        scheme = url.scheme
        return scheme == "http" or (scheme == "https" and self.tls is not None)

    @property
    def idle_count(self) -> int:
        return sum(len(connections) for connections in self._idle.values())

    def open_count(self, url: URL) -> int:
        """Connections open to `url`'s host and port, busy or idle."""
        return self._open_per_key.get(_key(url), 0)

    def held_open(self, url: URL) -> int:
        """Connections to `url`'s host and port that stay open for long: the busy ones and
        the idle ones given the whole idle time (not those beyond the bound)."""
        key = _key(url)
        return self._open_per_key.get(key, 0) - len(self._beyond.get(key, ()))

    def keep_at_most(self, url: URL, count: int) -> None:
        """Keep no more than `count` connections open to `url`'s host and port; the lowest
        bound asked for holds (a router's model instances share its port)."""
        key = _key(url)
        self._keep[key] = min(count, self._keep.get(key, count))

    async def send(
        self,
        method: str,
        url: URL,
        headers: Mapping[str, str],
        body: bytes | FileBody | None,
        on_sent: SentHook | None = None,
    ) -> Answer:
        """Send the request to `url` (one the pool `carries`) and return its answer once the
        head arrived; `on_sent`: told once the whole request is on its way
        (`UpstreamConnection.exchange`)."""
        key = _key(url)
        message = request_bytes(method, url, headers, body)
        from_file = body if isinstance(body, FileBody) else None
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()  # the most recently used: the others may expire
            self._count_out_beyond(connection)
            connection.idle_since = None  # in use: its idle timer, when it fires, stops
            try:
                return await connection.exchange(message, from_file, on_sent)
            except ClosedUnanswered:
                continue  # the server closed it as it was taken: the request never arrived
        connection = await self._connect(key)
        return await connection.exchange(message, from_file, on_sent)

    async def close(self) -> None:
        """Close every connection, idle or busy."""
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # the transports finish closing

    async def _connect(self, key: ConnectionKey) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        scheme, host, port = key
        path = socket_path(host)  # an upstream on a unix socket (unix_sockets.py)
        tls = self.tls if scheme == "https" else None

        def made() -> UpstreamConnection:
            return UpstreamConnection(
                key, loop, self.read_timeout_s, self._free, self._lost, self._writes
            )

        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if path is None:
                    # the timeout bounds the TLS handshake too
                    _, connection = await loop.create_connection(made, host, port, ssl=tls)
                else:
                    _, connection = await loop.create_unix_connection(made, path)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no connection within {self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise UpstreamUnreachable(str(exc)) from exc
        self._open.add(connection)
        self._open_per_key[key] = self._open_per_key.get(key, 0) + 1
        return connection

    def _free(self, connection: UpstreamConnection) -> None:
        key = connection.key
        beyond = self._beyond.setdefault(key, set())
        held = self._open_per_key[key] - len(beyond)
        if held > self._keep.get(key, held):
            connection.given_back(min(BEYOND_IDLE_S, self.idle_s))
            beyond.add(connection)
        else:
            connection.given_back(self.idle_s)
        self._idle.setdefault(key, []).append(connection)

    def _count_out_beyond(self, connection: UpstreamConnection) -> None:
        """An idle connection leaves the pool (taken, or ended): no longer one beyond."""
        beyond = self._beyond.get(connection.key)
        if beyond:
            beyond.discard(connection)

    def _lost(self, connection: UpstreamConnection) -> None:
        if connection not in self._open:
            return
        self._open.remove(connection)
        self._open_per_key[connection.key] -= 1
        self._count_out_beyond(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)


def _key(url: URL) -> ConnectionKey:
    return (url.scheme, url.raw_host or "", url.port or 80)
