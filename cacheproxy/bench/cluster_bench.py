"""W2 over two llama-servers and two proxies sharing one database and archive (`[cluster]`).

Two llama-servers (one slot folder for both, `--cache-ram 0`) and two `cacheproxy serve`
processes with the same state folder (registry with the leases, archive index) and the cluster
on. Each proxy holds one upstream. The W2 clients are spread over the proxies: each turn of a
conversation goes to the proxy after the one its previous turn went to, so every other turn
arrives at the proxy that does not serve it and is handed off.

Two arms, each on fresh processes: `steady` (nothing fails) and `kill` (one proxy is killed
with SIGKILL once `kill_after` of the requests are answered, or, with `kill_at_turn`, once every
conversation has had that many turns, the next turns waiting for the survivor to hold the dead
proxy's upstream). A client whose proxy refuses the connection sends the request to the other
one (a load balancer's retry: the request never reached a proxy); a request cut by the kill is
counted lost and sent again to the survivor, so the conversation goes on. Per arm: tokens
decoded against the oracle, wall time, TTFT; for the kill, the requests lost (split by whether
they were in flight when the proxy died), the time until the survivor held the dead proxy's
upstream (read from the lease table), and the requests sent after the kill and after the
takeover against their part of the oracle (cluster_report.py). `tenants_exist`: the workload's
tenants are registered, each with its key, so the proxies keep them apart.

`cacheproxy bench cluster [--arms steady kill] [--kill-after 0.5 | --kill-at-turn N] [--json F]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from cacheproxy.bench.cache_bench import REQUEST_TIMEOUT, run_conversations
from cacheproxy.bench.cache_client import (
    ArmRun,
    Completion,
    CompletionClient,
    byte_token_ids,
    check_byte_tokens,
)
from cacheproxy.bench.cluster_report import ClusterRun, KillFigures, as_json, render
from cacheproxy.bench.harness import (
    HOST,
    BenchmarkError,
    ProcessSet,
    invoked_command,
    progress,
    run_with_processes,
    wait_healthy,
)
from cacheproxy.bench.workloads import (
    MultiTurnSpec,
    Request,
    multi_turn_workload,
    tenant_label,
)
from cacheproxy.cluster.leases import LeaseStore
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.upstreams.managed import free_port, llama_server_args

ARMS = ("steady", "kill")
LLAMA_SERVER_PORT = 8081  # each host has its own network: the same port on both
SPREAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ClusterBenchConfig:
    arms: tuple[str, ...] = ARMS
    model_size: str = "small"
    seed: int = 1
    in_flight: int = 4
    parallel: int = 4
    ctx_size: int = 4 * 4096
    lease_ttl_s: float = 6.0
    renew_interval_s: float = 2.0
    kill_after: float = 0.5  # the share of the requests answered before the kill
    # kill between turns instead: once every conversation has had this many, the next turns
    # waiting for the takeover (None: `kill_after`, mid-run)
    kill_at_turn: int | None = None
    wait_for_takeover: bool = True  # at `kill_at_turn`: the next turns wait for the takeover
    tenants_exist: bool = False  # register the workload's tenants (else: one open user)
    # the llama-servers on two "hosts" of the test bed (network namespaces, the archive on
    # GlusterFS mounted by each; needs root), else both on 127.0.0.1 with one local folder
    hosts: bool = False
    multi_turn: MultiTurnSpec = field(default_factory=MultiTurnSpec)

    def __post_init__(self) -> None:
        unknown = set(self.arms) - set(ARMS)
        if unknown or not self.arms:
            raise ValueError(f"arms must be among {ARMS}, not {sorted(unknown) or 'none'}")
        if not 0 < self.kill_after < 1:
            raise ValueError("kill_after is a share of the requests, between 0 and 1")
        needed = self.multi_turn.longest_sequence + 1
        if needed > self.ctx_size // self.parallel:
            raise ValueError(f"a slot needs {needed} tokens of context: raise ctx_size")
        if self.kill_at_turn is not None and not 0 < self.kill_at_turn < self.multi_turn.turns:
            raise ValueError(f"kill_at_turn must be between 1 and {self.multi_turn.turns - 1}")

    @property
    def requests(self) -> int:
        spec = self.multi_turn
        return spec.tenants * spec.users_per_tenant * spec.turns


class SpreadClient:
    """W2's client over several proxies: turn t of a conversation goes to proxy (c + t) mod n.
    A refused connection goes to the next proxy; a request cut mid-way is counted lost and sent
    again to the next one that answers."""

    def __init__(self, clients: list[CompletionClient], figures: KillFigures) -> None:
        self.clients = clients
        self.figures = figures
        self.turns: Counter[str] = Counter()
        self.dead: set[int] = set()
        self.killed_at: float | None = None
        self.taken_at: float | None = None  # when the survivor held the dead one's upstream

    async def complete(self, request: Request) -> Completion:
        first_sent_at = time.monotonic()
        completion = await self._complete(request)
        if self.killed_at is not None and first_sent_at >= self.killed_at:
            self.figures.after_kill.add(completion.issue_index)
        if self.taken_at is not None and first_sent_at >= self.taken_at:
            self.figures.after_takeover.add(completion.issue_index)
        return completion

    async def _complete(self, request: Request) -> Completion:
        turn = self.turns[request.conversation]
        self.turns[request.conversation] += 1
        start = zlib.crc32(request.conversation.encode()) + turn
        # around the proxies up to three times: a request cut on the survivor (handed off to
        # the proxy that died) is sent again there once the dead one refuses
        order = [(start + step) % len(self.clients) for step in range(3 * len(self.clients))]
        last_error: BenchmarkError | None = None
        for index in order:
            if index in self.dead:
                continue
            sent_at = time.monotonic()
            try:
                return await self.clients[index].complete(request)
            except BenchmarkError as exc:
                last_error = exc
                if isinstance(exc.__cause__, aiohttp.ClientConnectorError):
                    self.dead.add(index)
                    self.figures.refused += 1
                    continue
                if self.killed_at is None:
                    raise
                if sent_at < self.killed_at:
                    self.figures.lost_in_flight += 1
                else:
                    self.figures.lost_after += 1
                progress(f"lost: {exc}")
        raise last_error or BenchmarkError("no proxy left to send to")


def register_tenants(state: Path, spec: MultiTurnSpec) -> dict[str, str]:
    """The workload's tenants in the registry the proxies will share: tenant label -> key."""
    with TenantRegistry(state / "cacheproxy.db") as registry:
        return {
            tenant_label(index): registry.create(tenant_label(index))[1]
            for index in range(spec.tenants)
        }


