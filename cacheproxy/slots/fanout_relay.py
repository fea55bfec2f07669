"""A split request's tasks run side by side, and their answers relayed to the client as one.

Each task is a single request to an upstream (`run_upstream_task`), run by the caller on a slot
it leased, a prompt's tasks together (`PromptRunner`); what it answers comes here as messages
(`TaskOutput`). `relay_fanout` merges them as
llama-server would (cacheproxy/slots/fanout.py): not streamed, once all are in; streamed, event
by event as they arrive. The first error wins: the other tasks are cancelled and the error is
answered (as an HTTP error before the stream starts, as an error event after). Whatever ends the
relay (an error, a client that goes away, a shutdown), every task has finished, and so given its
slot back, before it returns or raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import string
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp
import orjson
from aiohttp import web

from cacheproxy.errors import ApiError, error_body
from cacheproxy.slots.fanout import (
    FanoutPlan,
    StreamMerge,
    SubTask,
    by_prompt,
    error_event,
    merge_answers,
)
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.http1 import SentHook
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.relay import (
    ResponseObserver,
    body_pieces,
    client_response_headers,
    is_event_stream,
    send_either,
    upstream_errors,
    upstream_request_headers,
    upstream_url,
)
from cacheproxy.upstreams.spliced_body import FileBody

log = logging.getLogger(__name__)

ID_ALPHABET = string.digits + string.ascii_uppercase + string.ascii_lowercase
MessageKind = Literal["answer", "start", "chunk", "end", "failed"]


@dataclass(frozen=True)
class _Message:
    kind: MessageKind
    index: int
    status: int = 200
    headers: Mapping[str, str] | None = None
    data: bytes = b""
    error: ApiError | None = None


class TaskOutput:
    """Where one task hands over what its upstream answers."""

    def __init__(self, queue: asyncio.Queue[_Message], index: int) -> None:
        self._queue = queue
        self.index = index
        self.status: int | None = None  # the upstream's status, once its answer came

    def answered(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self._queue.put_nowait(_Message("answer", self.index, status, headers, body))

    def started(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self._queue.put_nowait(_Message("start", self.index, status, headers))

    def chunk(self, data: bytes) -> None:
        if data:
            self._queue.put_nowait(_Message("chunk", self.index, data=data))

    def ended(self) -> None:
        self._queue.put_nowait(_Message("end", self.index))

    def failed(self, error: ApiError) -> None:
        self._queue.put_nowait(_Message("failed", self.index, error.status, error=error))


# runs one prompt's tasks (its completions, side by side), each answering to its output
PromptRunner = Callable[[list[SubTask], list[TaskOutput]], Awaitable[None]]


async def run_upstream_task(
    request: web.Request,
    session: aiohttp.ClientSession,
    upstream: Upstream,
    body: bytes | FileBody,
    output: TaskOutput,
    observer: ResponseObserver,
    upstream_api_key: str | None = None,
    streams: bool = False,
    forward_client_key: bool = True,
    connections: UpstreamConnections | None = None,
    on_sent: SentHook | None = None,
) -> None:
    """Send one task to `upstream` at the request's target and hand its answer to `output`, read
    by `observer` (which may rewrite what is shown). Raise ApiError as `forward` answers;
    `on_sent` as `forward` tells it."""
    headers = upstream_request_headers(request.headers, upstream_api_key, forward_client_key)
    if streams:
        headers["Connection"] = "close"  # llama-server closes after a stream (see forward.py)
    with upstream_errors(upstream):
        url = upstream_url(request, upstream)
        answer = await send_either(
            session, connections, request.method, url, body, headers, on_sent
        )
        async with answer:
            if not is_event_stream(answer):
                payload = observer.rewrite_body(answer.status, await answer.read())
                output.answered(answer.status, answer.headers, payload)
                return
            output.started(answer.status, answer.headers)
            async for chunk in body_pieces(answer):
                output.chunk(observer.relay_chunk(chunk))
            output.chunk(observer.finish())
            output.ended()


async def relay_fanout(
    request: web.Request, plan: FanoutPlan, run: PromptRunner, shown_id: str
) -> web.StreamResponse:
    """Run every prompt of `plan` at once through `run` and answer the client as llama-server
    answers the whole request (an OAI answer's id: `shown_id`)."""
    queue: asyncio.Queue[_Message] = asyncio.Queue()
    tasks = [
        asyncio.create_task(
            _reporting(run, prompt_tasks, [TaskOutput(queue, task.index) for task in prompt_tasks]),
            name=f"fanout-prompt-{prompt_tasks[0].index}",
        )
        for prompt_tasks in by_prompt(plan)
    ]
    response: web.StreamResponse | None = None
    try:
        if plan.stream:
            response = await _relay_streams(request, plan, queue, shown_id)
        else:
            response = await _merged_answer(plan, queue, shown_id)
    finally:
        for task in tasks:
            task.cancel()  # the rest of a failed request; no-ops for tasks already done
        await _settle(tasks)
    if plan.stream and response.prepared:
        await response.write_eof()  # only once every task gave its slot back
    return response


async def _reporting(run: PromptRunner, tasks: list[SubTask], outputs: list[TaskOutput]) -> None:
    """Run one prompt's tasks; a failure is a message to the relay, never an exception."""
    with failures_reported(outputs[0]):
        await run(tasks, outputs)


@contextlib.contextmanager
def failures_reported(output: TaskOutput) -> Iterator[None]:
    """A task's failure as a message to the relay on `output`, never an exception of its own."""
    try:
        yield
    except ApiError as exc:
        output.failed(exc)
    except Exception as exc:  # a bug: answered 500 like any, logged with its traceback
        log.exception("task %d of a split request failed", output.index)
        output.failed(ApiError(500, f"internal error: {exc!r}"))


async def _settle(tasks: list[asyncio.Task]) -> None:
    """Wait until every task has finished (its slot released), even when cancelled meanwhile:
    a lease must never outlive the request."""
    cancelled = False
    while pending := [task for task in tasks if not task.done()]:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def _merged_answer(
    plan: FanoutPlan, queue: asyncio.Queue[_Message], shown_id: str
) -> web.Response:
    answers: dict[int, _Message] = {}
    while len(answers) < len(plan.tasks):
        message = await queue.get()
        if message.kind == "failed":
            return _error_response(message.error)
        if message.kind != "answer":  # a stream nobody asked for: nothing to merge
            return _error_response(ApiError(502, "upstream streamed a non-streamed answer"))
        if message.status != 200:
            return web.Response(
                status=message.status,
                body=message.data,
                headers=client_response_headers(message.headers or {}),
            )
        answers[message.index] = message
    try:
        documents = [orjson.loads(answers[index].data) for index in range(len(plan.tasks))]
    except orjson.JSONDecodeError:
        return _error_response(ApiError(502, "upstream answered a task with invalid JSON"))
    return web.Response(
        status=200,
        body=orjson.dumps(merge_answers(plan, documents, shown_id)),
        headers=client_response_headers(answers[0].headers or {}),
    )


async def _relay_streams(
    request: web.Request, plan: FanoutPlan, queue: asyncio.Queue[_Message], shown_id: str
) -> web.StreamResponse:
    merge = StreamMerge(plan, shown_id)
    relay: web.StreamResponse | None = None
    ended: set[int] = set()
    while len(ended) < len(plan.tasks):
        message = await queue.get()
        if message.kind in ("failed", "answer"):
            # an error (or an answer that is no stream): before the stream, answered as it is
            if relay is None:
                if message.kind == "failed":
                    return _error_response(message.error)
                return web.Response(
                    status=message.status,
                    body=message.data,
                    headers=client_response_headers(message.headers or {}),
                )
            fallback = message.error.body() if message.error else error_body(502, "task failed")
            await relay.write(error_event(message.data, fallback))
            merge.failed = True
            return relay
        if relay is None:  # the first task to start: its headers are the stream's
            relay = web.StreamResponse(
                status=message.status, headers=client_response_headers(message.headers or {})
            )
            await relay.prepare(request)
        if message.kind == "start":
            shown = merge.started(message.index)
        elif message.kind == "chunk":
            shown = merge.feed(message.index, message.data)
        else:
            shown = merge.ended(message.index)
            ended.add(message.index)
        if shown:
            await relay.write(shown)
        if merge.failed:
            return relay  # a late error event ends the stream, as llama-server ends it
    if closing := merge.closing():
        await relay.write(closing)
    return relay


def _error_response(error: ApiError | None) -> web.Response:
    error = error or ApiError(502, "task failed")
    return web.Response(
        status=error.status,
        body=error.body(),
        content_type="application/json",
        headers=error.headers,
    )


def completion_id() -> str:
    """One id for every task's answer and event, as llama-server's gen_chatcmplid makes it."""
    return "chatcmpl-" + "".join(secrets.choice(ID_ALPHABET) for _ in range(32))
