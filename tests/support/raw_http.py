"""HTTP/1.1 over a bare socket: request targets exactly as written (an HTTP client library would
normalise `/./slots` or `%2e` before sending), and connections the test paces byte by byte."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson
from yarl import URL


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return orjson.loads(self.body)


async def open_connection(base_url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = URL(base_url)
    return await asyncio.open_connection(url.host, url.port)


def request_bytes(
    method: str, target: str, headers: dict[str, str] | None = None, body: bytes | None = None
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


async def read_response(reader: asyncio.StreamReader) -> RawResponse:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = await _read_chunked(reader)
    else:
        body = await reader.read()
    return RawResponse(int(status_line.split()[1]), headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return body
        body += chunk[:-2]


async def raw_request(
    base_url: str,
    method: str,
    target: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float = 30.0,
) -> RawResponse:
    """One request on its own connection, the target sent byte for byte as given."""
    reader, writer = await open_connection(base_url)
    try:
        writer.write(request_bytes(method, target, headers, body))
        await writer.drain()
        return await asyncio.wait_for(read_response(reader), timeout_s)
    finally:
        writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and headers of a response, its body left to read."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers


async def body_until(reader: asyncio.StreamReader, headers: dict[str, str], marker: bytes) -> bytes:
    """Read a (chunked or plain) body only until `marker` has arrived, and not a byte further
    than its chunk: the caller may then drop the connection at exactly that point."""
    body = b""
    chunked = headers.get("transfer-encoding") == "chunked"
    while marker not in body:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            body += (await reader.readexactly(size + 2))[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
            body += data
    return body
