"""Bounded bodies, on real processes: `cacheproxy serve` in front of a real llama-server, real
sockets, a real kill -9. Big bodies are spilled to disk within their bounds and forwarded from
there, a body cannot take longer than `clients.body_max_s`, what a crash left is removed at the
next start, a huge id prompt is refused without the parser's worker, and a request head too
large gets llama-server's envelope."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.http.spill_folder import BODY_PREFIX
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.completions import without
from tests.support.metrics import proxy_counters
from tests.support.raw_http import open_connection, raw_request, read_response, request_bytes
from tests.support.serve_process import ServeProcess, start_serve
from tests.support.servers import LlamaServer, child_pids
from tests.support.waiting import wait_for

MB = 1_000_000
PROMPT = [1, 450, 4996, 17354]
WAIT_S = 120.0  # how long a test waits for what must happen (not a bound it asserts)
ADMIN_KEY = "admin-key-of-the-bodies-test"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# bodies a test holds half sent while it sends others wait as long as those take on a busy
# machine: the body deadlines are not what such a test is about
HELD_BODIES_WAIT = {
    "CACHEPROXY_CLIENTS__BODY_TIMEOUT_S": str(10 * WAIT_S),
    "CACHEPROXY_CLIENTS__BODY_MAX_S": str(10 * WAIT_S),
}


def padded(size: int) -> bytes:
    """An ordinary completion made big by a member the proxy never reads."""
    return orjson.dumps({"prompt": PROMPT, "n_predict": 1, "padding": "x" * size})


def spilled_bodies(tmp_path: Path) -> set[Path]:
    return set((tmp_path / "state" / "bodies").glob(f"*/{BODY_PREFIX}*"))


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, server: LlamaServer, **env: str) -> AsyncIterator[ServeProcess]:
    proxy = await start_serve(tmp_path, "--upstream", server.url, env=env)
    try:
        yield proxy
    finally:
        await proxy.stop()


@contextlib.asynccontextmanager
async def partly_sent(
    url: str,
    body: bytes,
    sent: int,
    headers: dict[str, str] | None = None,
    path: str = "/completion",
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A POST whose head and first `sent` bytes of body are on their way."""
    reader, writer = await open_connection(url)
    message = request_bytes("POST", path, headers, body)
    writer.write(message[: len(message) - len(body) + sent])
    await writer.drain()
    try:
        yield reader, writer
    finally:
        writer.close()


async def post(
    client: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict, dict[str, str]]:
    async with client.post(url + "/completion", data=body, headers=headers) as response:
        return response.status, orjson.loads(await response.read()), dict(response.headers)


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as session:
        yield session


