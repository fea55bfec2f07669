"""W5, coding agents: tokens decoded and wall time over the Anthropic Messages and the OpenAI
Responses APIs, llama-server alone against cacheproxy in front of it.

More agents than slots, each with its own long system prompt and a history that grows every turn
by the model's answer, a tool call and the tool's output (`agents_trace.py`), driven through the
real `anthropic` and `openai` SDKs (`agents_client.py`). For each API, two arms on the same
seeded trace, each on a fresh llama-server with the same model, slots and context:

- `direct`: llama-server alone with its default RAM prompt cache (`--cache-ram 8192`);
- `proxy`: `cacheproxy serve` with its disk tier in front of a llama-server with `--cache-ram 0`.

Per API and arm: prompt tokens (from the usage each answer carries), tokens decoded (prompt
minus cached), wall time, TTFT; then proxy/direct, against the targets (wall time at most 1.0x,
decoded at most 1.05x). It asserts nothing: it measures.

One pair of 7-second runs moves with the machine: the same request path gave a proxy/direct
wall ratio of 0.943 over Messages and 1.014 over Responses in one run, 1.064 and 0.971 in the
next. With `--rounds N` every API's pair runs N times, the arm going first alternating; the
ratio is then over the sums of each arm's rounds, with each round's beside it.

`cacheproxy bench agents [--agents N] [--turns MIN MAX] [--slots N] [--rounds N] [--json FILE] ...`
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.bench.agents_client import APIS, ApiDriver, TurnResult, driver_for
from cacheproxy.bench.agents_report import render_markdown
from cacheproxy.bench.agents_trace import Agent, AgentSpec, DrawRange, agent_trace, tool_schemas
from cacheproxy.bench.cache_bench import (
    REQUEST_TIMEOUT,
    UpstreamServer,
    arm_front,
    prepare_llama_server,
)
from cacheproxy.bench.cache_client import post_json, slot_context_of
from cacheproxy.bench.cache_config import DEFAULT_SERVER_ARGS, ServerOptions
from cacheproxy.bench.harness import (
    BenchmarkError,
    ProcessSet,
    invoked_command,
    progress,
    rotated,
    run_clients,
    run_with_processes,
)
from cacheproxy.bench.run_counters import disk_held, disk_tier_counters
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model

ARMS = ("direct", "proxy")
# llama-server's own default (common/common.h `cache_ram_mib = 8192`): the direct arm runs as a
# user who starts llama-server without thinking about its cache would.
DEFAULT_DIRECT_CACHE_RAM_MIB = 8192
DEFAULT_SLOTS = 4
DEFAULT_SLOT_CONTEXT = 8192
# The targets for the proxy against llama-server alone.
TARGETS = {"wall_time": 1.0, "tokens_decoded": 1.05}
# Room per turn, in a context check, for what the chat template and tool-call JSON add around
# the trace's text.
TEMPLATE_TOKENS_PER_TURN = 64


@dataclass(frozen=True)
class AgentsBenchConfig:
    spec: AgentSpec = field(default_factory=AgentSpec)
    apis: tuple[str, ...] = APIS
    arms: tuple[str, ...] = ARMS
    model_size: str = "small"
    seed: int = 1
    slots: int = DEFAULT_SLOTS
    slot_context: int = DEFAULT_SLOT_CONTEXT
    server_args: tuple[str, ...] = DEFAULT_SERVER_ARGS
    direct_cache_ram_mib: int = DEFAULT_DIRECT_CACHE_RAM_MIB
    proxy_cache_ram_mib: int = 0  # the proxy arm's server's --cache-ram: off, as tenants need
    disk_budget_mib: int = 1024
    disk_blocks: bool = True  # the proxy's `disk.blocks`: archives cut into blocks
    rounds: int = 1  # each API's arms this many times, the first arm alternating

    def __post_init__(self) -> None:
        unknown = (set(self.apis) - set(APIS)) | (set(self.arms) - set(ARMS))
        if unknown:
            raise ValueError(f"unknown API or arm: {sorted(unknown)}")
        if not (self.apis and self.arms):
            raise ValueError("nothing to run: give at least one API and one arm")
        if self.slots < 1 or self.rounds < 1:
            raise ValueError(
                f"slots and rounds must each be at least 1, not {self.slots} and {self.rounds}"
            )
        if self.spec.agents <= self.slots:
            raise ValueError(
                f"W5 needs more agents than slots: {self.spec.agents} agents, {self.slots} slots"
            )

    @property
    def server(self) -> ServerOptions:
        return ServerOptions(
            parallel=self.slots,
            ctx_size=self.slots * self.slot_context,
            extra_args=self.server_args,
        )

    def server_cache_ram_mib(self, arm: str) -> int:
        return self.direct_cache_ram_mib if arm == "direct" else self.proxy_cache_ram_mib


@dataclass(frozen=True)
class AgentsArmRun:
    api: str
    arm: str
    turns: tuple[TurnResult, ...]
    wall_s: float
    server_cache_ram_mib: int
    llama_server_command: str
    proxy_command: str | None
    disk: dict[str, float] = field(default_factory=dict)
    # CPU seconds over the trace (start-ups left out): llama-server's, and the proxy's
    server_cpu_s: float = 0.0
    proxy_cpu_s: float | None = None
    round: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(turn.prompt_tokens for turn in self.turns)

    @property
    def cached(self) -> int:
        return sum(turn.cached_tokens for turn in self.turns)

    @property
    def decoded(self) -> int:
        return sum(turn.decoded for turn in self.turns)

    @property
    def oracle_estimate(self) -> int:
        """About what an infinite cache would still decode: each agent's first prompt whole
        (no two agents share a system prompt), then per turn what the prompt grew by beyond the
        previous prompt and its answer (at least 1: llama-server always decodes one token).
        From token counts alone, so an estimate: it takes the answer as re-read token for
        token, which a text round trip need not give."""
        by_agent: dict[str, list[TurnResult]] = {}
        for turn in self.turns:
            by_agent.setdefault(turn.agent, []).append(turn)
        total = 0
        for turns in by_agent.values():
            turns.sort(key=lambda turn: turn.turn)
            total += turns[0].prompt_tokens
            for before, after in itertools.pairwise(turns):
                grown = after.prompt_tokens - before.prompt_tokens - before.output_tokens
                total += max(1, grown)
        return total

    def ttft_ms(self, quantile: int) -> float:
        samples = [turn.ttft_s * 1000 for turn in self.turns]
        if len(samples) < 2:
            return samples[0] if samples else float("nan")
        return statistics.quantiles(samples, n=100, method="inclusive")[quantile - 1]


# --- running ----------------------------------------------------------------------------------


async def run_agent(driver: ApiDriver, agent: Agent, results: list[TurnResult]) -> None:
    """One agent: arrives, then takes its turns one after the other, a tool's time between."""
    await asyncio.sleep(agent.arrival_s)
    answers: list[str] = []
    for turn in range(agent.turns):
        result = await driver.turn(agent, turn, answers)
        results.append(result)
        answers.append(result.answer)
        if turn < len(agent.tool_calls):
            await asyncio.sleep(agent.tool_calls[turn].duration_s)


