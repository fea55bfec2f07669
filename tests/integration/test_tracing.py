"""OpenTelemetry spans of a request's stages, recorded by the SDK against a real llama-server, and
sent once over OTLP/HTTP to a real HTTP receiver that decodes them.

No OTLP receiver installs from PyPI or Debian here (the OpenTelemetry Collector and Jaeger ship
as Go binaries and containers; Debian has only the Go library's source), so the OTLP test's peer
is an aiohttp server on 127.0.0.1 that parses what it receives with opentelemetry-proto's own
`ExportTraceServiceRequest`: a real HTTP exchange, the exporter's real protobuf.
"""

from __future__ import annotations

import random
import string
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cacheproxy.ops.tracing import otel_tracer
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.local_app import served
from tests.support.servers import StartServer, serving

STAGES = ("auth", "mirror", "queue", "disk.save", "disk.restore", "upstream")


def words(seed: int, count: int = 150) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(count))


def by_trace(spans: tuple[ReadableSpan, ...]) -> dict[int, list[ReadableSpan]]:
    traces: defaultdict[int, list[ReadableSpan]] = defaultdict(list)
    for span in spans:
        traces[span.context.trace_id].append(span)
    return traces


async def test_a_requests_stages_are_child_spans_with_tenant_and_slot_never_prompt_text(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1, ctx_size=4096)
    exporter = InMemorySpanExporter()
    database = tmp_path / "tenants.db"
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        tenants={"database": database},
        disk={
            "directory": server.slot_save_path,
            "database": tmp_path / "archive.db",
            "min_tokens": 64,
        },
    )
    prompts = [words(1), words(2), words(1) + " " + words(3, 10)]
    with TenantRegistry(database) as registry:
        tenant, key = registry.create("acme")
        async with (
            serving(settings, tracer=otel_tracer(exporter=exporter)) as (url, _),
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as client,
        ):
            exporter.clear()  # only the requests' spans
            for prompt in prompts:  # the second evicts the first (saved), the third restores it
                body = {"prompt": prompt, "n_predict": 4}
                async with client.post(url + "/completion", json=body) as response:
                    assert response.status == 200, await response.text()

    traces = by_trace(exporter.get_finished_spans())
    assert len(traces) == len(prompts)
    for spans in traces.values():
        roots = [span for span in spans if span.parent is None]
        assert [root.name for root in roots] == ["POST /completion"]
        root = roots[0]
        assert root.attributes["cacheproxy.tenant"] == tenant.id
        assert root.attributes["http.response.status_code"] == 200
        stages = {span.name: span for span in spans if span is not root}
        assert set(stages) == set(STAGES)
        for stage in stages.values():
            assert stage.parent.span_id == root.context.span_id
            assert root.start_time <= stage.start_time <= stage.end_time <= root.end_time
        for name in ("queue", "upstream"):
            assert stages[name].attributes["cacheproxy.slot"] == 0
            assert stages[name].attributes["cacheproxy.upstream"] == server.url
        assert stages["upstream"].attributes["cacheproxy.status"] == 200
        assert stages["mirror"].attributes["cacheproxy.prompt_tokens"] > 100
        # stages in the order they ran
        ordered = sorted(stages.values(), key=lambda span: span.start_time)
        assert [span.name for span in ordered] == list(STAGES)
    restored = [s for t in traces.values() for s in t if s.name == "disk.restore"]
    assert any(span.attributes.get("cacheproxy.action") for span in restored)

    secrets = {word for prompt in prompts for word in prompt.split()} | {key}
    for span in exporter.get_finished_spans():
        shown = " ".join(str(value) for value in span.attributes.values()) + " " + span.name
        assert not any(secret in shown for secret in secrets), span.name


@pytest.fixture
async def otlp_receiver() -> AsyncIterator[tuple[str, list[ExportTraceServiceRequest]]]:
    """An OTLP/HTTP traces endpoint on a loopback port, keeping what it decodes."""
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    async with served(app) as url:
        yield f"{url}/v1/traces", received


async def test_spans_are_sent_over_otlp_http_when_enabled(
    start_server: StartServer,
    tmp_path: Path,
    otlp_receiver: tuple[str, list[ExportTraceServiceRequest]],
) -> None:
    endpoint, received = otlp_receiver
    server = start_server(parallel=1)
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        disk={"enabled": False},
        tracing={"enabled": True, "otlp_endpoint": endpoint, "service_name": "proxy-under-test"},
    )
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        body = {"prompt": words(7), "n_predict": 2}
        async with client.post(url + "/completion", json=body) as response:
            assert response.status == 200
    # the proxy's stop flushed the batch processor: the spans reached the receiver

    def attribute(attributes: Any, name: str) -> Any:
        for item in attributes:
            if item.key == name:
                return item.value
        return None

    names, services = [], set()
    for message in received:
        for resource_spans in message.resource_spans:
            services.add(attribute(resource_spans.resource.attributes, "service.name").string_value)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    names.append(span.name)
                    if span.name == "upstream":
                        assert attribute(span.attributes, "cacheproxy.slot").int_value == 0
    assert services == {"proxy-under-test"}
    assert sorted(names) == sorted(["POST /completion", "auth", "mirror", "queue", "upstream"])
