"""How many prompt tokens llama-server decodes, alone and behind cacheproxy, against the oracle.

For every llama-server `--cache-ram` value asked for, every workload (W1 shared prefix, W2
multi-turn, W3 multi-turn with a restart; see `workloads.py`) runs once per arm:

- `direct`: a fresh llama-server, the requests sent to it;
- `proxy`: a fresh llama-server with the same flags, the requests sent through
  `python -m cacheproxy serve --upstream URL` (a separate process).

A fresh server per run means every run starts with empty caches. Per arm the report gives the
prompt tokens sent, the tokens decoded (sum of `timings.prompt_n`), the oracle (what an infinite
cache would still decode, computed from the tokens that arm actually sent and got back), their
ratio, wall time and time to first token; then proxy/direct ratios. It asserts nothing: it measures.

`cacheproxy bench cache --workload W1 W2 --cache-ram 0 8192 [--json figures.json]`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from cacheproxy.bench.overhead import (
    HOST,
    STREAM_HEADERS,
    BenchmarkError,
    ChildProcess,
    ProcessSet,
    fail_on_bad_status,
    invoked_command,
    progress,
    proxy_command,
    run_with_processes,
    table_row,
    wait_healthy,
)
from cacheproxy.bench.workloads import (
    Exchange,
    MultiTurnSpec,
    MultiTurnWorkload,
    Request,
    SharedPrefixSpec,
    Tokens,
    multi_turn_workload,
    oracle,
    shared_prefix_workload,
    with_restart,
)
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.upstreams.managed import free_port, llama_server_args

WORKLOADS = ("W1", "W2", "W3")
ARMS = ("direct", "proxy")
DEFAULT_WORKLOADS = ("W1", "W2")
DEFAULT_CACHE_RAM_MIB = (0, 8192)
# One compute thread: on a 2-core machine shared with the load generator and the proxy, fewer
# spinning threads means less noise; the figures that matter are token counts anyway.
DEFAULT_SERVER_ARGS = ("--threads", "1")
# The llama-spm vocabulary's byte-fallback tokens <0x00>..<0xFF> are ids 3..258. llama-server
# streams no chunk (so no id) for a token that leaves incomplete UTF-8, and random weights pick
# byte tokens often: they are forbidden, so every generated id arrives in the stream.
BYTE_TOKEN_FIRST_ID = 3
BYTE_TOKEN_COUNT = 256
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=900)
PROGRESS_EVERY = 16


# --- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerOptions:
    """llama-server flags every arm shares (besides host, port and slot folder)."""

    parallel: int = 4
    ctx_size: int = 4 * 4096
    extra_args: tuple[str, ...] = DEFAULT_SERVER_ARGS

    @property
    def slot_context(self) -> int:
        # Without unified KV (an explicit --parallel), each slot gets an equal share.
        return self.ctx_size // self.parallel


@dataclass(frozen=True)
class CacheBenchConfig:
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    cache_ram_mib: tuple[int, ...] = DEFAULT_CACHE_RAM_MIB
    arms: tuple[str, ...] = ARMS
    model_size: str = "small"
    seed: int = 1
    in_flight: int = 4
    # The proxy arm's llama-server RAM cache (None: the same as the direct arm's), so the proxy
    # can run with the flags it needs (its disk tier in place of the server's RAM cache).
    proxy_server_cache_ram_mib: int | None = None
    disk_budget_mib: int = 1024
    server: ServerOptions = field(default_factory=ServerOptions)
    shared_prefix: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)
    multi_turn: MultiTurnSpec = field(default_factory=MultiTurnSpec)

    def __post_init__(self) -> None:
        unknown = (set(self.workloads) - set(WORKLOADS)) | (set(self.arms) - set(ARMS))
        if unknown:
            raise ValueError(f"unknown workload or arm: {sorted(unknown)}")
        if not (self.workloads and self.arms and self.cache_ram_mib):
            raise ValueError("nothing to run: give at least one workload, arm and cache-ram value")
        if self.in_flight < 1:
            raise ValueError("in_flight must be at least 1")
        check_context_fits(self)

    def longest_sequence(self, workload: str) -> int:
        if workload == "W1":
            return self.shared_prefix.longest_sequence
        return self.multi_turn.longest_sequence


def check_context_fits(config: CacheBenchConfig) -> None:
    """Fail before starting anything if a slot cannot hold a workload's longest request:
    llama-server refuses a prompt that fills the slot and stops generating one token early."""
    for workload in config.workloads:
        needed = config.longest_sequence(workload) + 1
        if needed > config.server.slot_context:
            raise ValueError(
                f"{workload}'s longest prompt + output needs {needed} tokens per slot, but"
                f" ctx_size {config.server.ctx_size} / parallel {config.server.parallel} gives"
                f" {config.server.slot_context}: raise ctx_size or shorten the workload"
            )


# --- talking to llama-server --------------------------------------------------------------------


def tenant_key(tenant: str) -> str:
    """The API key a tenant's client would hold; a proxy with tenants tells them apart by it."""
    return f"key-{tenant}"