async def run_trace(driver: ApiDriver, trace: Sequence[Agent]) -> list[TurnResult]:
    results: list[TurnResult] = []
    await run_clients({f"W5-{agent.name}": run_agent(driver, agent, results) for agent in trace})
    return results


async def check_context(
    session: aiohttp.ClientSession, server: UpstreamServer, trace: Sequence[Agent], spec: AgentSpec
) -> None:
    """Every agent's last request must fit a slot: its text as the server tokenizes it, the
    tools, and per turn an answer and the template's wrapping."""
    slot_context = await slot_context_of(session, server.url)
    tools = json.dumps(tool_schemas())
    tool_tokens = len(
        (await post_json(session, server.url + "/tokenize", {"content": tools}))["tokens"]
    )
    for agent in trace:
        known = await post_json(session, server.url + "/tokenize", {"content": agent.known_text})
        needed = (
            len(known["tokens"])
            + tool_tokens
            + agent.turns * (spec.answer_tokens + TEMPLATE_TOKENS_PER_TURN)
        )
        if needed > slot_context:
            raise BenchmarkError(
                f"{agent.name}'s last turn needs about {needed} tokens but a slot holds"
                f" {slot_context}: raise --slot-context or shrink the trace"
            )


WARM_UP = "W5-warm-up-"  # the processes of the clients' warm-up (`warm_up_clients`)


@dataclass(frozen=True)
class AgentsRunContext:
    config: AgentsBenchConfig
    processes: ProcessSet
    session: aiohttp.ClientSession
    trace: tuple[Agent, ...]