async def lease_holders(leases: LeaseStore) -> dict[str, str]:
    """upstream -> holder's address, of the leases alive now."""
    rows = await leases.aread_leases()
    now = time.time()
    return {lease.upstream: lease.holder_address for lease in rows if lease.live(now)}


async def wait_spread(leases: LeaseStore, proxies: list[str], upstreams: int) -> dict[str, str]:
    deadline = time.monotonic() + SPREAD_TIMEOUT_S
    while time.monotonic() < deadline:
        holders = await lease_holders(leases)
        if len(holders) == upstreams and set(holders.values()) == set(proxies):
            return holders
        await asyncio.sleep(0.2)
    raise BenchmarkError(f"the leases never spread over the proxies: {holders}")


async def run_arm(
    config: ClusterBenchConfig, processes: ProcessSet, session: aiohttp.ClientSession, arm: str
) -> ClusterRun:
    state = processes.workdir / f"{arm}-state"
    with contextlib.ExitStack() as stack:
        places = stack.enter_context(upstream_places(config, processes.workdir / arm))
        try:
            return await _run_arm_on(config, processes, session, arm, state, places)
        finally:
            # before the test bed goes: nothing may hold its mounts
            processes.stop_named(f"{arm}-")


@dataclass(frozen=True)
class UpstreamPlace:
    """Where one llama-server runs: its address, how its command is run, its save folder."""

    host: str
    wrap: tuple[str, ...]  # a command prefix (nsenter into a host's network), or none
    slot_save_path: Path


@dataclass(frozen=True)
class Places:
    upstreams: tuple[UpstreamPlace, UpstreamPlace]
    proxy_archive: Path  # the archive folder as the proxies see it