def byte_token_ids() -> tuple[int, ...]:
    return tuple(range(BYTE_TOKEN_FIRST_ID, BYTE_TOKEN_FIRST_ID + BYTE_TOKEN_COUNT))


async def post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, data=orjson.dumps(body), headers=STREAM_HEADERS) as response:
        await fail_on_bad_status(response)
        return await response.json()


async def check_byte_tokens(session: aiohttp.ClientSession, base_url: str) -> None:
    """The model's ids 3..258 must be the byte tokens <0x00>..<0xFF>: detokenizing the printable
    ASCII ones (the others are not valid UTF-8 on their own) must give those characters back."""
    printable = range(0x21, 0x7F)
    ids = [BYTE_TOKEN_FIRST_ID + byte for byte in printable]
    answer = await post_json(session, base_url + "/detokenize", {"tokens": ids})
    expected = bytes(printable).decode("ascii")
    if answer.get("content") != expected:
        raise BenchmarkError(
            f"this model's ids {BYTE_TOKEN_FIRST_ID}..{BYTE_TOKEN_FIRST_ID + BYTE_TOKEN_COUNT - 1}"
            f" are not the byte tokens <0x00>..<0xFF> of the llama-spm vocab: ids {ids[:3]}... "
            f"detokenize to {answer.get('content', '')[:40]!r}, not {expected[:3]!r}..."
        )


async def slot_context_of(session: aiohttp.ClientSession, base_url: str) -> int:
    async with session.get(base_url + "/props") as response:
        await fail_on_bad_status(response)
        props = await response.json()
    return int(props["default_generation_settings"]["n_ctx"])


def completion_body(request: Request, banned_tokens: Sequence[int]) -> bytes:
    return orjson.dumps(
        {
            "prompt": request.prompt,
            "n_predict": request.n_predict,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_tokens": True,
            "cache_prompt": True,
            "logit_bias": [[token, False] for token in banned_tokens],
        }
    )


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Each `data:` JSON object of the stream; pings and comments skipped.

    Events are split by hand rather than by line: the final event carries the whole prompt as
    text and can be longer than aiohttp's line limit.
    """
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        *complete, buffer = buffer.split(b"\n\n")
        for event in complete:
            for payload in data_payloads(event):
                yield payload
    for payload in data_payloads(buffer):
        yield payload


def data_payloads(event: bytes) -> Iterator[dict[str, Any]]:
    for line in event.splitlines():
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            yield orjson.loads(line[6:])


@dataclass(frozen=True)
class Completion:
    """One request as it happened, with the server's own accounting."""

    request: Request
    issue_index: int
    output: Tokens
    prompt_n: int
    cache_n: int
    ttft_s: float
    total_s: float

    @property
    def exchange(self) -> Exchange:
        return Exchange(self.request.prompt, self.output)

    @property
    def accounted(self) -> bool:
        """Whether cached + decoded tokens add up to the prompt, as they should."""
        return self.cache_n + self.prompt_n == len(self.request.prompt)