async def run_arm(
    context: AgentsRunContext, api: str, arm: str, round_index: int = 0
) -> AgentsArmRun:
    config = context.config
    name = f"W5-{api}-{arm}" + (f"-{round_index}" if round_index else "")
    cache_ram_mib = config.server_cache_ram_mib(arm)
    server = prepare_llama_server(
        context.processes, f"{name}-llama-server", config.server, config.model_size, cache_ram_mib
    )
    await server.start(context.session)
    disk: dict[str, float] = {}
    try:
        await check_context(context.session, server, context.trace, config.spec)
        base_url, proxy_command = await arm_front(
            arm, context.processes, context.session, name, server,
            config.disk_budget_mib, config.disk_blocks,
        )  # fmt: skip
        progress(f"{name}: {len(context.trace)} agents over {base_url}")
        proxy = context.processes.find(f"{name}-proxy") if arm == "proxy" else None
        cpu_at_start = (server.cpu_s, proxy.cpu_s() if proxy is not None else 0.0)
        started = time.perf_counter()
        driver = driver_for(api, base_url, config.spec.answer_tokens, started)
        try:
            turns = await run_trace(driver, context.trace)
        finally:
            await driver.close()
        wall_s = time.perf_counter() - started
        server_cpu_s = server.cpu_s - cpu_at_start[0]
        proxy_cpu_s = None if proxy is None else proxy.cpu_s() - cpu_at_start[1]
        if arm == "proxy":
            disk = await disk_tier_counters(context.session, base_url)
            disk.update(await disk_held(context.session, base_url, server.slot_save_path))
    finally:
        # This arm's processes stop now: the next arm must not share the CPUs with them.
        context.processes.stop_named(f"{name}-")
    return AgentsArmRun(
        api=api,
        arm=arm,
        turns=tuple(sorted(turns, key=lambda turn: turn.started_s)),
        wall_s=wall_s,
        server_cache_ram_mib=cache_ram_mib,
        llama_server_command=shlex.join(server.args),
        proxy_command=proxy_command,
        disk=disk,
        server_cpu_s=server_cpu_s,
        proxy_cpu_s=proxy_cpu_s,
        round=round_index,
    )


async def warm_up_clients(context: AgentsRunContext) -> None:
    """Before any arm is timed, the trace's first agent once per API, on a llama-server of its
    own. An SDK works on its first use: the `openai` SDK builds the models of its request and
    of each kind of event as it first meets them, and W5's first `/v1/responses` turn took
    0.8-1.0 s to its first token in whichever arm ran first (0.1 s in the other), which that
    arm's wall time then carried. No arm's server, proxy or counters see these turns."""
    config = context.config
    server = prepare_llama_server(
        context.processes, f"{WARM_UP}llama-server", config.server, config.model_size, 0
    )
    await server.start(context.session)
    try:
        agent = replace(context.trace[0], arrival_s=0.0)
        for api in config.apis:
            driver = driver_for(api, server.url, config.spec.answer_tokens, time.perf_counter())
            turns: list[TurnResult] = []
            try:
                await run_agent(driver, agent, turns)
            finally:
                await driver.close()
            took = ", ".join(f"{turn.ttft_s:.2f}" for turn in turns)
            progress(f"W5 warm-up over /v1/{api}, not timed: first token after {took} s")
    finally:
        context.processes.stop_named(WARM_UP)


async def run_all(context: AgentsRunContext) -> list[AgentsArmRun]:
    await warm_up_clients(context)
    runs = []
    for round_index in range(context.config.rounds):
        for index, api in enumerate(context.config.apis):
            # each arm goes first in turn, from one API to the next and one round to the next
            for arm in rotated(context.config.arms, index + round_index):
                run = await run_arm(context, api, arm, round_index)
                progress(
                    f"W5 round {round_index} {api} {arm}: {len(run.turns)} requests,"
                    f" {run.prompt_tokens} prompt tokens, decoded {run.decoded},"
                    f" wall {run.wall_s:.1f} s"
                )
                runs.append(run)
    return runs


async def benchmark(config: AgentsBenchConfig, processes: ProcessSet) -> list[AgentsArmRun]:
    """Every API and arm asked for, one after the other, on fresh servers."""
    progress("locating llama-server and the model (a build in progress is waited for)")
    ensure_llama_server()
    ensure_model(config.model_size)
    trace = tuple(agent_trace(config.spec, config.seed))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as session:
        return await run_all(AgentsRunContext(config, processes, session, trace))


# --- figures ----------------------------------------------------------------------------------


def turn_as_json(turn: TurnResult) -> dict[str, Any]:
    return {
        "agent": turn.agent,
        "turn": turn.turn,
        "started_ms": turn.started_s * 1000,
        "prompt_tokens": turn.prompt_tokens,
        "cached_tokens": turn.cached_tokens,
        "decoded": turn.decoded,
        "output_tokens": turn.output_tokens,
        "ttft_ms": turn.ttft_s * 1000,
        "total_ms": turn.total_s * 1000,
    }