@contextlib.contextmanager
def upstream_places(config: ClusterBenchConfig, workdir: Path) -> Iterator[Places]:
    if not config.hosts:
        slots = workdir / "slots"
        slots.mkdir(parents=True)
        place = UpstreamPlace(HOST, (), slots)
        yield Places((place, place), slots)
        return
    from cacheproxy.provision import hosts  # root, namespaces, GlusterFS: only when asked

    pid = os.getpid()
    testbed = hosts.plan(workdir / "hosts", 2, tag=f"cb{pid % 100000}", subnet=120 + pid % 100)
    progress(f"hosts test bed: {[host.address for host in testbed.hosts]}, GlusterFS archive")
    with hosts.running(testbed):
        first, second = (
            UpstreamPlace(host.address, tuple(host.command([])), host.archive)
            for host in testbed.hosts
        )
        yield Places((first, second), testbed.proxy_archive)


async def _run_arm_on(
    config: ClusterBenchConfig,
    processes: ProcessSet,
    session: aiohttp.ClientSession,
    arm: str,
    state: Path,
    places: Places,
) -> ClusterRun:
    servers: list[str] = []
    server_args: list[str] = []
    save_paths: dict[str, str] = {}
    for index, place in enumerate(places.upstreams):
        port = free_port(HOST) if not place.wrap else LLAMA_SERVER_PORT
        args = llama_server_args(
            ensure_llama_server(),
            ensure_model(config.model_size),
            host=place.host,
            port=port,
            parallel=config.parallel,
            ctx_size=config.ctx_size,
            cache_ram_mib=0,
            slot_save_path=place.slot_save_path,
            extra_args=("--threads", "1"),
        )
        name = f"{arm}-llama-server-{index}"
        processes.start(name, [*place.wrap, *args])
        servers.append(f"http://{place.host}:{port}")
        save_paths[servers[-1]] = str(place.slot_save_path)
        server_args = args
        await wait_healthy(session, processes.find(name), servers[-1])
    await check_byte_tokens(session, servers[0])
    keys = register_tenants(state, config.multi_turn) if config.tenants_exist else {}
    proxies: list[str] = []
    proxy_args: list[str] = []
    env = {
        **os.environ,
        "CACHEPROXY_STATE_DIR": str(state),
        "CACHEPROXY_DISK__DIRECTORY": str(places.proxy_archive),
        "CACHEPROXY_DISK__UPSTREAM_SAVE_PATHS": json.dumps(save_paths),
        "CACHEPROXY_CLUSTER__ENABLED": "true",
        "CACHEPROXY_CLUSTER__LEASE_TTL_S": str(config.lease_ttl_s),
        "CACHEPROXY_CLUSTER__RENEW_INTERVAL_S": str(config.renew_interval_s),
    }
    for index in range(2):
        port = free_port(HOST)
        proxy_args = [sys.executable, "-m", "cacheproxy", "serve", "--port", str(port)]
        proxy_args += [flag for url in servers for flag in ("--upstream", url)]
        proxy_args += ["--log-level", "info"]
        name = f"{arm}-proxy-{index}"
        processes.start(name, proxy_args, env=env)
        proxies.append(f"http://{HOST}:{port}")
        await wait_healthy(session, processes.find(name), proxies[-1])
    # the proxies created the database: opened only now, so its mode is theirs
    leases = await LeaseStore.aopen(state / "cacheproxy.db")
    try:
        holders = await wait_spread(leases, proxies, len(servers))
        progress(f"{arm}: leases {holders}")
        # every proxy's next round reads the spread: until then they may differ on owners
        await asyncio.sleep(2 * config.renew_interval_s)

        issued = itertools.count()
        completions: list[Completion] = []
        spread = SpreadClient(
            [
                CompletionClient(
                    session, f"{arm}-{index}", url, byte_token_ids(), completions, issued, keys
                )
                for index, url in enumerate(proxies)
            ],
            KillFigures(),
        )
        killing = Killing(config, processes, arm, leases, holders, proxies, spread, completions)
        started = time.perf_counter()
        await killing.run(config.multi_turn)
        wall_s = time.perf_counter() - started
        run = ArmRun(
            workload="W2",
            cache_ram_mib=0,
            arm=arm,
            completions=tuple(completions),
            wall_s=wall_s,
            restarts=0,
            llama_server_command=" ".join(server_args),
            proxy_command=" ".join(proxy_args),
            server_cache_ram_mib=0,
        )
        return ClusterRun(arm, run, spread.figures if arm == "kill" else None, holders)
    finally:
        await leases.aclose()