@dataclass
class StreamedAnswer:
    """What a completion stream has delivered so far."""

    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    final: dict[str, Any] | None = None

    def take(self, event: dict[str, Any]) -> None:
        if "error" in event:
            raise BenchmarkError(f"the stream ended with an error: {event['error']}")
        if event.get("stop"):
            self.final = event
        elif "prompt_progress" not in event:  # progress chunks carry a fake token id 0
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.tokens.extend(event.get("tokens", ()))

    def timings(self, where: str) -> dict[str, Any]:
        """The final chunk's timings, once checked against the tokens the stream delivered."""
        if self.final is None or "timings" not in self.final:
            raise BenchmarkError(f"{where}: the stream ended without a final chunk with timings")
        timings = self.final["timings"]
        if len(self.tokens) != timings["predicted_n"]:
            raise BenchmarkError(
                f"{where}: the stream delivered {len(self.tokens)} token ids but the server"
                f" generated {timings['predicted_n']}: some ids were not streamed"
            )
        return timings


@dataclass
class CompletionClient:
    """Sends workload requests to one arm, numbering them in the order they are sent."""

    session: aiohttp.ClientSession
    arm: str
    base_url: str
    banned_tokens: tuple[int, ...]
    completions: list[Completion] = field(default_factory=list)
    _issued: Iterator[int] = field(default_factory=itertools.count)

    async def complete(self, request: Request) -> Completion:
        issue_index = next(self._issued)
        where = f"{self.arm} arm, request {issue_index} ({request.conversation})"
        headers = {**STREAM_HEADERS, "Authorization": f"Bearer {tenant_key(request.tenant)}"}
        answer = StreamedAnswer()
        started = time.perf_counter()
        try:
            async with self.session.post(
                self.base_url + "/completion",
                data=completion_body(request, self.banned_tokens),
                headers=headers,
            ) as response:
                await fail_on_bad_status(response)
                async for event in sse_events(response):
                    answer.take(event)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchmarkError(f"{where} ({self.base_url}) failed: {exc!r}") from exc
        finished = time.perf_counter()
        timings = answer.timings(where)
        completion = Completion(
            request=request,
            issue_index=issue_index,
            output=tuple(answer.tokens),
            prompt_n=timings["prompt_n"],
            cache_n=timings["cache_n"],
            ttft_s=(answer.first_token_at or finished) - started,
            total_s=finished - started,
        )
        self.completions.append(completion)
        if len(self.completions) % PROGRESS_EVERY == 0:
            progress(f"  {self.arm}: {len(self.completions)} requests done")
        return completion


# --- running the workloads ----------------------------------------------------------------------

RestartHook = Callable[[], Awaitable[None]]


async def run_requests(
    client: CompletionClient, requests: Sequence[Request], in_flight: int
) -> None:
    """W1: `in_flight` workers take the next request from the list until none is left."""
    pending = iter(requests)

    async def worker() -> None:
        for request in pending:  # one iterator shared by all: each request is taken once
            await client.complete(request)

    async with asyncio.TaskGroup() as workers:
        for index in range(in_flight):
            workers.create_task(worker(), name=f"request-worker-{index}")


class RoundRobinTurns:
    """Hands out the next turn of each conversation, one conversation after the other; a
    conversation comes back to the end of the line once its previous turn is answered."""

    def __init__(self, workload: MultiTurnWorkload, turns: range, workers: int) -> None:
        self._turns = turns
        self._workers = workers
        self._open = len(workload.conversations)
        self._line: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        for index in range(len(workload.conversations)):
            self._line.put_nowait((index, turns.start))

    async def next_turn(self) -> tuple[int, int] | None:
        """(conversation index, turn), or None once every conversation is through."""
        return await self._line.get()

    def answered(self, conversation: int, turn: int) -> None:
        if turn + 1 < self._turns.stop:
            self._line.put_nowait((conversation, turn + 1))
            return
        self._open -= 1
        if self._open == 0:
            for _ in range(self._workers):  # wake every worker still waiting, to stop it
                self._line.put_nowait(None)


async def run_conversations(
    client: CompletionClient, workload: MultiTurnWorkload, in_flight: int, restart: RestartHook
) -> None:
    """W2/W3: `in_flight` workers run turns round-robin over the users; each answer becomes part
    of that user's next prompt. Between phases (W3), `restart` is awaited with nothing in flight."""
    answers: list[list[Tokens]] = [[] for _ in workload.conversations]
    for phase, turns in enumerate(workload.phases()):
        if phase > 0:
            await restart()
        line = RoundRobinTurns(workload, turns, in_flight)

        async def worker(line: RoundRobinTurns = line) -> None:
            while (item := await line.next_turn()) is not None:
                index, turn = item
                request = workload.conversations[index].request(turn, answers[index])
                completion = await client.complete(request)
                answers[index].append(completion.output)
                line.answered(index, turn)

        async with asyncio.TaskGroup() as workers:
            for index in range(in_flight):
                workers.create_task(worker(), name=f"turn-worker-{index}")


