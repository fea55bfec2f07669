"""How many prompt tokens llama-server decodes, alone and behind cacheproxy, against the oracle.

For every llama-server `--cache-ram` value asked for, every workload (W1 shared prefix, W2
multi-turn, W3 multi-turn with a restart; see `workloads.py`) runs once per arm:

- `direct`: a fresh llama-server, the requests sent to it;
- `proxy`: a fresh llama-server with the same flags, the requests sent through
  `python -m cacheproxy serve --upstream URL` (a separate process).

A fresh server per run means every run starts with empty caches, and on a settled disk: what
earlier runs wrote is written out first, so that its write-back does not slow this run's saves.
Per arm the report gives the prompt tokens sent, the tokens decoded (sum of
`timings.prompt_n`), the oracle (what an infinite cache would still decode, computed from the
tokens that arm actually sent and got back), their ratio, wall time and time to first token;
then proxy/direct ratios. It asserts nothing: it measures.

`cacheproxy bench cache --workload W1 W2 --cache-ram 0 8192 [--json figures.json]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from cacheproxy.bench.cache_client import (
    ArmRun,
    CompletionClient,
    byte_token_ids,
    check_byte_tokens,
    slot_context_of,
)
from cacheproxy.bench.cache_config import (
    LLAMA_SERVER_CACHE_RAM_MIB,
    CacheBenchConfig,
    ServerOptions,
)
from cacheproxy.bench.cache_report import CacheReport, render_markdown, report_as_json
from cacheproxy.bench.harness import (
    HOST,
    BenchmarkError,
    ChildProcess,
    ProcessSet,
    invoked_command,
    progress,
    proxy_command,
    rotated,
    run_clients,
    run_with_processes,
    wait_healthy,
)
from cacheproxy.bench.run_counters import disk_held, disk_tier_counters, server_counters
from cacheproxy.bench.workload_scale import MULTI_TURN_TOKENS, SHARED_PREFIX_TOKENS, scaled
from cacheproxy.bench.workloads import (
    MultiTurnSpec,
    MultiTurnWorkload,
    Request,
    SharedPrefixSpec,
    Tokens,
    model_name,
    multi_turn_workload,
    shared_prefix_workload,
    with_restart,
)
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model, model_folder, server_args
from cacheproxy.upstreams.managed import free_port, llama_server_args

REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=900)
# several models: model i has the weights of seed MODEL_SEEDS + i (the same shape each)
MODEL_SEEDS = 1234


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

    await run_clients({f"request-worker-{index}": worker() for index in range(in_flight)})


class RoundRobinTurns:
    """Hands out the next turn of each conversation, one conversation after the other; a
    conversation comes back to the end of the line once its previous turn is answered."""

    def __init__(self, turns: Sequence[range], workers: int) -> None:
        """`turns[i]`: the turns of conversation i to hand out (each its own count)."""
        self._turns = turns
        self._workers = workers
        self._open = len(turns)
        self._line: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        for index, its_turns in enumerate(turns):
            self._line.put_nowait((index, its_turns.start))

    async def next_turn(self) -> tuple[int, int] | None:
        """(conversation index, turn), or None once every conversation is through."""
        return await self._line.get()

    def answered(self, conversation: int, turn: int) -> None:
        if turn + 1 < self._turns[conversation].stop:
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
        line = RoundRobinTurns([turns] * len(workload.conversations), in_flight)

        async def worker(line: RoundRobinTurns = line) -> None:
            while (item := await line.next_turn()) is not None:
                index, turn = item
                request = workload.conversations[index].request(turn, answers[index])
                completion = await client.complete(request)
                answers[index].append(completion.output)
                line.answered(index, turn)

        await run_clients({f"turn-worker-{index}": worker() for index in range(in_flight)})


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
    first_model: str | None = None  # a router's: the model its checks ask for
    cpu_before_s: float = 0.0  # CPU seconds of the processes a restart killed
    waiting_before_s: float = 0.0  # their main threads' seconds waiting for a CPU

    @property
    def cpu_s(self) -> float:
        """CPU seconds used by every process of this server so far."""
        return self.cpu_before_s + (self.child.cpu_s() if self.child is not None else 0.0)

    @property
    def waiting_s(self) -> float:
        """Seconds its main loop was ready to run but waited for a CPU (others' load)."""
        now = self.child.main_thread_waiting_s() if self.child is not None else 0.0
        return self.waiting_before_s + now

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
            self.cpu_before_s += self.child.cpu_s()
            self.waiting_before_s += self.child.main_thread_waiting_s()
            self.child.process.kill()
            self.child.process.wait()
        await self.start(session)


def prepare_upstream(
    processes: ProcessSet, name: str, config: CacheBenchConfig, cache_ram_mib: int
) -> UpstreamServer:
    """Prepare (not yet start) a fresh llama-server with the run's flags and its own slot folder
    (several models: a router over a folder of them)."""
    router: tuple[str, ...] = ()
    if config.models > 1:
        seeds = {model_name(index): MODEL_SEEDS + index for index in range(config.models)}
        folder = model_folder(processes.workdir / f"{name}-models", seeds, config.model_size)
        router = ("--models-dir", str(folder))
        if config.models_max is not None:
            router += ("--models-max", str(config.models_max))
    return prepare_llama_server(
        processes, name, config.server, config.model_size, cache_ram_mib, router
    )


def prepare_llama_server(
    processes: ProcessSet,
    name: str,
    server: ServerOptions,
    model_size: str,
    cache_ram_mib: int,
    router: tuple[str, ...] = (),
) -> UpstreamServer:
    """A fresh llama-server (not yet started) with `server`'s flags and its own slot folder;
    `router`: the flags of a router-mode server (its models folder), which then has no model of
    its own."""
    slot_save_path = processes.workdir / f"{name}-slots"
    slot_save_path.mkdir()
    port = free_port(HOST)
    extra_args = (*router, *server_args(model_size), *server.extra_args)
    if server.defaults and not router:
        # its own RAM cache size goes unsaid, as a user starting it that way leaves it
        unsaid = cache_ram_mib == LLAMA_SERVER_CACHE_RAM_MIB
        cache_ram = [] if unsaid else ["--cache-ram", str(cache_ram_mib)]
        args = [
            str(ensure_llama_server()),
            "-m",
            str(ensure_model(model_size)),
            "--host",
            HOST,
            "--port",
            str(port),
            *cache_ram,
            *extra_args,
        ]
    else:
        args = llama_server_args(
            ensure_llama_server(),
            None if router else ensure_model(model_size),
            host=HOST,
            port=port,
            parallel=server.parallel,
            ctx_size=server.ctx_size,
            cache_ram_mib=cache_ram_mib,
            slot_save_path=slot_save_path,
            extra_args=extra_args,
        )
    upstream = UpstreamServer(processes, name, args, f"http://{HOST}:{port}", slot_save_path)
    upstream.first_model = model_name(0) if router else None
    return upstream


async def arm_front(
    arm: str,
    processes: ProcessSet,
    session: aiohttp.ClientSession,
    name: str,
    upstream: UpstreamServer,
    disk_budget_mib: int,
    disk_blocks: bool,
) -> tuple[str, str | None]:
    """Where an arm's requests go, and the proxy's command: `upstream` itself for the direct
    arm (no command), a `cacheproxy serve` started in front of it for the proxy arm."""
    if arm != "proxy":
        return upstream.url, None
    proxy_name = f"{name}-proxy"
    port = free_port(HOST)
    args = proxy_command(upstream.url, port)
    env = {
        **os.environ,
        # its own state folder, so a run never touches the user's cacheproxy state
        "CACHEPROXY_STATE_DIR": str(processes.workdir / f"{proxy_name}-state"),
        # the disk tier archives where llama-server saves slots
        "CACHEPROXY_DISK__DIRECTORY": str(upstream.slot_save_path),
        "CACHEPROXY_DISK__BUDGET_MIB": str(disk_budget_mib),
        "CACHEPROXY_DISK__BLOCKS": "true" if disk_blocks else "false",
    }
    progress(f"starting {proxy_name}: {shlex.join(args)}")
    processes.start(proxy_name, args, env=env)
    url = f"http://{HOST}:{port}"
    await wait_healthy(session, processes.find(proxy_name), url)
    return url, shlex.join(args)


async def check_server(session: aiohttp.ClientSession, server: UpstreamServer, needed: int) -> None:
    """The model's byte tokens are where we ban them, and a slot holds the longest request."""
    await check_byte_tokens(session, server.url, server.first_model)
    slot_context = await slot_context_of(session, server.url, server.first_model)
    if slot_context < needed:
        raise BenchmarkError(
            f"{server.name} gives each slot {slot_context} tokens of context; the workload's"
            f" longest prompt + output needs {needed}"
        )


# --- one arm --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunContext:
    config: CacheBenchConfig
    processes: ProcessSet
    session: aiohttp.ClientSession


async def run_arm(
    context: RunContext, workload: str, cache_ram_mib: int, arm: str, repetition: int = 0
) -> ArmRun:
    load_average = os.getloadavg()
    name = f"{workload}-cram{cache_ram_mib}-{arm}" + (f"-rep{repetition}" if repetition else "")
    config = context.config
    server_cache_ram = cache_ram_mib
    if arm == "proxy" and config.proxy_server_cache_ram_mib is not None:
        server_cache_ram = config.proxy_server_cache_ram_mib
    server = prepare_upstream(context.processes, f"{name}-llama-server", config, server_cache_ram)
    # What earlier runs wrote is on the disk before this one starts: the kernel throttles a
    # writer while others' dirty pages pass its limit, which would slow only the arms that
    # save (the proxy's), and more the later they run. sync(1) flushes them from a child
    # process, awaited like the servers the benchmark starts: no thread is borrowed for it.
    flush = await asyncio.create_subprocess_exec("sync")
    await flush.wait()
    await server.start(context.session)
    disk: dict[str, float] = {}
    server_figures: dict[str, float] = {}
    try:
        await check_server(context.session, server, config.longest_sequence(workload) + 1)
        base_url, proxy_command = await arm_front(
            arm, context.processes, context.session, name, server,
            config.disk_budget_mib, config.disk_blocks,
        )  # fmt: skip
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
            proxy = context.processes.find(f"{name}-proxy")
            disk["proxy_cpu_s"] = proxy.cpu_s()
            disk["proxy_waiting_s"] = proxy.main_thread_waiting_s()
            disk.update(await disk_held(context.session, base_url, server.slot_save_path))
        if server.first_model is None:  # a router's instances come and go with their counters
            server_figures = await server_counters(context.session, server.url)
        server_figures["cpu_s"] = server.cpu_s
        server_figures["waiting_s"] = server.waiting_s
    finally:
        # This arm's processes stop now: the next arm must not share the CPUs with them. Its
        # archives go too: pages of them not yet written never will be.
        context.processes.stop_named(f"{name}-")
        shutil.rmtree(server.slot_save_path, ignore_errors=True)
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
        server=server_figures,
        repetition=repetition,
        load_average=load_average,
    )


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


