"""W2 over two llama-servers and two proxies sharing one database and archive (`[cluster]`).

Two llama-servers (one slot folder for both, `--cache-ram 0`) and two `cacheproxy serve`
processes with the same state folder (registry with the leases, archive index) and the cluster
on. Each proxy holds one upstream. The W2 clients are spread over the proxies: each turn of a
conversation goes to the proxy after the one its previous turn went to, so every other turn
arrives at the proxy that does not serve it and is handed off.

Two arms, each on fresh processes: `steady` (nothing fails) and `kill` (one proxy is killed
with SIGKILL once `kill_after` of the requests are answered). A client whose proxy refuses the
connection sends the request to the other one (a load balancer's retry: the request never
reached a proxy); a request cut by the kill is counted lost and sent again to the survivor, so
the conversation goes on. Per arm: tokens decoded against the oracle, wall time, TTFT; for the
kill, the requests lost (split by whether they were in flight when the proxy died) and the time
until the survivor held the dead proxy's upstream (read from the lease table).

`cacheproxy bench cluster [--arms steady kill] [--kill-after 0.5] [--json FILE]`.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.bench.cache_bench import REQUEST_TIMEOUT, run_conversations
from cacheproxy.bench.cache_client import (
    ArmRun,
    Completion,
    CompletionClient,
    byte_token_ids,
    check_byte_tokens,
)
from cacheproxy.bench.harness import (
    HOST,
    BenchmarkError,
    ProcessSet,
    invoked_command,
    progress,
    run_with_processes,
    table_row,
    wait_healthy,
)
from cacheproxy.bench.workloads import MultiTurnSpec, Request, multi_turn_workload
from cacheproxy.cluster.leases import LeaseStore
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model
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

    @property
    def requests(self) -> int:
        spec = self.multi_turn
        return spec.tenants * spec.users_per_tenant * spec.turns


@dataclass
class KillFigures:
    lost_in_flight: int = 0  # cut by the kill (sent before it)
    lost_after: int = 0  # failed although sent after the kill: must be none
    refused: int = 0  # connections the dead proxy refused, sent to the other at once
    takeover_s: float | None = None  # kill -> the survivor holds the dead one's upstream
    killed_at_request: int = 0


@dataclass
class ClusterRun:
    arm: str
    run: ArmRun
    kill: KillFigures | None
    leases_at_start: dict[str, str]


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

    async def complete(self, request: Request) -> Completion:
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
        clients = [
            CompletionClient(session, f"{arm}-{index}", url, byte_token_ids(), completions, issued)
            for index, url in enumerate(proxies)
        ]
        figures = KillFigures()
        spread = SpreadClient(clients, figures)
        workload = multi_turn_workload(config.multi_turn, config.seed)

        async def kill_one() -> None:
            threshold = int(config.requests * config.kill_after)
            for _ in itertools.count():  # the clients append answers: a look every 50 ms
                if len(completions) >= threshold:
                    break
                await asyncio.sleep(0.05)
            victim = processes.find(f"{arm}-proxy-1")
            taken = [up for up, holder in holders.items() if holder == proxies[1]]
            figures.killed_at_request = len(completions)
            os.kill(victim.process.pid, signal.SIGKILL)
            spread.killed_at = killed_at = time.monotonic()
            progress(f"{arm}: proxy {proxies[1]} killed after {len(completions)} answers")
            while True:
                now_held = await lease_holders(leases)
                if all(now_held.get(up) == proxies[0] for up in taken):
                    figures.takeover_s = time.monotonic() - killed_at
                    progress(f"{arm}: {taken} taken over after {figures.takeover_s:.2f} s")
                    return
                await asyncio.sleep(0.05)

        started = time.perf_counter()
        killer = asyncio.create_task(kill_one(), name="kill-one-proxy") if arm == "kill" else None
        try:
            # the spread client answers `complete` as one proxy's client does
            await run_conversations(spread, workload, config.in_flight, _no_restart)  # type: ignore[arg-type]
            if killer is not None:
                await asyncio.wait_for(killer, timeout=config.lease_ttl_s * 4)
        finally:
            if killer is not None:
                killer.cancel()
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
        return ClusterRun(arm, run, figures if arm == "kill" else None, holders)
    finally:
        await leases.aclose()


async def _no_restart() -> None:
    raise BenchmarkError("W2 has no restart")


async def benchmark(config: ClusterBenchConfig, processes: ProcessSet) -> list[ClusterRun]:
    ensure_llama_server()
    ensure_model(config.model_size)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as session:
        return [await run_arm(config, processes, session, arm) for arm in config.arms]


def render(runs: list[ClusterRun], command: str) -> str:
    lines = [
        f"`{command}` (load average before: {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)",
        "",
        table_row(
            ["arm", "answered", "decoded", "oracle", "decoded/oracle", "wall s", "TTFT p50 ms"]
        ),
        table_row(["---"] * 7),
    ]
    for item in runs:
        run = item.run
        lines.append(
            table_row(
                [
                    item.arm,
                    str(len(run.completions)),
                    str(run.decoded),
                    str(run.oracle),
                    f"{run.decoded / run.oracle:.3f}",
                    f"{run.wall_s:.1f}",
                    f"{run.ttft_ms(50):.0f}",
                ]
            )
        )
    for item in runs:
        if item.kill is not None:
            kill = item.kill
            lines += [
                "",
                f"kill: proxy killed after {kill.killed_at_request} answers; requests lost in"
                f" flight {kill.lost_in_flight}, lost after the kill {kill.lost_after},"
                f" refused connections sent to the survivor {kill.refused}; upstream taken over"
                f" after {kill.takeover_s:.2f} s"
                if kill.takeover_s is not None
                else "kill: no takeover seen",
            ]
    return "\n".join(lines)


def as_json(runs: list[ClusterRun], command: str) -> dict[str, Any]:
    return {
        "command": command,
        "arms": [
            {
                "arm": item.arm,
                "answered": len(item.run.completions),
                "decoded": item.run.decoded,
                "oracle": item.run.oracle,
                "decoded_over_oracle": item.run.decoded / item.run.oracle,
                "wall_s": item.run.wall_s,
                "ttft_p50_ms": item.run.ttft_ms(50),
                "leases_at_start": item.leases_at_start,
                "kill": None if item.kill is None else vars(item.kill),
            }
            for item in runs
        ],
    }


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