# --- processes ----------------------------------------------------------------------------------


@dataclass
class UpstreamServer:
    """One arm's llama-server; a restart brings it back on the same port with the same flags."""

    processes: ProcessSet
    name: str
    args: list[str]
    url: str
    slot_save_path: Path
    starts: int = 0
    child: ChildProcess | None = None

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.starts += 1
        name = self.name if self.starts == 1 else f"{self.name}-start{self.starts}"
        progress(f"starting {name}: {shlex.join(self.args)}")
        self.processes.start(name, self.args)
        self.child = self.processes.find(name)
        await wait_healthy(session, self.child, self.url)

    async def restart(self, session: aiohttp.ClientSession) -> None:
        """Kill it (as a crash would) and start it again: every cache it held is gone."""
        if self.child is not None and self.child.process.poll() is None:
            self.child.process.kill()
            self.child.process.wait()
        await self.start(session)


def prepare_upstream(
    processes: ProcessSet, name: str, config: CacheBenchConfig, cache_ram_mib: int
) -> UpstreamServer:
    """Prepare (not yet start) a fresh llama-server with the run's flags and its own slot folder."""
    slot_save_path = processes.workdir / f"{name}-slots"
    slot_save_path.mkdir()
    port = free_port(HOST)
    args = llama_server_args(
        ensure_llama_server(),
        ensure_model(config.model_size),
        host=HOST,
        port=port,
        parallel=config.server.parallel,
        ctx_size=config.server.ctx_size,
        cache_ram_mib=cache_ram_mib,
        slot_save_path=slot_save_path,
        extra_args=config.server.extra_args,
    )
    return UpstreamServer(processes, name, args, f"http://{HOST}:{port}", slot_save_path)


async def start_proxy(
    processes: ProcessSet,
    session: aiohttp.ClientSession,
    name: str,
    upstream: UpstreamServer,
    disk_budget_mib: int,
) -> tuple[str, list[str]]:
    """Start `cacheproxy serve` in front of `upstream`; return its base URL and command."""
    port = free_port(HOST)
    args = proxy_command(upstream.url, port)
    env = {
        **os.environ,
        # its own state folder, so a run never touches the user's cacheproxy state
        "CACHEPROXY_STATE_DIR": str(processes.workdir / f"{name}-state"),
        # the disk tier archives where llama-server saves slots
        "CACHEPROXY_DISK__DIRECTORY": str(upstream.slot_save_path),
        "CACHEPROXY_DISK__BUDGET_MIB": str(disk_budget_mib),
    }
    progress(f"starting {name}: {shlex.join(args)}")
    processes.start(name, args, env=env)
    url = f"http://{HOST}:{port}"
    await wait_healthy(session, processes.find(name), url)
    return url, args


async def check_server(session: aiohttp.ClientSession, server: UpstreamServer, needed: int) -> None:
    """The model's byte tokens are where we ban them, and a slot holds the longest request."""
    await check_byte_tokens(session, server.url)
    slot_context = await slot_context_of(session, server.url)
    if slot_context < needed:
        raise BenchmarkError(
            f"{server.name} gives each slot {slot_context} tokens of context; the workload's"
            f" longest prompt + output needs {needed}"
        )