async def run_all(context: RunContext) -> list[ArmRun]:
    runs = []
    config = context.config
    plan = itertools.product(
        range(config.repeat), enumerate(config.cache_ram_mib), enumerate(config.workloads)
    )
    for repetition, (ram_index, cache_ram_mib), (workload_index, workload) in plan:
        # Over the cache-ram values and the repetitions, each arm of a workload goes first in
        # turn: a load that comes and goes falls on either arm alike.
        for arm in rotated(config.arms, ram_index + workload_index + repetition):
            run = await run_arm(context, workload, cache_ram_mib, arm, repetition)
            run = dataclasses.replace(run, order=len(runs))
            progress(
                f"{workload} cache-ram {cache_ram_mib} {arm}"
                + (f" (repetition {repetition + 1}/{config.repeat})" if config.repeat > 1 else "")
                + f": {len(run.completions)} requests,"
                f" decoded {run.decoded} = {run.decoded / run.oracle:.2f} x oracle,"
                f" wall {run.wall_s:.1f} s, load {run.load_average[0]:.1f} at its start"
            )
            runs.append(run)
    return runs


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
    models: int = 1,
    models_max: int | None = None,
    server_defaults: bool = False,
    token_scale: float = 1.0,
    disk_blocks: bool = True,
) -> int:
    """The CLI's entry: options in, exit code out (2 for a configuration that cannot run).
    `server_defaults`: every llama-server as `llama-server -m MODEL` starts it (see
    `ServerOptions.defaults`); `token_scale`: W1-W3's token counts times this."""
    try:
        if not token_scale > 0:
            raise ValueError(f"--token-scale must be positive, not {token_scale}")
        config = CacheBenchConfig(
            models_max=models_max,
            workloads=tuple(dict.fromkeys(workloads)),
            cache_ram_mib=tuple(dict.fromkeys(cache_ram_mib)),
            arms=tuple(dict.fromkeys(arms)),
            model_size=size,
            seed=seed,
            proxy_server_cache_ram_mib=proxy_cache_ram_mib,
            disk_budget_mib=disk_budget_mib,
            disk_blocks=disk_blocks,
            server=ServerOptions(
                extra_args=tuple(shlex.split(server_args)), defaults=server_defaults
            ),
            shared_prefix=scaled(SharedPrefixSpec(), token_scale, SHARED_PREFIX_TOKENS),
            multi_turn=scaled(MultiTurnSpec(models=models), token_scale, MULTI_TURN_TOKENS),
        )
    except ValueError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    return run_cache_benchmark(config, json_path)
