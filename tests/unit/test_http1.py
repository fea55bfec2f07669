"""The lean upstream client: keep-alive, retries only where the request never arrived, faults
mapped to the proxy's answers, cancellation reaching the upstream.

The upstreams here are raw asyncio servers on 127.0.0.1 that answer with scripted bytes. They
stand in for llama-server because these tests need exact byte sequences and faults that a real
llama-server cannot be made to produce on cue: a connection closed as it is reused, an answer
broken off halfway, a 204 followed by a stray chunk terminator, silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import uvloop
from multidict import CIMultiDict
from yarl import URL

from cacheproxy.errors import ApiError
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.http1 import UpstreamClosed, UpstreamTimeout, UpstreamUnreachable
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.relay import upstream_errors
from cacheproxy.upstreams.spliced_body import FileBody, FileRange
from tests.support.waiting import wait_for as until

# every test on both loops the proxy may run on (`event_loop`, tests/conftest.py): uvloop's
# transports are not asyncio's classes, and it has no `loop.sendfile`
LOOP_FACTORIES = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def ok(body: bytes, *headers: str) -> bytes:
    head = "".join(f"{header}\r\n" for header in headers)
    return f"HTTP/1.1 200 OK\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One whole request as it arrived, or None at the end of the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)


class Upstreams:
    """What the scripted server saw: connections opened, requests read, ends of connections."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.ended = asyncio.Event()  # a connection reached its end (the client closed it)
        self.request_arrived = asyncio.Event()