# --- one arm --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmRun:
    workload: str
    cache_ram_mib: int
    arm: str
    completions: tuple[Completion, ...]
    wall_s: float
    restarts: int
    llama_server_command: str
    proxy_command: str | None
    server_cache_ram_mib: int  # what this arm's llama-server ran with
    disk: dict[str, float] = field(default_factory=dict)  # the proxy's disk-tier counters

    @property
    def in_issue_order(self) -> list[Completion]:
        return sorted(self.completions, key=lambda completion: completion.issue_index)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(completion.request.prompt) for completion in self.completions)

    @property
    def decoded(self) -> int:
        return sum(completion.prompt_n for completion in self.completions)

    @property
    def cached(self) -> int:
        return sum(completion.cache_n for completion in self.completions)

    @functools.cached_property
    def oracle(self) -> int:
        return sum(oracle(completion.exchange for completion in self.in_issue_order))

    @property
    def unaccounted(self) -> int:
        """Requests whose cache_n + prompt_n is not their prompt length (expected: none)."""
        return sum(not completion.accounted for completion in self.completions)

    def ttft_ms(self, quantile: int) -> float:
        """TTFT percentile `quantile` (1..99) in ms, inclusive method."""
        samples = [completion.ttft_s * 1000 for completion in self.completions]
        if len(samples) < 2:
            return samples[0] if samples else float("nan")
        return statistics.quantiles(samples, n=100, method="inclusive")[quantile - 1]


@dataclass(frozen=True)
class RunContext:
    config: CacheBenchConfig
    processes: ProcessSet
    session: aiohttp.ClientSession


async def run_arm(context: RunContext, workload: str, cache_ram_mib: int, arm: str) -> ArmRun:
    name = f"{workload}-cram{cache_ram_mib}-{arm}"
    config = context.config
    server_cache_ram = cache_ram_mib
    if arm == "proxy" and config.proxy_server_cache_ram_mib is not None:
        server_cache_ram = config.proxy_server_cache_ram_mib
    server = prepare_upstream(context.processes, f"{name}-llama-server", config, server_cache_ram)
    await server.start(context.session)
    proxy_command = None
    disk: dict[str, float] = {}
    try:
        await check_server(context.session, server, config.longest_sequence(workload) + 1)
        base_url = server.url
        if arm == "proxy":
            base_url, args = await start_proxy(
                context.processes, context.session, f"{name}-proxy", server, config.disk_budget_mib
            )
            proxy_command = shlex.join(args)
        client = CompletionClient(context.session, arm, base_url, byte_token_ids())

        async def restart() -> None:
            progress(f"{name}: restarting llama-server on the same port")
            await server.restart(context.session)

        progress(f"{name}: running {workload}")
        started = time.perf_counter()
        await run_workload(client, config, workload, restart)
        wall_s = time.perf_counter() - started
        if arm == "proxy":
            disk = await disk_tier_counters(context.session, base_url)
    finally:
        # Stop this arm's processes now: the next arm must not share the CPUs with them.
        for child in reversed(context.processes.children):
            if child.name.startswith(f"{name}-"):
                child.stop()
    return ArmRun(
        workload=workload,
        cache_ram_mib=cache_ram_mib,
        arm=arm,
        completions=tuple(client.completions),
        wall_s=wall_s,
        restarts=server.starts - 1,
        llama_server_command=shlex.join(server.args),
        proxy_command=proxy_command,
        server_cache_ram_mib=server_cache_ram,
        disk=disk,
    )


DISK_COUNTERS = {
    "saves": 'cacheproxy_archive_saves_total{outcome="saved"}',
    "save_bytes": "cacheproxy_archive_saved_bytes_total",
    "save_s": "cacheproxy_archive_save_seconds_sum",
    "restores": 'cacheproxy_archive_restores_total{outcome="restored"}',
    "restore_bytes": "cacheproxy_archive_restored_bytes_total",
    "restore_s": "cacheproxy_archive_restore_seconds_sum",
    "failed_restores": 'cacheproxy_archive_restores_total{outcome="failed"}',
}


async def disk_tier_counters(session: aiohttp.ClientSession, proxy_url: str) -> dict[str, float]:
    """The proxy's saves and restores, with their bytes and time, from its /metrics."""
    async with session.get(proxy_url + "/metrics") as response:
        await fail_on_bad_status(response)
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            samples[name] = float(value)
    return {figure: samples.get(sample, 0.0) for figure, sample in DISK_COUNTERS.items()}


async def run_workload(
    client: CompletionClient, config: CacheBenchConfig, workload: str, restart: RestartHook
) -> None:
    if workload == "W1":
        requests = shared_prefix_workload(config.shared_prefix, config.seed)
        await run_requests(client, requests, config.in_flight)
        return
    spec = with_restart(config.multi_turn) if workload == "W3" else config.multi_turn
    await run_conversations(
        client, multi_turn_workload(spec, config.seed), config.in_flight, restart
    )