def run_as_json(run: AgentsArmRun) -> dict[str, Any]:
    return {
        "round": run.round,
        "api": run.api,
        "arm": run.arm,
        "requests": len(run.turns),
        "prompt_tokens": run.prompt_tokens,
        "tokens_cached": run.cached,
        "tokens_decoded": run.decoded,
        "oracle_estimate": run.oracle_estimate,
        "output_tokens": sum(turn.output_tokens for turn in run.turns),
        "wall_s": run.wall_s,
        "server_cpu_s": run.server_cpu_s,
        "proxy_cpu_s": run.proxy_cpu_s,
        "ttft_p50_ms": run.ttft_ms(50),
        "ttft_p99_ms": run.ttft_ms(99),
        "server_cache_ram_mib": run.server_cache_ram_mib,
        "llama_server_command": run.llama_server_command,
        "proxy_command": run.proxy_command,
        "disk_tier": run.disk,
        "requests_detail": [turn_as_json(turn) for turn in run.turns],
    }


def proxy_over_direct(
    runs: Sequence[AgentsArmRun], api: str, round_index: int | None = None
) -> dict[str, float] | None:
    """Proxy / direct over `api`, within one round, or (None) over the sums of every round."""
    chosen = [run for run in runs if run.api == api and round_index in (None, run.round)]
    decoded = {arm: sum(run.decoded for run in chosen if run.arm == arm) for arm in ARMS}
    wall = {arm: sum(run.wall_s for run in chosen if run.arm == arm) for arm in ARMS}
    if not (wall["direct"] and wall["proxy"]):
        return None
    return {
        "tokens_decoded": decoded["proxy"] / decoded["direct"] if decoded["direct"] else math.nan,
        "wall_time": wall["proxy"] / wall["direct"],
    }


def agents_as_json(
    config: AgentsBenchConfig, runs: Sequence[AgentsArmRun], model: str
) -> dict[str, Any]:
    """W5's figures: the JSON `cacheproxy bench agents --json` writes and the report's `agents`."""
    return {
        "model": model,
        "seed": config.seed,
        "spec": asdict(config.spec),
        "apis": list(config.apis),
        "arms": list(config.arms),
        "slots": config.slots,
        "slot_context": config.slot_context,
        "server_args": list(config.server_args),
        "direct_cache_ram_mib": config.direct_cache_ram_mib,
        "proxy_cache_ram_mib": config.proxy_cache_ram_mib,
        "rounds": config.rounds,
        "targets": TARGETS,
        "runs": [run_as_json(run) for run in runs],
        "proxy_over_direct": {api: proxy_over_direct(runs, api) for api in config.apis},
        "proxy_over_direct_by_round": {
            api: [proxy_over_direct(runs, api, index) for index in range(config.rounds)]
            for api in config.apis
        },
    }


# --- the command -------------------------------------------------------------------------------


def run_agents_benchmark(config: AgentsBenchConfig, json_path: str | None = None) -> int:
    """Run every API and arm, print the Markdown report; return an exit code."""
    command = invoked_command()
    load_average = os.getloadavg()  # before our own processes start

    async def body(processes: ProcessSet) -> list[AgentsArmRun]:
        return await benchmark(config, processes)

    code, runs = run_with_processes("cacheproxy-agents-bench-", body)
    if runs is None:
        return code
    figures = agents_as_json(config, runs, ensure_model(config.model_size).name)
    machine = {
        "command": command,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(load_average),
        "platform": platform.platform(),
    }
    print(render_markdown(machine, figures))
    if json_path is not None:
        Path(json_path).write_text(json.dumps({**machine, "agents": figures}, indent=2) + "\n")
        progress(f"figures written to {json_path}")
    return 0


def run_from_options(
    *,
    agents: int,
    turns: Sequence[int],
    slots: int,
    slot_context: int,
    system_words: Sequence[int],
    tool_output_lines: Sequence[int],
    answer_tokens: int,
    apis: Sequence[str],
    arms: Sequence[str],
    size: str,
    seed: int,
    server_args: str,
    json_path: str | None,
    disk_blocks: bool = True,
    rounds: int = 1,
    proxy_cache_ram_mib: int = 0,
) -> int:
    """The CLI's entry: options in, exit code out (2 for a configuration that cannot run)."""
    try:
        spec = AgentSpec(
            agents=agents,
            turns=DrawRange(*turns),
            system_words=DrawRange(*system_words),
            tool_output_lines=DrawRange(*tool_output_lines),
            answer_tokens=answer_tokens,
        )
        config = AgentsBenchConfig(
            spec=spec,
            apis=tuple(dict.fromkeys(apis)),
            arms=tuple(dict.fromkeys(arms)),
            model_size=size,
            seed=seed,
            slots=slots,
            slot_context=slot_context,
            server_args=tuple(shlex.split(server_args)),
            disk_blocks=disk_blocks,
            proxy_cache_ram_mib=proxy_cache_ram_mib,
            rounds=rounds,
        )
    except ValueError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    return run_agents_benchmark(config, json_path)