async def test_bodies_a_kill_9_left_are_removed_at_the_next_start(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    body = padded(60 * MB)
    async with serving(tmp_path, llama_server) as proxy:
        async with partly_sent(proxy.url, body, 8 * MB):
            spilled = "a body spilled to state_dir/bodies"
            await wait_for(lambda: spilled_bodies(tmp_path), spilled, WAIT_S)
            left = spilled_bodies(tmp_path)
            proxy.process.kill()  # SIGKILL, mid-body
            await proxy.process.wait()
    assert left and all(path.exists() for path in left)  # the crash left them
    async with serving(tmp_path, llama_server) as proxy:
        assert not any(path.exists() for path in left)
        assert spilled_bodies(tmp_path) == set()
        status, answer, _ = await post(client, proxy.url, padded(3 * MB))  # spilled again
        assert status == 200 and answer["tokens_predicted"] == 1


async def test_a_body_keeping_pace_is_cut_at_the_absolute_deadline(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    """It starts fast (its bytes buy hours of rate) and never pauses long: only
    `clients.body_max_s` ends it, with 408 while it is still being sent."""
    limits = {
        "CACHEPROXY_CLIENTS__BODY_MAX_S": "3",
        "CACHEPROXY_CLIENTS__BODY_TIMEOUT_S": "2",
        "CACHEPROXY_CLIENTS__BODY_MIN_BYTES_PER_S": "1",
    }
    body = orjson.dumps({"prompt": "hello " * 4000, "n_predict": 1})  # 24 KB
    async with serving(tmp_path, llama_server, **limits) as proxy:
        sent = 8000
        async with partly_sent(proxy.url, body, sent) as (reader, writer):

            async def trickle() -> None:
                nonlocal sent
                while sent < len(body) - 10:
                    await asyncio.sleep(0.5)  # shorter than the pause allowed
                    writer.write(body[sent : sent + 10])
                    sent += 10

            trickling = asyncio.create_task(trickle())
            try:
                answer = await asyncio.wait_for(read_response(reader), WAIT_S)
            finally:
                trickling.cancel()
            assert answer.status == 408
            error = orjson.loads(answer.body)["error"]
            assert error["code"] == 408 and "not complete within 3 s" in error["message"]
            assert sent < len(body) - 10  # cut while it was still coming
            assert answer.headers.get("connection") == "close"
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""


async def test_a_tenant_past_its_spill_bound_is_refused_while_another_is_served(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    (tmp_path / "state").mkdir()
    with TenantRegistry(tmp_path / "state" / "cacheproxy.db") as registry:
        _, alice_key = registry.create("alice")
        _, bob_key = registry.create("bob")
    alice = {"Authorization": f"Bearer {alice_key}"}
    bob = {"Authorization": f"Bearer {bob_key}"}
    body = padded(60 * MB)
    bound = {
        "CACHEPROXY_BODIES__MAX_SPILLED_BYTES_PER_TENANT": str(130 * MB),
        "CACHEPROXY_TENANTS__ADMIN_API_KEY": ADMIN_KEY,
        **HELD_BODIES_WAIT,
    }
    async with serving(tmp_path, llama_server, **bound) as proxy:
        async with (
            partly_sent(proxy.url, body, 10 * MB, alice) as first,
            partly_sent(proxy.url, body, 10 * MB, alice) as second,
        ):
            two = "alice's two bodies spilled"
            await wait_for(lambda: len(spilled_bodies(tmp_path)) == 2, two, WAIT_S)
            # a third would take alice past 130 MB: refused before its body is read
            async with partly_sent(proxy.url, body, 0, alice) as (reader, _):
                third = await asyncio.wait_for(read_response(reader), WAIT_S)
            assert third.status == 429 and third.headers["retry-after"] == "1"
            error = orjson.loads(third.body)["error"]
            assert (error["code"], error["type"]) == (429, "body_limit_error")
            held = await proxy_counters(client, proxy.url, ADMIN)
            assert held["cacheproxy_body_spilled_bytes"] == 2 * len(body)  # declared: reserved
            assert held['cacheproxy_body_spill_refusals_total{bound="tenant"}'] == 1
            # bob's bound is his own
            status, answer, _ = await post(client, proxy.url, body, bob)
            assert status == 200 and answer["tokens_predicted"] == 1
            for reader, writer in (first, second):  # alice's held bodies finish, and are served
                writer.write(body[10 * MB :])
                done = await asyncio.wait_for(read_response(reader), WAIT_S)
                assert done.status == 200 and orjson.loads(done.body)["tokens_predicted"] == 1
        # their bytes were given back: alice spills again
        status, answer, _ = await post(client, proxy.url, body, alice)
        assert status == 200 and answer["tokens_predicted"] == 1
        given_back = await proxy_counters(client, proxy.url, ADMIN)
        assert given_back["cacheproxy_body_spilled_bytes"] == 0


async def test_a_big_body_the_proxy_passes_through_is_spilled_within_the_tenants_bound(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """`/tokenize` is relayed as it is: its big body is spilled and sent from the file, counted
    in the tenant's bound like a task's, not held in the proxy's memory."""
    (tmp_path / "state").mkdir()
    with TenantRegistry(tmp_path / "state" / "cacheproxy.db") as registry:
        _, alice_key = registry.create("alice")
    alice = {"Authorization": f"Bearer {alice_key}"}
    body = orjson.dumps({"content": "the cache keeps what it can. " * 100_000})  # 2.9 MB
    async with client.post(llama_server.url + "/tokenize", data=body) as response:
        direct = await response.json()
    bound = {
        "CACHEPROXY_BODIES__MAX_SPILLED_BYTES_PER_TENANT": str(5 * MB),
        "CACHEPROXY_TENANTS__ADMIN_API_KEY": ADMIN_KEY,
        **HELD_BODIES_WAIT,
    }
    async with serving(tmp_path, llama_server, **bound) as proxy:
        async with partly_sent(proxy.url, body, MB, alice, "/tokenize") as (reader, writer):
            await wait_for(lambda: len(spilled_bodies(tmp_path)) == 1, "body spilled", WAIT_S)
            held = await proxy_counters(client, proxy.url, ADMIN)
            assert held["cacheproxy_body_spilled_bytes"] == len(body)
            # a second would take alice past 5 MB: refused before its body is read
            async with partly_sent(proxy.url, body, 0, alice, "/tokenize") as (second, _):
                refused = await asyncio.wait_for(read_response(second), WAIT_S)
            assert refused.status == 429 and refused.headers["retry-after"] == "1"
            writer.write(body[MB:])
            done = await asyncio.wait_for(read_response(reader), WAIT_S)
            assert done.status == 200 and orjson.loads(done.body) == direct
        given_back = await proxy_counters(client, proxy.url, ADMIN)
        assert given_back["cacheproxy_body_spilled_bytes"] == 0
        assert given_back['cacheproxy_body_spill_refusals_total{bound="tenant"}'] == 1


async def test_six_big_bodies_are_forwarded_from_disk_in_bounded_memory(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Six 60 MB bodies at once, each accepted and forwarded: the proxy's memory grows by less
    than one of them (each was read back whole before, 487 MiB), /health answers meanwhile."""
    body = padded(60 * MB)
    async with serving(tmp_path, llama_server) as proxy:
        pid = proxy.process.pid
        before = status_kib(pid, "VmRSS")
        uploads = [asyncio.create_task(post(client, proxy.url, body)) for _ in range(6)]
        health: list[int] = []
        while not all(upload.done() for upload in uploads):
            async with client.get(proxy.url + "/health") as response:
                health.append(response.status)
            await asyncio.sleep(0.05)
        answers = [await upload for upload in uploads]
        peak = status_kib(pid, "VmHWM")  # the highest the proxy's resident memory went
        workers = child_pids(pid)
        worker_peak = max((status_kib(worker, "VmHWM") for worker in workers), default=0)
    print(f"proxy RSS {before >> 10} MiB before, peak {peak >> 10} MiB;", end=" ")
    print(f"parser worker peak {worker_peak >> 10} MiB; /health answered {len(health)} times")
    assert [(status, answer["tokens_predicted"]) for status, answer, _ in answers] == [(200, 1)] * 6
    assert len(health) >= 3 and set(health) == {200}  # answered while the bodies were at work
    assert peak - before < 48 << 10, (before, peak)  # less than one 60 MB body
    assert spilled_bodies(tmp_path) == set()


async def test_a_huge_id_prompt_is_refused_without_the_parsers_worker(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """5 million ids: counted from the spilled bytes, never parsed into Python ints (the
    worker that parses big bodies never starts)."""
    body = orjson.dumps({"prompt": [1000 + i % 20000 for i in range(5_000_000)], "n_predict": 1})
    async with serving(tmp_path, llama_server) as proxy:
        pid = proxy.process.pid
        spent = []
        for _ in range(2):
            cpu_before = cpu_seconds(pid)
            status, answer, _ = await post(client, proxy.url, body)
            spent.append(cpu_seconds(pid) - cpu_before)
            assert status == 400
            error = answer["error"]
            assert error["type"] == "exceed_context_size_error"
            assert (error["n_prompt_tokens"], error["n_ctx"]) == (5_000_000, 4096)
        assert child_pids(pid) == []
        assert spilled_bodies(tmp_path) == set()
    print(f"proxy CPU per refusal of {len(body) / MB:.0f} MB: {spent}")


async def test_a_header_too_large_gets_431_in_the_envelope_without_its_bytes(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    secret = "s3cr3t" * 1500  # 9000 bytes: over aiohttp's 8190
    async with serving(tmp_path, llama_server) as proxy:
        for headers in ({"X-Api-Key": secret}, {f"X-H{n}": secret[:20] for n in range(200)}):
            answer = await raw_request(proxy.url, "GET", "/health", headers)
            assert answer.status == 431
            assert answer.headers["content-type"].startswith("application/json")
            assert orjson.loads(answer.body) == {
                "error": {
                    "code": 431,
                    "message": "request header fields too large",
                    "type": "invalid_request_error",
                }
            }
        assert (await raw_request(proxy.url, "GET", "/health")).status == 200
        assert secret[:20] not in proxy.log()  # nor in the log


CHAT = [{"role": "user", "content": "Name three colours."}]
# every shape of request a big body can take through the request path: pinned, split (members
# dropped and changed), converted (an agent API, serialised whole)
SHAPES: dict[str, tuple[str, dict]] = {
    "native": ("/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0}),
    "native n_cmpl=2, seeded": (
        "/completion",
        {"prompt": "Once upon a time", "n_cmpl": 2, "n_predict": 4, "temperature": 0, "seed": 7},
    ),
    "oai batch n=2": (
        "/v1/completions",
        {"prompt": ["Once upon a time", "The sky is"], "n": 2, "max_tokens": 4, "temperature": 0},
    ),
    "chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0}),
    "chat n=2": (
        "/v1/chat/completions",
        {"messages": CHAT, "n": 2, "max_tokens": 4, "temperature": 0, "seed": 42},
    ),
    "responses": (
        "/v1/responses",
        {"input": "Name three colours.", "max_output_tokens": 16, "temperature": 0},
    ),
    "anthropic": ("/v1/messages", {"messages": CHAT, "max_tokens": 4, "temperature": 0}),
}
# what differs between two runs or two slots (the second reuses the first's prefix), not
# between two bodies
UNCOMPARED = frozenset(
    {"id", "created", "created_at", "completed_at", "timings", "id_slot", "usage", "cached_tokens"}
)


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_big_body_is_answered_as_the_same_body_small(
    proxy: str, client: aiohttp.ClientSession, shape: str
) -> None:
    """Made big by a member the proxy never reads, it is spilled, forwarded from its file
    with the proxy's changes appended, and answered as the small one."""
    path, document = SHAPES[shape]
    answers = []
    for extra in ({}, {"client_padding": "x" * (2 * MB)}):
        async with client.post(proxy + path, json={**document, **extra}) as response:
            answer = orjson.loads(await response.read())
            answers.append((response.status, without(answer, UNCOMPARED)))
    assert answers[0][0] == 200, answers[0]
    assert answers[1] == answers[0]