def rotated(arms: Sequence[str], by: int) -> list[str]:
    """The arms starting from a different one each run, so no arm always goes first."""
    start = by % len(arms)
    return [*arms[start:], *arms[:start]]


async def run_all(context: RunContext) -> list[ArmRun]:
    runs = []
    config = context.config
    plan = itertools.product(enumerate(config.cache_ram_mib), enumerate(config.workloads))
    for (ram_index, cache_ram_mib), (workload_index, workload) in plan:
        # Over the cache-ram values, each arm of a workload goes first in turn.
        for arm in rotated(config.arms, ram_index + workload_index):
            run = await run_arm(context, workload, cache_ram_mib, arm)
            progress(
                f"{workload} cache-ram {cache_ram_mib} {arm}: {len(run.completions)} requests,"
                f" decoded {run.decoded} = {run.decoded / run.oracle:.2f} x oracle,"
                f" wall {run.wall_s:.1f} s"
            )
            runs.append(run)
    return runs


# --- the report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheReport:
    command: str
    cpu_count: int | None
    load_average: tuple[float, float, float]
    platform: str
    model: str
    config: CacheBenchConfig
    runs: list[ArmRun]


def arm_figures(run: ArmRun) -> dict[str, Any]:
    oracle_total = run.oracle
    return {
        "requests": len(run.completions),
        "prompt_tokens_sent": run.prompt_tokens,
        "tokens_decoded": run.decoded,
        "tokens_cached": run.cached,
        "oracle": oracle_total,
        "decoded_over_oracle": run.decoded / oracle_total if oracle_total else None,
        "wall_s": run.wall_s,
        "ttft_p50_ms": run.ttft_ms(50),
        "ttft_p99_ms": run.ttft_ms(99),
        "restarts": run.restarts,
        "unaccounted_requests": run.unaccounted,
        "server_cache_ram_mib": run.server_cache_ram_mib,
        "disk_tier": run.disk,
    }


def proxy_over_direct(runs: Sequence[ArmRun]) -> dict[str, float] | None:
    by_arm = {run.arm: run for run in runs}
    if "direct" not in by_arm or "proxy" not in by_arm:
        return None
    direct, proxy = by_arm["direct"], by_arm["proxy"]
    return {
        "tokens_decoded": proxy.decoded / direct.decoded if direct.decoded else float("nan"),
        "wall_time": proxy.wall_s / direct.wall_s,
    }


def runs_of(report: CacheReport, workload: str, cache_ram_mib: int) -> list[ArmRun]:
    return [
        run
        for run in report.runs
        if run.workload == workload and run.cache_ram_mib == cache_ram_mib
    ]


def describe_workload(config: CacheBenchConfig, workload: str) -> str:
    if workload == "W1":
        spec = config.shared_prefix
        return (
            f"W1 shared prefix: {spec.groups} groups x {spec.prompts_per_group} prompts, prefix"
            f" {spec.prefix_tokens} + question {spec.question_tokens} tokens, n_predict"
            f" {spec.n_predict}, shuffled, {config.in_flight} in flight"
        )
    spec = config.multi_turn
    restart = (
        f", llama-server restarted after turn {with_restart(spec).restart_after_turn}"
        if workload == "W3"
        else ""
    )
    return (
        f"{workload} multi-turn: {spec.tenants} tenants x {spec.users_per_tenant} users x"
        f" {spec.turns} turns, tenant prefix {spec.tenant_prefix_tokens} + history"
        f" {spec.history_tokens}, question {spec.question_tokens}, answer {spec.n_predict}"
        f" generated tokens appended, {config.in_flight} in flight, round-robin over users"
        + restart
    )


FIGURE_COLUMNS = (
    "server cache-ram MiB",
    "arm",
    "requests",
    "prompt tokens sent",
    "tokens decoded",
    "oracle",
    "decoded/oracle",
    "wall s",
    "TTFT p50 ms",
    "TTFT p99 ms",
)


