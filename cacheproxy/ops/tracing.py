"""Optional OpenTelemetry spans for a request's stages: auth, mirror, queue, disk, upstream.

Off by default and free when off: the app then holds `NO_TRACING`, whose spans are one shared
do-nothing context manager (`NO_SPAN`, which the request path uses directly, gathering no
attributes, once it has seen `enabled` is false), no middleware is added, and nothing of
opentelemetry is imported (the `otel` extra need not be installed). On (`[tracing] enabled =
true`), every request gets a server span (`METHOD /route`) whose children are the stages the
request went through; the tenant, upstream and slot are attributes, never prompt text, keys or
query strings. Spans are sent over OTLP/HTTP (protobuf) by the SDK's batch processor; tests
pass a tracer with an exporter of their own (`otel_tracer(exporter=...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Handler

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from cacheproxy.settings import TracingSettings

PREFIX = "cacheproxy."  # attribute names: cacheproxy.tenant, cacheproxy.slot, ...


class Stage:
    """A span being recorded: attributes learnt during the stage are set on it."""

    def set(self, **attributes: str | int | float | bool | None) -> None:
        pass


class _NoSpan:
    """The span of no tracing: one shared object, no generator made per stage (a request
    goes through several)."""

    __slots__ = ()
    stage = Stage()

    def __enter__(self) -> Stage:
        return self.stage

    def __exit__(self, *exc_info: object) -> None:
        return None


NO_SPAN = _NoSpan()  # what a caller that checked `enabled` uses in place of a span


class RequestTracer:
    """No tracing: every span is the same do-nothing context manager."""

    enabled = False

    def span(
        self, name: str, **attributes: str | int | float | bool | None
    ) -> contextlib.AbstractContextManager[Stage]:
        return NO_SPAN

    def annotate(self, **attributes: str | int | float | bool | None) -> None:
        """Set attributes on the current span (the request's, between stages)."""

    def shutdown(self) -> None:
        pass

    async def aclose(self) -> None:
        """`shutdown`, for the event loop: nothing is held when tracing is off."""


NO_TRACING = RequestTracer()


class _OtelStage(Stage):
    def __init__(self, span: Any) -> None:
        self._span = span

    def set(self, **attributes: str | int | float | bool | None) -> None:
        for name, value in attributes.items():
            if value is not None:
                self._span.set_attribute(PREFIX + name, value)


class OtelTracer(RequestTracer):
    """Spans through an OpenTelemetry SDK tracer provider of the proxy's own (the global
    provider is left alone: an app embedding the proxy keeps its own)."""

    enabled = True

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._provider = provider
        self._tracer = provider.get_tracer("cacheproxy")

    @contextlib.contextmanager
    def span(self, name: str, **attributes: str | int | float | bool | None) -> Iterator[Stage]:
        with self._tracer.start_as_current_span(name) as span:
            stage = _OtelStage(span)
            stage.set(**attributes)
            yield stage

    def server_span(self, request: web.Request) -> contextlib.AbstractContextManager[Any]:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        route = "other" if "{tail" in route else route
        return self._tracer.start_as_current_span(
            f"{request.method} {route}",
            kind=self._trace.SpanKind.SERVER,
            attributes={"http.request.method": request.method, "http.route": route},
        )

    def annotate(self, **attributes: str | int | float | bool | None) -> None:
        _OtelStage(self._trace.get_current_span()).set(**attributes)

    def shutdown(self) -> None:
        self._provider.shutdown()  # sends what the batch processor still holds

    async def aclose(self) -> None:
        # the SDK's shutdown blocks (it joins the batch processor's thread, which sends the
        # last batch, up to the export timeout) and has no async form: the tracer, which owns
        # the exporter, waits for it on a worker thread
        await asyncio.to_thread(self.shutdown)


def otel_tracer(
    settings: TracingSettings | None = None, exporter: SpanExporter | None = None
) -> OtelTracer:
    """A tracer sending to `exporter` as each span ends, or, without one, batched over
    OTLP/HTTP to `settings.otlp_endpoint`. Needs the `otel` extra."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    service = settings.service_name if settings is not None else "cacheproxy"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        assert settings is not None
        otlp = OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=settings.export_timeout_s)
        provider.add_span_processor(BatchSpanProcessor(otlp))
    return OtelTracer(provider)


def tracer_from(settings: TracingSettings) -> RequestTracer:
    return otel_tracer(settings) if settings.enabled else NO_TRACING


def tracing_middleware(tracer: OtelTracer) -> Callable[[web.Request, Handler], Awaitable[Any]]:
    """The request's own span, parent of its stages, with the status it was answered."""

    @web.middleware
    async def trace_request(request: web.Request, handler: Handler) -> web.StreamResponse:
        with tracer.server_span(request) as span:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                span.set_attribute("http.response.status_code", exc.status)
                raise
            span.set_attribute("http.response.status_code", response.status)
            return response

    return trace_request