@contextlib.asynccontextmanager
async def serving(
    script: Callable[[Upstreams, int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[tuple[URL, Upstreams]]:
    """A server running `script(seen, connection_number, reader, writer)` per connection."""
    seen = Upstreams()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        writers.append(writer)
        with contextlib.suppress(ConnectionError):
            await script(seen, seen.connections, reader, writer)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield URL(f"http://127.0.0.1:{port}"), seen
    finally:
        server.close()
        for writer in writers:
            writer.close()


def answer_each(
    answers: Callable[[bytes], bytes],
) -> Callable[[Upstreams, int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            writer.write(answers(request))
            await writer.drain()
        seen.ended.set()

    return script


def connections(**kwargs: float) -> UpstreamConnections:
    return UpstreamConnections(
        kwargs.get("connect_timeout_s", 2.0),
        kwargs.get("read_timeout_s", 5.0),
        kwargs.get("idle_s", 4.0),
    )


async def fetch(
    pool: UpstreamConnections, url: URL, body: bytes | None = None
) -> tuple[int, CIMultiDict[str], bytes]:
    async with await pool.send("POST" if body else "GET", url, {}, body) as answer:
        return answer.status, answer.headers, await answer.read()


async def proxy_error(pool: UpstreamConnections, url: URL) -> ApiError:
    """The answer the proxy gives for a fetch of `url` that fails (`forward.upstream_errors`)."""
    with pytest.raises(ApiError) as raised, upstream_errors(Upstream(str(url.origin()))):
        await fetch(pool, url)
    return raised.value


async def test_the_request_is_sent_as_one_exact_message() -> None:
    async with serving(answer_each(lambda request: ok(b"{}"))) as (base, seen):
        pool = connections()
        url = base.with_path("/v1/x", encoded=True).with_query("a=1")
        headers = CIMultiDict([("Content-Type", "application/json"), ("Host", "ignored")])
        async with await pool.send("POST", url, headers, b'{"n":1}') as answer:
            await answer.read()
        await pool.close()
    assert seen.requests == [
        b"POST /v1/x?a=1 HTTP/1.1\r\n"
        + f"Host: 127.0.0.1:{base.port}\r\nAccept-Encoding: identity\r\n".encode()
        + b'Content-Type: application/json\r\nContent-Length: 7\r\n\r\n{"n":1}'
    ]


async def test_answers_reuse_one_connection_and_chunked_bodies_are_read_whole() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'3\r\n{"a\r\n5\r\n": 1}\r\n0\r\n\r\n'
    )
    answers = iter([ok(b"first", "Server: llama.cpp"), chunked, ok(b"third")])
    async with serving(answer_each(lambda request: next(answers))) as (base, seen):
        pool = connections()
        first = await fetch(pool, base / "a")
        second = await fetch(pool, base / "b", b"{}")
        third = await fetch(pool, base / "c")
        await pool.close()
    assert first[0] == 200 and first[2] == b"first" and first[1]["Server"] == "llama.cpp"
    assert second[2] == b'{"a": 1}' and second[1]["Content-Type"] == "application/json"
    assert third[2] == b"third"
    assert seen.connections == 1 and len(seen.requests) == 3


async def test_an_interim_100_continue_is_passed_over() -> None:
    # llama-server (cpp-httplib) answers a passed-on `Expect: 100-continue` this way
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    async with serving(answer_each(lambda request: interim + ok(b"real"))) as (base, seen):
        pool = connections()
        first = await fetch(pool, base / "a", b"{}")
        second = await fetch(pool, base / "b", b"{}")
        await pool.close()
    assert first[0] == 200 and first[2] == b"real" and second[2] == b"real"
    assert seen.connections == 1


async def test_a_chunked_204_and_its_stray_terminator_do_not_spoil_the_next_answer() -> None:
    # llama-server's /cors-proxy relays an empty answer this way
    no_content = b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    answers = iter([no_content, ok(b"after")])
    async with serving(answer_each(lambda request: next(answers))) as (base, seen):
        pool = connections()
        status, _, body = await fetch(pool, base / "cors-proxy")
        after = await fetch(pool, base / "next")
        await pool.close()
    assert (status, body) == (204, b"")
    assert after[0] == 200 and after[2] == b"after"
    assert seen.connections == 2  # the terminator's connection is given up


async def test_a_204_terminator_sent_late_never_reaches_the_next_answer() -> None:
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            if len(seen.requests) == 1:
                writer.write(b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # the terminator in a read of its own
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(ok(b"after"))
            await writer.drain()

    async with serving(script) as (base, _):
        pool = connections()
        status, _, body = await fetch(pool, base / "cors-proxy")
        after = await fetch(pool, base / "next")
        await pool.close()
    assert (status, body) == (204, b"")
    assert after[0] == 200 and after[2] == b"after"


async def closing_at_the_second_request(
    seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Answers each request, but closes the first connection at its second one."""
    while (request := await read_request(reader)) is not None:
        seen.requests.append(request)
        if number == 1 and len(seen.requests) == 2:
            return  # keep-alive ran out as the request came: closed without a byte
        writer.write(ok(b"answer %d" % len(seen.requests)))
        await writer.drain()


async def test_a_reused_connection_closed_before_answering_is_retried_on_a_new_one() -> None:
    async with serving(closing_at_the_second_request) as (base, seen):
        pool = connections()
        await fetch(pool, base / "a")
        status, _, body = await fetch(pool, base / "b")
        await pool.close()
    assert (status, body) == (200, b"answer 3")
    assert seen.connections == 2


async def test_a_body_from_a_file_is_sent_whole_and_again_on_a_new_connection(
    tmp_path: Path,
) -> None:
    """Its ranges go by sendfile between the proxy's own bytes (in blocks on uvloop); a pooled
    connection closed as it is reused gets the same body again on a new one, as a body in
    memory does."""
    data = bytes(range(256)) * 8192  # 2 MiB: more than a socket buffer takes at once
    (tmp_path / "body").write_bytes(data)
    with (tmp_path / "body").open("rb") as file:
        body = FileBody(file, [b"<", FileRange(1, len(data) - 2), b">"])
        async with serving(closing_at_the_second_request) as (base, seen):
            pool = connections()
            await fetch(pool, base / "a")
            async with await pool.send("POST", base / "b", {}, body) as answer:
                assert (answer.status, await answer.read()) == (200, b"answer 3")
            await pool.close()
    sent = b"<" + data[1:-1] + b">"
    assert seen.connections == 2
    for request in seen.requests[1:]:  # on the connection then closed, and again
        assert request.endswith(f"Content-Length: {len(sent)}\r\n\r\n".encode() + sent)


async def test_a_connection_closed_right_after_its_answer_is_not_a_failure() -> None:
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        request = await read_request(reader)
        seen.requests.append(request or b"")
        writer.write(ok(b"once"))  # announces keep-alive, then closes at once
        await writer.drain()

    async with serving(script) as (base, _):
        pool = connections()
        answers = [await fetch(pool, base / "a") for _ in range(5)]
        await pool.close()
    assert [body for _, _, body in answers] == [b"once"] * 5


async def test_an_answer_broken_off_is_an_error_and_not_sent_again() -> None:
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while (request := await read_request(reader)) is not None:
            seen.requests.append(request)
            if len(seen.requests) == 1:
                writer.write(ok(b"whole"))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
                await writer.drain()
                return
            await writer.drain()

    async with serving(script) as (base, seen):
        pool = connections()
        await fetch(pool, base / "a")
        with pytest.raises(UpstreamClosed):
            await fetch(pool, base / "b")
        await pool.close()
    assert len(seen.requests) == 2 and seen.connections == 1


async def test_a_new_connection_closed_before_answering_is_not_retried() -> None:
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.requests.append(await read_request(reader) or b"")

    async with serving(script) as (base, seen):
        pool = connections()
        with pytest.raises(UpstreamClosed):
            await fetch(pool, base / "a")
        await pool.close()
    assert seen.connections == 1 and len(seen.requests) == 1


async def test_a_refused_connection_fails_at_once_as_unreachable() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    error = await proxy_error(connections(), URL(f"http://127.0.0.1:{port}/a"))
    assert error.status == 502 and "is unreachable" in error.message
    assert isinstance(error.__cause__, UpstreamUnreachable)


async def test_cancelling_the_waiting_task_closes_the_upstream_connection() -> None:
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.requests.append(await read_request(reader) or b"")
        seen.request_arrived.set()
        if await reader.read(1) == b"":  # no answer: waits for the client to hang up
            seen.ended.set()

    async with serving(script) as (base, seen):
        pool = connections()
        waiting = asyncio.create_task(fetch(pool, base / "completion", b"{}"))
        await asyncio.wait_for(seen.request_arrived.wait(), 2.0)
        waiting.cancel()
        await asyncio.wait_for(seen.ended.wait(), 2.0)
        assert waiting.cancelled()
        await pool.close()


async def test_idle_connections_are_given_up() -> None:
    async with serving(answer_each(lambda request: ok(b"x"))) as (base, seen):
        pool = connections(idle_s=0.2)
        await fetch(pool, base / "a")
        assert pool.idle_count == 1
        await asyncio.wait_for(seen.ended.wait(), 2.0)  # the client closed it, not the server
        assert pool.idle_count == 0
        await fetch(pool, base / "b")
        await pool.close()
    assert seen.connections == 2


async def test_a_connection_used_again_gets_its_whole_idle_time_anew() -> None:
    # its idle timer stays armed while it is used: fired early, it must look again, not close
    async with serving(answer_each(lambda request: ok(b"x"))) as (base, seen):
        pool = connections(idle_s=0.3)
        await fetch(pool, base / "a")
        await asyncio.sleep(0.2)
        await fetch(pool, base / "b")  # the same connection, 0.1 s before its first idle end
        await asyncio.sleep(0.2)  # past the first idle end, within the second
        assert pool.idle_count == 1 and not seen.ended.is_set()
        await asyncio.wait_for(seen.ended.wait(), 2.0)
        assert pool.idle_count == 0
        await pool.close()
    assert seen.connections == 1 and len(seen.requests) == 2


async def test_a_connection_used_again_still_times_out_when_the_upstream_falls_silent() -> None:
    # its read timer stays armed between exchanges: it must time out the second one on time
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.requests.append(await read_request(reader) or b"")
        writer.write(ok(b"x"))
        await writer.drain()
        seen.requests.append(await read_request(reader) or b"")
        await reader.read(1)  # says nothing to the second request

    async with serving(script) as (base, seen):
        pool = connections(read_timeout_s=0.3)
        await fetch(pool, base / "a")
        await asyncio.sleep(0.2)
        started = asyncio.get_running_loop().time()
        error = await proxy_error(pool, base / "b")
        waited = asyncio.get_running_loop().time() - started
        await pool.close()
    assert error.status == 504 and len(seen.requests) == 2 and seen.connections == 1
    # its own read timeout (0.3 s), not what was left of the first's (0.1 s); one that never
    # fired would leave the request waiting on the silent upstream for ever
    assert waited > 0.25


async def test_a_silent_upstream_times_out_as_504() -> None:
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.requests.append(await read_request(reader) or b"")
        await reader.read(1)  # says nothing

    async with serving(script) as (base, seen):
        pool = connections(read_timeout_s=0.2)
        error = await proxy_error(pool, base / "a")
        await pool.close()
    assert error.status == 504 and len(seen.requests) == 1
    assert isinstance(error.__cause__, UpstreamTimeout)


async def test_a_broken_answer_is_a_502_closed_connection() -> None:
    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.requests.append(await read_request(reader) or b"")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()

    async with serving(script) as (base, seen):
        pool = connections()
        error = await proxy_error(pool, base / "a")
        await pool.close()
    assert error.status == 502 and "closed the connection" in error.message
    assert len(seen.requests) == 1


async def test_an_event_stream_arrives_piece_by_piece_and_its_connection_is_not_kept() -> None:
    release = asyncio.Event()

    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.requests.append(await read_request(reader) or b"")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n"
        )
        await writer.drain()
        await release.wait()  # the second event only once the first was seen
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read(1)
        seen.ended.set()

    async with serving(script) as (base, seen):
        pool = connections()
        pieces = []
        async with await pool.send("POST", base / "completion", {}, b"{}") as answer:
            assert answer.content_type == "text/event-stream"
            async for piece in answer.iter_any():
                pieces.append(piece)
                release.set()
        await asyncio.wait_for(seen.ended.wait(), 2.0)
        assert pool.idle_count == 0
        await pool.close()
    assert pieces == [b"data: 1", b"data: 2"]


async def test_a_request_handed_whole_to_its_connection_is_told_sent_and_one_never_sent_not() -> (
    None
):
    """`on_sent` says the server has the whole request: told before its answer (a client
    leaving then is charged what the server computes), never for an unreachable upstream."""

    async def script(
        seen: Upstreams, number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        seen.requests.append(await read_request(reader) or b"")
        seen.request_arrived.set()
        await reader.read(1)  # no answer: waits for the client to hang up

    told: list[str] = []
    async with serving(script) as (base, seen):
        pool = connections()
        sending = pool.send("POST", base / "completion", {}, b'{"n":1}', lambda: told.append("a"))
        waiting = asyncio.create_task(sending)
        await asyncio.wait_for(seen.request_arrived.wait(), 2.0)
        waiting.cancel()  # the client left before the answer
        await asyncio.gather(waiting, return_exceptions=True)
        await pool.close()
    assert told == ["a"] and seen.requests[0].endswith(b'{"n":1}')
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UpstreamUnreachable):
        url = URL(f"http://127.0.0.1:{port}/a")
        await connections().send("POST", url, {}, b"{}", lambda: told.append("b"))
    assert told == ["a"]


class AnsweredTogether:
    """A server script answering each batch of `batch` requests only once all of them are in,
    so that they hold that many connections at once; `open_now`: its connections still open."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.arrived = 0
        self.all_in = asyncio.Event()
        self.open_now: list[int] = []

    def next_batch(self, batch: int) -> None:
        self.batch, self.arrived = batch, 0
        self.all_in.clear()

    async def script(
        self,
        seen: Upstreams,
        number: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.open_now.append(number)
        try:
            while (request := await read_request(reader)) is not None:
                seen.requests.append(request)
                self.arrived += 1
                if self.arrived >= self.batch:
                    self.all_in.set()
                await self.all_in.wait()
                writer.write(ok(b"x"))
                await writer.drain()
        finally:
            self.open_now.remove(number)


async def test_connections_beyond_the_bound_are_given_up_soon_and_the_rest_reused() -> None:
    """Eight requests at once need eight connections; with `keep_at_most` 3 the five answered
    beyond the bound are given up after a moment idle (llama-server's HTTP threads each stay on
    a connection while it is open), and the three kept carry what follows."""
    server = AnsweredTogether(8)
    async with serving(server.script) as (base, seen):
        pool = connections()
        pool.keep_at_most(base, 3)
        await asyncio.gather(*(fetch(pool, base / str(n)) for n in range(8)))
        assert seen.connections == 8
        assert pool.held_open(base) == 3  # the five beyond: given up once idle a moment
        await until(lambda: len(server.open_now) == 3)
        assert pool.open_count(base) == 3 and pool.idle_count == 3
        server.next_batch(1)
        await asyncio.gather(*(fetch(pool, base / "again") for _ in range(3)))
        assert seen.connections == 8  # the kept ones were used again
        # five at once again: the three kept and two new; whichever two are given back last
        # (kept ones among them: their idle time is cut short) go, the three others stay
        server.next_batch(5)
        await asyncio.gather(*(fetch(pool, base / str(n)) for n in range(5)))
        assert seen.connections == 10
        await until(lambda: len(server.open_now) == 3)
        assert pool.held_open(base) == 3
        pool.keep_at_most(base, 5)  # the lowest bound asked for holds
        assert pool.open_count(base) == 3
        await pool.close()


async def test_without_a_bound_every_connection_is_kept() -> None:
    server = AnsweredTogether(4)
    async with serving(server.script) as (base, _seen):
        pool = connections()
        await asyncio.gather(*(fetch(pool, base / str(n)) for n in range(4)))
        assert pool.open_count(base) == 4 and pool.idle_count == 4 and len(server.open_now) == 4
        await pool.close()


async def test_requests_made_in_one_loop_step_are_written_together_at_its_end() -> None:
    """The requests a step of the event loop makes are handed to their connections once the
    callbacks due in that step have run, in the order made, each told sent only then; every
    one reaches its upstream and is answered (upstreams/batched_writes.py)."""

    def echo(request: bytes) -> bytes:
        return ok(request.rpartition(b"\r\n\r\n")[2])

    async with serving(answer_each(echo)) as (base, seen):
        pool = connections()
        # three connections open and idle, so that the sends below take one each at once
        await asyncio.gather(*(fetch(pool, base / "warm", b"w") for _ in range(3)))
        assert pool.idle_count == 3
        told: list[int] = []

        async def send(number: int) -> bytes:
            body = str(number).encode()
            answer = await pool.send("POST", base / "a", {}, body, lambda: told.append(number))
            async with answer:
                return await answer.read()

        sending = [asyncio.create_task(send(number)) for number in range(3)]
        await asyncio.sleep(0)  # each task made its request in this step: none written yet
        assert told == []
        answers = await asyncio.gather(*sending)
        await pool.close()
    assert told == [0, 1, 2]
    assert answers == [b"0", b"1", b"2"]
    assert sorted(request.rpartition(b"\r\n\r\n")[2] for request in seen.requests[3:]) == [
        b"0",
        b"1",
        b"2",
    ]


async def test_a_request_whose_connection_closes_before_its_write_is_sent_once_elsewhere() -> None:
    """A reused connection closed in the step its request was made in (before the step's
    writes) never carries it: the request is not told sent there, goes out on a new
    connection, and is told sent once."""

    def echo(request: bytes) -> bytes:
        return ok(request.rpartition(b"\r\n\r\n")[2])

    async with serving(answer_each(echo)) as (base, seen):
        pool = connections()
        await fetch(pool, base / "warm", b"w")
        told: list[str] = []
        answer_of = asyncio.create_task(
            pool.send("POST", base / "a", {}, b"1", lambda: told.append("1"))
        )
        await asyncio.sleep(0)  # the request was made on the idle connection, not written
        assert told == [] and pool.idle_count == 0
        await pool.close()  # the connection it took closes before the step's writes
        async with await answer_of as answer:
            assert await answer.read() == b"1"
        await pool.close()
    assert told == ["1"]
    assert seen.connections == 2
    assert [request.rpartition(b"\r\n\r\n")[2] for request in seen.requests] == [b"w", b"1"]