def figure_row(run: ArmRun) -> str:
    figures = arm_figures(run)
    ratio = figures["decoded_over_oracle"]
    return table_row(
        [
            str(run.server_cache_ram_mib),
            run.arm,
            str(figures["requests"]),
            str(figures["prompt_tokens_sent"]),
            str(figures["tokens_decoded"]),
            str(figures["oracle"]),
            "—" if ratio is None else f"{ratio:.2f}",
            f"{run.wall_s:.1f}",
            f"{figures['ttft_p50_ms']:.0f}",
            f"{figures['ttft_p99_ms']:.0f}",
        ]
    )


def disk_line(disk: dict[str, float]) -> str:
    mib = 1024 * 1024
    return (
        f"disk tier: {disk['saves']:.0f} saves ({disk['save_bytes'] / mib:.1f} MiB,"
        f" {disk['save_s'] * 1000:.0f} ms), {disk['restores']:.0f} restores"
        f" ({disk['restore_bytes'] / mib:.1f} MiB, {disk['restore_s'] * 1000:.0f} ms),"
        f" {disk['failed_restores']:.0f} failed restores"
    )


def workload_section(report: CacheReport, workload: str) -> Iterator[str]:
    yield f"## {describe_workload(report.config, workload)}"
    yield ""
    yield table_row(list(FIGURE_COLUMNS))
    yield table_row(["---:", "---", *["---:"] * (len(FIGURE_COLUMNS) - 2)])
    for cache_ram_mib in report.config.cache_ram_mib:
        for run in sorted(runs_of(report, workload, cache_ram_mib), key=lambda r: r.arm):
            yield figure_row(run)
    yield ""
    for cache_ram_mib in report.config.cache_ram_mib:
        ratios = proxy_over_direct(runs_of(report, workload, cache_ram_mib))
        if ratios is not None:
            yield (
                f"- cache-ram {cache_ram_mib}: proxy/direct tokens decoded"
                f" {ratios['tokens_decoded']:.3f}, wall time {ratios['wall_time']:.3f}"
            )
    for run in report.runs:
        if run.workload == workload and run.disk:
            yield f"- {run.arm} (cache-ram {run.cache_ram_mib} run): {disk_line(run.disk)}"
    for run in report.runs:
        if run.workload == workload and run.unaccounted:
            yield (
                f"- note: {run.arm}, cache-ram {run.cache_ram_mib}: {run.unaccounted} requests"
                " with cache_n + prompt_n != prompt length"
            )
    yield ""


def render_markdown(report: CacheReport) -> str:
    server = report.config.server
    lines = [
        "# cacheproxy cache benchmark",
        "",
        f"- command: `{report.command}`",
        f"- machine: {report.cpu_count} CPUs, {report.platform}; load average (1, 5, 15 min)"
        " at start: " + ", ".join(f"{load:.2f}" for load in report.load_average),
        f"- model: {report.model} (random weights); seed {report.config.seed}",
        f"- every arm: a fresh llama-server, --parallel {server.parallel} --ctx-size"
        f" {server.ctx_size} --cache-ram as in the tables, extra flags"
        f" `{shlex.join(server.extra_args)}`; direct = requests to it, proxy = requests through"
        " `cacheproxy serve --upstream` in front of it",
        "- requests: POST /completion, token-id prompts, temperature 0, ignore_eos, stream,"
        " byte tokens banned; decoded = sum of timings.prompt_n; oracle = prompt tokens an"
        " infinite cache would still decode, from that arm's own prompts and outputs (it counts"
        " a prompt still in flight as cached already, which no real cache can match)",
        "",
        *itertools.chain.from_iterable(
            workload_section(report, workload) for workload in report.config.workloads
        ),
        "## Commands (ports and folders differ per run; the JSON has each exact command)",
        "",
        *command_lines(report.runs),
    ]
    return "\n".join(lines)


# Options whose value changes from one process to the next; the report shows a placeholder.
VARYING_OPTIONS = {
    "--port": "<port>",
    "--upstream": "<llama-server url>",
    "--slot-save-path": "<dir>/",
}


def command_template(command: str) -> str:
    words = [shlex.quote(word) for word in shlex.split(command)]
    for index, word in enumerate(words[:-1]):
        if word in VARYING_OPTIONS:
            words[index + 1] = VARYING_OPTIONS[word]  # unquoted: a placeholder, not a value
    return " ".join(words)


