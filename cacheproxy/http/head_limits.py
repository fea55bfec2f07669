"""A request head too large for aiohttp's parser (a header line over 8190 bytes, more than 128
headers) answered in llama-server's envelope: 431, never echoing what was sent.

aiohttp answers a request it cannot parse from its protocol handler, before the app or any
middleware sees it: a plain-text 400 whose message holds the first 100 bytes of the offending
line (a key, say), logged with a traceback. Its only hook is the handler's `handle_error`
(aio-libs/aiohttp#3287 asks for another): `ProxyRunner` serves the app with a handler that
overrides it. Every other parse error keeps aiohttp's answer.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from cacheproxy.http.errors import error_response

log = logging.getLogger(__name__)

HEAD_TOO_LARGE = "request header fields too large"


class ProxyRunner(web.AppRunner):
    """`web.AppRunner` whose server answers a request head too large with 431."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # the same server, its connections handled by `_EnvelopeHandler`; aiohttp builds its
        # own in `Application._make_handler` from what it keeps privately
        return _EnvelopeServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            **server._kwargs,
        )


class _EnvelopeServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _EnvelopeHandler(self, loop=self._loop, **self._kwargs)


class _EnvelopeHandler(RequestHandler):
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not head_too_large(exc):
            return super().handle_error(request, status, exc, message)
        # one line, no traceback, nothing of the head: it may carry a key
        log.info("refused a request head over the parser's limits (431) from %s", request.remote)
        response = error_response(431, HEAD_TOO_LARGE, "invalid_request_error")
        response.force_close()
        return response


def head_too_large(exc: BaseException | None) -> bool:
    """Whether aiohttp's parser refused a request for its head's size: a line or header field
    over its limit, or too many headers."""
    if isinstance(exc, LineTooLong):
        return True
    return isinstance(exc, BadHttpMessage) and "Too many headers" in exc.message