@dataclass
class Killing:
    """An arm's run of the workload and, in the kill arm, the kill of the second proxy: once
    `kill_after` of the requests are answered (while others run), or at the turn barrier
    `kill_at_turn`, where the next turns wait for the takeover."""

    config: ClusterBenchConfig
    processes: ProcessSet
    arm: str
    leases: LeaseStore
    holders: dict[str, str]
    proxies: list[str]
    spread: SpreadClient
    completions: list[Completion]

    watch: asyncio.Task[None] | None = None  # until the survivor holds what the dead one did

    async def run(self, spec: MultiTurnSpec) -> None:
        config = self.config
        at_turn = config.kill_at_turn if self.arm == "kill" else None
        workload = multi_turn_workload(replace(spec, restart_after_turn=at_turn), config.seed)
        mid_run = self.arm == "kill" and at_turn is None
        killer = (
            asyncio.create_task(self._kill_mid_run(), name="kill-one-proxy") if mid_run else None
        )
        try:
            # the spread client answers `complete` as one proxy's client does
            await run_conversations(
                self.spread,  # type: ignore[arg-type]
                workload,
                config.in_flight,
                self._kill_at_barrier,
            )
            if killer is not None:
                await asyncio.wait_for(killer, timeout=config.lease_ttl_s * 4)
            if self.watch is not None:
                await asyncio.wait_for(self.watch, timeout=config.lease_ttl_s * 4)
        finally:
            for task in (killer, self.watch):
                if task is not None:
                    task.cancel()

    async def _kill_mid_run(self) -> None:
        threshold = int(self.config.requests * self.config.kill_after)
        for _ in itertools.count():  # the clients append answers: a look every 50 ms
            if len(self.completions) >= threshold:
                break
            await asyncio.sleep(0.05)
        self._kill()

    async def _kill_at_barrier(self) -> None:
        """Between turns: the kill, then (`wait_for_takeover`) the takeover before the next."""
        self._kill()
        if self.config.wait_for_takeover and self.watch is not None:
            await self.watch

    def _kill(self) -> None:
        """SIGKILL the second proxy, and watch the lease table for the takeover."""
        spread = self.spread
        victim = self.processes.find(f"{self.arm}-proxy-1")
        spread.figures.killed_at_request = len(self.completions)
        os.kill(victim.process.pid, signal.SIGKILL)
        spread.killed_at = time.monotonic()
        progress(
            f"{self.arm}: proxy {self.proxies[1]} killed after {len(self.completions)} answers"
        )
        self.watch = asyncio.create_task(self._taken_over(), name="watch-takeover")

    async def _taken_over(self) -> None:
        spread = self.spread
        taken = [up for up, holder in self.holders.items() if holder == self.proxies[1]]
        while True:
            now_held = await lease_holders(self.leases)
            if all(now_held.get(up) == self.proxies[0] for up in taken):
                spread.taken_at = time.monotonic()
                takeover_s = spread.taken_at - (spread.killed_at or spread.taken_at)
                spread.figures.takeover_s = takeover_s
                progress(f"{self.arm}: {taken} taken over after {takeover_s:.2f} s")
                return
            await asyncio.sleep(0.05)


async def benchmark(config: ClusterBenchConfig, processes: ProcessSet) -> list[ClusterRun]:
    ensure_llama_server()
    ensure_model(config.model_size)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as session:
        return [await run_arm(config, processes, session, arm) for arm in config.arms]


def run_cluster_benchmark(config: ClusterBenchConfig, json_path: str | None = None) -> int:
    command = invoked_command()
    code, runs = run_with_processes(
        "cacheproxy-cluster-bench-", lambda processes: benchmark(config, processes)
    )
    if runs is None:
        return code
    print(render(runs, command))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(as_json(runs, command), indent=2) + "\n")
    return 0