def command_lines(runs: Sequence[ArmRun]) -> Iterator[str]:
    """Each distinct command once, with the runs that used it: arms whose llama-server flags are
    the same show up on the same line."""
    users: dict[str, list[str]] = {}
    for run in runs:
        label = f"{run.workload}/cache-ram {run.cache_ram_mib}/{run.arm}"
        users.setdefault(command_template(run.llama_server_command), []).append(label)
        if run.proxy_command is not None:
            users.setdefault(command_template(run.proxy_command), []).append(label)
    for template, labels in users.items():
        yield f"- `{template}`"
        yield f"  ({', '.join(labels)})"


def completion_as_json(completion: Completion) -> dict[str, Any]:
    return {
        "issue_index": completion.issue_index,
        "tenant": completion.request.tenant,
        "conversation": completion.request.conversation,
        "prompt_tokens": len(completion.request.prompt),
        "prompt_n": completion.prompt_n,
        "cache_n": completion.cache_n,
        "generated": len(completion.output),
        "ttft_ms": completion.ttft_s * 1000,
        "total_ms": completion.total_s * 1000,
    }


def report_as_json(report: CacheReport) -> dict[str, Any]:
    return {
        "command": report.command,
        "cpu_count": report.cpu_count,
        "load_average_at_start": list(report.load_average),
        "platform": report.platform,
        "model": report.model,
        "config": asdict(report.config),
        "runs": [
            {
                "workload": run.workload,
                "cache_ram_mib": run.cache_ram_mib,
                "arm": run.arm,
                **arm_figures(run),
                "llama_server_command": run.llama_server_command,
                "proxy_command": run.proxy_command,
                "requests_detail": [
                    completion_as_json(completion) for completion in run.in_issue_order
                ],
            }
            for run in report.runs
        ],
        "proxy_over_direct": {
            f"{workload}/cache-ram-{cache_ram_mib}": proxy_over_direct(
                runs_of(report, workload, cache_ram_mib)
            )
            for workload in report.config.workloads
            for cache_ram_mib in report.config.cache_ram_mib
        },
    }


# --- the run --------------------------------------------------------------------------------------


async def benchmark(config: CacheBenchConfig, processes: ProcessSet, command: str) -> CacheReport:
    # Taken before our own processes start: other work on the machine skews every arm.
    load_average = os.getloadavg()
    progress("locating llama-server and the model (a build in progress is waited for)")
    ensure_llama_server()
    model = ensure_model(config.model_size)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as session:
        runs = await run_all(RunContext(config, processes, session))
    return CacheReport(
        command=command,
        cpu_count=os.cpu_count(),
        load_average=load_average,
        platform=platform.platform(),
        model=model.name,
        config=config,
        runs=runs,
    )


def run_cache_benchmark(config: CacheBenchConfig, json_path: str | None = None) -> int:
    """Run every arm of every workload, print the Markdown report; return an exit code."""
    command = invoked_command()
    code, report = run_with_processes(
        "cacheproxy-cache-bench-", lambda processes: benchmark(config, processes, command)
    )
    if report is None:
        return code
    print(render_markdown(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report_as_json(report), indent=2) + "\n")
        progress(f"figures written to {json_path}")
    return 0


def run_from_options(
    *,
    workloads: Sequence[str],
    cache_ram_mib: Sequence[int],
    arms: Sequence[str],
    size: str,
    seed: int,
    server_args: str,
    json_path: str | None,
    proxy_cache_ram_mib: int | None = None,
    disk_budget_mib: int = 1024,
) -> int:
    """The CLI's entry: options in, exit code out (2 for a configuration that cannot run)."""
    try:
        config = CacheBenchConfig(
            workloads=tuple(dict.fromkeys(workloads)),
            cache_ram_mib=tuple(dict.fromkeys(cache_ram_mib)),
            arms=tuple(dict.fromkeys(arms)),
            model_size=size,
            seed=seed,
            proxy_server_cache_ram_mib=proxy_cache_ram_mib,
            disk_budget_mib=disk_budget_mib,
            server=ServerOptions(extra_args=tuple(shlex.split(server_args))),
        )
    except ValueError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    return run_cache_benchmark(config, json_path)
