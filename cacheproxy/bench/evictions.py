"""What an eviction costs the request that causes it, with and without archiving ahead.

Two measurements, each in two arms, `ahead off` (`disk.ahead_mib_s = 0`: the evicting request
waits while the victim slot is saved) and `ahead on` (idle slots saved in the background):

- W2 evictions: multi-turn conversations, more users than slots, round-robin with a think time
  between requests, through the proxy (a separate process) in front of a fresh llama-server
  (`--cache-ram 0`). A request is *evicting* when the proxy's `cacheproxy_evictions_total`
  moved while it ran (requests run one at a time, so the attribution is exact). The report gives
  the time to first token of evicting requests, p50 and p99, and how their victims were covered.
- The size channel: tenant B fills the only slot with a large or a small conversation (drawn
  at random per trial); after a pause, tenant A sends its own prompt, which evicts B's. A
  two-sample Kolmogorov-Smirnov test on A's time to first token tells whether A can time the
  size of B's slot: with the save on A's path it can; archived ahead, it should not (p > 0.01).

`cacheproxy bench evictions [--size kv-heavy] [--trials 30] [--json FILE]`
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson

from cacheproxy.bench.harness import (
    HOST,
    BenchmarkError,
    ProcessSet,
    fail_on_bad_status,
    invoked_command,
    progress,
    proxy_command,
    run_with_processes,
    wait_healthy,
)
from cacheproxy.bench.isolation import SIGNIFICANCE, ks_two_sample
from cacheproxy.bench.workloads import MultiTurnSpec, multi_turn_workload
from cacheproxy.disk.slot_file import SlotFileError, read_slot_file
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model, server_args
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.upstreams.managed import free_port, llama_server_args

ARMS = {"ahead off": 0.0, "ahead on": 1024.0}  # disk.ahead_mib_s
EVICTIONS = re.compile(rb'^cacheproxy_evictions_total\{archive="(\w+)"\} (\S+)$', re.M)
RATES = re.compile(
    rb"^cacheproxy_(disk_save_mib_per_second|disk_restore_mib_per_second|"
    rb"prefill_tokens_per_second)\{[^}]*\} (\S+)$",
    re.M,
)


@dataclass(frozen=True)
class EvictionBenchConfig:
    size: str = "kv-heavy"
    slots: int = 2
    users: int = 4
    turns: int = 4
    history_tokens: int = 384
    question_tokens: int = 32
    n_predict: int = 4
    think_s: float = 1.0
    trials: int = 30  # size channel, per condition and arm
    large_tokens: int = 1024
    small_tokens: int = 320
    pause_s: float = 2.0  # between B's answer and A's request
    seed: int = 1
    w2: bool = True  # run the W2 measurement (the size channel runs when trials > 0)


@dataclass
class EvictionArmFigures:
    arm: str
    evicting_ttft_ms: list[float] = field(default_factory=list)
    other_ttft_ms: list[float] = field(default_factory=list)
    victims: dict[str, int] = field(default_factory=dict)  # covered / saved / dropped
    size_ttft_ms: dict[str, list[float]] = field(default_factory=dict)  # large / small
    rates: dict[str, float] = field(default_factory=dict)  # the proxy's measured rates
    kv_bytes_per_token: float = 0.0  # from the slot files llama-server wrote


class Proxy:
    """One arm's llama-server and proxy, and a client for them."""

    def __init__(self, session: aiohttp.ClientSession, url: str, keys: dict[str, str]) -> None:
        self.session = session
        self.url = url
        self.keys = keys

    def headers(self, tenant: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if tenant is not None:
            headers["Authorization"] = f"Bearer {self.keys[tenant]}"
        return headers

    async def metrics(self) -> bytes:
        headers = self.headers("admin" if "admin" in self.keys else None)
        async with self.session.get(self.url + "/metrics", headers=headers) as response:
            await fail_on_bad_status(response)
            return await response.read()

    async def evictions(self) -> dict[str, float]:
        text = await self.metrics()
        return {kind.decode(): float(value) for kind, value in EVICTIONS.findall(text)}

    async def rates(self) -> dict[str, float]:
        text = await self.metrics()
        return {name.decode(): float(value) for name, value in RATES.findall(text)}

    async def first_token_ms(
        self, prompt: list[int], n_predict: int, tenant: str | None = None
    ) -> tuple[float, list[int]]:
        body = {"prompt": prompt, "n_predict": n_predict, "stream": True, "temperature": 0}
        body["return_tokens"] = True
        started = time.perf_counter()
        first, tokens = None, []
        async with self.session.post(
            self.url + "/completion", data=orjson.dumps(body), headers=self.headers(tenant)
        ) as response:
            await fail_on_bad_status(response)
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if first is None:
                    first = time.perf_counter()
                tokens += orjson.loads(line[6:]).get("tokens") or []
        if first is None:
            raise BenchmarkError("a stream ended without any event")
        return (first - started) * 1000, tokens


async def start_arm(
    session: aiohttp.ClientSession,
    processes: ProcessSet,
    config: EvictionBenchConfig,
    name: str,
    ahead_mib_s: float,
    slots: int,
    tenants: bool,
) -> Proxy:
    """A fresh llama-server and proxy named `name`-..., healthy; a client for the proxy."""
    workdir = processes.workdir / name
    (workdir / "slots").mkdir(parents=True)
    port = free_port(HOST)
    longest = config.history_tokens + config.turns * (config.question_tokens + config.n_predict)
    n_ctx = max(longest, config.large_tokens + config.question_tokens + 64) + 64
    args = llama_server_args(
        ensure_llama_server(),
        ensure_model(config.size),
        host=HOST,
        port=port,
        parallel=slots,
        ctx_size=n_ctx * slots,
        cache_ram_mib=0,
        slot_save_path=workdir / "slots",
        extra_args=server_args(config.size),
    )
    processes.start(f"{name}-llama-server", args)
    env = {
        **os.environ,
        "CACHEPROXY_STATE_DIR": str(workdir / "state"),
        "CACHEPROXY_DISK__DIRECTORY": str(workdir / "slots"),
        "CACHEPROXY_DISK__BUDGET_MIB": "65536",
        "CACHEPROXY_DISK__MIN_FREE_MIB": "0",
        "CACHEPROXY_DISK__AHEAD_MIB_S": str(ahead_mib_s),
        "CACHEPROXY_DISK__AHEAD_IDLE_S": "0.2",
        "CACHEPROXY_DISK__AHEAD_INTERVAL_S": "0.05",
    }
    keys: dict[str, str] = {}
    if tenants:
        database = workdir / "tenants.db"
        with TenantRegistry(database) as registry:
            keys = {name: registry.create(name)[1] for name in ("a", "b")}
        keys["admin"] = "bench-admin-key-" + os.urandom(8).hex()
        env["CACHEPROXY_TENANTS__DATABASE"] = str(database)
        env["CACHEPROXY_TENANTS__ADMIN_API_KEY"] = keys["admin"]
    proxy_port = free_port(HOST)
    upstream, proxy_url = f"http://{HOST}:{port}", f"http://{HOST}:{proxy_port}"
    processes.start(f"{name}-proxy", proxy_command(upstream, proxy_port), env=env)
    await wait_healthy(session, processes.find(f"{name}-llama-server"), upstream)
    await wait_healthy(session, processes.find(f"{name}-proxy"), proxy_url)
    return Proxy(session, proxy_url, keys)


async def w2_evictions(
    session: aiohttp.ClientSession,
    processes: ProcessSet,
    config: EvictionBenchConfig,
    arm: str,
    figures: EvictionArmFigures,
) -> None:
    name = f"w2-{arm.replace(' ', '-')}"
    proxy = await start_arm(session, processes, config, name, ARMS[arm], config.slots, False)
    spec = MultiTurnSpec(
        tenants=1,
        users_per_tenant=config.users,
        turns=config.turns,
        tenant_prefix_tokens=0,
        history_tokens=config.history_tokens,
        question_tokens=config.question_tokens,
        n_predict=config.n_predict,
    )
    workload = multi_turn_workload(spec, config.seed)
    answers: dict[str, list[list[int]]] = {c.user: [] for c in workload.conversations}
    for turn in range(workload.turns):
        for conversation in workload.conversations:
            prompt = list(conversation.prompt(turn, answers[conversation.user]))
            before = await proxy.evictions()
            ttft, tokens = await proxy.first_token_ms(prompt, config.n_predict)
            after = await proxy.evictions()
            answers[conversation.user].append(tokens)
            moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            if sum(moved.values()) > 0:
                figures.evicting_ttft_ms.append(ttft)
                for kind, count in moved.items():
                    figures.victims[kind] = figures.victims.get(kind, 0) + int(count)
            else:
                figures.other_ttft_ms.append(ttft)
            await asyncio.sleep(config.think_s)
        progress(f"{arm}: W2 turn {turn + 1}/{workload.turns}")
    figures.rates = await proxy.rates()
    figures.kv_bytes_per_token = kv_bytes_per_token(processes.workdir / name / "slots")
    processes.stop_named(name)


async def size_channel(
    session: aiohttp.ClientSession,
    processes: ProcessSet,
    config: EvictionBenchConfig,
    arm: str,
    figures: EvictionArmFigures,
) -> None:
    name = f"size-{arm.replace(' ', '-')}"
    proxy = await start_arm(session, processes, config, name, ARMS[arm], 1, True)
    rng = random.Random(config.seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(300, 31000) for _ in range(count)]

    conditions = ["large", "small"] * config.trials
    rng.shuffle(conditions)
    figures.size_ttft_ms = {"large": [], "small": []}
    for _ in range(2):  # warm-up, not counted
        await proxy.first_token_ms(tokens(config.small_tokens), 2, "b")
        await proxy.first_token_ms(tokens(config.question_tokens), 2, "a")
    for done, condition in enumerate(conditions, 1):
        size = config.large_tokens if condition == "large" else config.small_tokens
        await proxy.first_token_ms(tokens(size), 2, "b")
        await asyncio.sleep(config.pause_s)
        ttft, _ = await proxy.first_token_ms(tokens(config.question_tokens), 2, "a")
        figures.size_ttft_ms[condition].append(ttft)
        if done % 10 == 0:
            progress(f"{arm}: size channel {done}/{len(conditions)}")
    processes.stop_named(name)


def kv_bytes_per_token(folder: Path) -> float:
    """Bytes per token of the slot files in `folder`: file size over the tokens it holds."""
    sizes = tokens = 0
    for path in folder.glob("a_*.slot"):
        with contextlib.suppress(SlotFileError, OSError):
            header = read_slot_file(path)
            sizes, tokens = sizes + header.file_size, tokens + len(header.tokens)
    return sizes / tokens if tokens else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def render(figures: list[EvictionArmFigures], config: EvictionBenchConfig, command: str) -> str:
    lines = [
        "# What an eviction costs the evicting request",
        "",
        f"- command: `{command}`",
        f"- model: {config.size}; W2: {config.users} users on {config.slots} slots,"
        f" {config.turns} turns, history {config.history_tokens}, question"
        f" {config.question_tokens}, think {config.think_s} s; --cache-ram 0",
        "",
        "| arm | evicting requests | TTFT p50 ms | TTFT p99 ms | victims covered / saved /"
        " dropped | other requests p50 ms |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for arm in figures:
        victims = " / ".join(str(arm.victims.get(k, 0)) for k in ("covered", "saved", "dropped"))
        lines.append(
            f"| {arm.arm} | {len(arm.evicting_ttft_ms)} |"
            f" {percentile(arm.evicting_ttft_ms, 0.5):.0f} |"
            f" {percentile(arm.evicting_ttft_ms, 0.99):.0f} | {victims} |"
            f" {percentile(arm.other_ttft_ms, 0.5):.0f} |"
        )
    lines += [
        "",
        "Measured by the proxy during W2 (moving averages) and from llama-server's files:",
        "",
    ]
    for arm in figures:
        rates = ", ".join(f"{name} {value:.0f}" for name, value in sorted(arm.rates.items()))
        lines.append(f"- {arm.arm}: {rates}; KV {arm.kv_bytes_per_token / 1024:.1f} KiB/token")
    lines += [
        "",
        f"Size channel: tenant A's TTFT when its request evicts tenant B's {config.large_tokens}-"
        f" or {config.small_tokens}-token slot ({config.trials} trials each, pause"
        f" {config.pause_s} s):",
        "",
        "| arm | large p50 ms | small p50 ms | KS D | p | verdict |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for arm in figures:
        large, small = arm.size_ttft_ms.get("large", []), arm.size_ttft_ms.get("small", [])
        if not large or not small:
            continue
        distance, p = ks_two_sample(large, small)
        verdict = "cannot be told apart" if p > SIGNIFICANCE else "told apart"
        lines.append(
            f"| {arm.arm} | {statistics.median(large):.0f} | {statistics.median(small):.0f} |"
            f" {distance:.3f} | {p:.3g} | {verdict} |"
        )
    return "\n".join(lines)


async def run_all(processes: ProcessSet, config: EvictionBenchConfig) -> list[EvictionArmFigures]:
    results = []
    async with aiohttp.ClientSession() as session:
        for arm in ARMS:
            figures = EvictionArmFigures(arm)
            if config.w2:
                await w2_evictions(session, processes, config, arm, figures)
            if config.trials:
                await size_channel(session, processes, config, arm, figures)
            results.append(figures)
    return results


def run_eviction_bench(config: EvictionBenchConfig, json_path: Path | None = None) -> int:
    command = invoked_command()
    code, results = run_with_processes(
        "cacheproxy-evictions-", lambda processes: run_all(processes, config)
    )
    if results is None:
        return code
    print(render(results, config, command))
    if json_path is not None:
        json_path.write_text(
            json.dumps({"config": asdict(config), "arms": [asdict(r) for r in results]}, indent=1)
        )
    return 0
