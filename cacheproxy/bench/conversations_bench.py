"""Real multi-turn conversations: prompt tokens decoded and wall time over `/v1/chat/completions`,
llama-server alone against cacheproxy in front of it.

The trace (`conversations_trace.py`) replays recorded conversations of the `chatterbot-corpus`
package, many more of them than slots, behind one shared system prompt; `--clients` requests in
flight take the conversations' turns round-robin, a conversation's next turn going to the end of
the line once its previous one is answered, so each comes back after the others have passed
through the slots. Every request carries the recorded answers as history, so both arms send the
same prompts. The arms, each on a fresh llama-server with the same model, slots and context, as
`cacheproxy bench agents` sets them up:

- `direct`: llama-server alone with its default RAM prompt cache (`--cache-ram 8192`);
- `proxy`: `cacheproxy serve` with its disk tier (no tenants) in front of a llama-server with
  `--cache-ram 0` (or `--proxy-cache-ram`).

With `--rounds N` the trace runs N times per arm, the arm going first alternating. Per run:
requests, prompt tokens (`cache_n + prompt_n`), tokens decoded (`prompt_n`), wall time, latency
p50/p90, and for the proxy its predictions checked against the server's `cache_n`; then proxy /
direct within each round against the targets (wall time at most 1.0x, decoded at most 1.05x).
It asserts nothing: it measures.

`cacheproxy bench conversations [--conversations N] [--clients N] [--slots N] [--rounds N] ...`
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.bench.agents_bench import ARMS, DEFAULT_DIRECT_CACHE_RAM_MIB, TARGETS
from cacheproxy.bench.cache_bench import REQUEST_TIMEOUT, arm_front, prepare_llama_server
from cacheproxy.bench.cache_config import DEFAULT_SERVER_ARGS, ServerOptions
from cacheproxy.bench.conversations_client import ChatClient, ChatResult, check_context, replay
from cacheproxy.bench.conversations_corpus import load_conversations
from cacheproxy.bench.conversations_report import render_markdown
from cacheproxy.bench.conversations_trace import (
    ConversationsSpec,
    ConversationsTrace,
    pick_conversations,
    system_prompt,
)
from cacheproxy.bench.harness import (
    ProcessSet,
    invoked_command,
    progress,
    rotated,
    run_with_processes,
)
from cacheproxy.bench.report_figures import percentile
from cacheproxy.bench.run_counters import disk_tier_counters, server_counters, server_work
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model

DEFAULT_SLOTS = 4
DEFAULT_CLIENTS = 4
# Chats are short: the system prompt and a few utterances.
DEFAULT_SLOT_CONTEXT = 4096
PREDICTIONS_PREFIX = "predictions_total{"


@dataclass(frozen=True)
class ConversationsBenchConfig:
    spec: ConversationsSpec = field(default_factory=ConversationsSpec)
    arms: tuple[str, ...] = ARMS
    rounds: int = 1
    clients: int = DEFAULT_CLIENTS
    model_size: str = "small"
    seed: int = 1
    slots: int = DEFAULT_SLOTS
    slot_context: int = DEFAULT_SLOT_CONTEXT
    server_args: tuple[str, ...] = DEFAULT_SERVER_ARGS
    direct_cache_ram_mib: int = DEFAULT_DIRECT_CACHE_RAM_MIB
    # 0, as `bench agents` runs its proxy arm: the disk tier in place of the server's RAM cache
    proxy_cache_ram_mib: int = 0
    disk_budget_mib: int = 1024
    disk_blocks: bool = True  # the proxy's `disk.blocks`: archives cut into blocks

    def __post_init__(self) -> None:
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"unknown arm: {sorted(unknown)}")
        if not self.arms:
            raise ValueError("nothing to run: give at least one arm")
        if self.slots < 1 or self.clients < 1 or self.rounds < 1:
            raise ValueError("slots, clients and rounds must each be at least 1")
        if self.spec.conversations <= self.slots:
            raise ValueError(
                f"the trace needs more conversations than slots: {self.spec.conversations}"
                f" conversations, {self.slots} slots"
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


def build_trace(spec: ConversationsSpec, seed: int) -> ConversationsTrace:
    """The conversations `seed` picks from the installed corpus, and the system prompt."""
    corpus = load_conversations(spec.languages)
    picked = pick_conversations(corpus, spec.conversations, seed)
    return ConversationsTrace(system_prompt(spec.system_words, seed), tuple(picked))


# --- one arm ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConversationsArmRun:
    round: int
    arm: str
    results: tuple[ChatResult, ...]
    wall_s: float
    server_cache_ram_mib: int
    llama_server_command: str
    proxy_command: str | None
    counters: dict[str, float] = field(default_factory=dict)  # the proxy's /metrics
    # CPU seconds over the replay (start-ups left out): llama-server's, and the proxy's
    server_cpu_s: float = 0.0
    proxy_cpu_s: float | None = None
    # llama-server's decode calls, busy slots per call, prompt and generation seconds
    server_work: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(result.prompt_tokens for result in self.results)

    @property
    def decoded(self) -> int:
        return sum(result.prompt_n for result in self.results)

    @property
    def cached(self) -> int:
        return sum(result.cache_n for result in self.results)

    def latency_ms(self, quantile: int) -> float:
        return percentile([result.latency_s * 1000 for result in self.results], quantile)

    @property
    def predictions(self) -> dict[str, float]:
        """How the proxy's predicted reuse fared against `cache_n`, by result."""
        return {
            name.removeprefix(PREDICTIONS_PREFIX).removesuffix("}"): value
            for name, value in self.counters.items()
            if name.startswith(PREDICTIONS_PREFIX)
        }


@dataclass(frozen=True)
class ConversationsRunContext:
    config: ConversationsBenchConfig
    processes: ProcessSet
    session: aiohttp.ClientSession
    trace: ConversationsTrace


async def run_arm(
    context: ConversationsRunContext, round_index: int, arm: str
) -> ConversationsArmRun:
    config = context.config
    name = f"conversations-{round_index}-{arm}"
    cache_ram_mib = config.server_cache_ram_mib(arm)
    server = prepare_llama_server(
        context.processes, f"{name}-llama-server", config.server, config.model_size, cache_ram_mib
    )
    await server.start(context.session)
    counters: dict[str, float] = {}
    try:
        await check_context(context.session, server, context.trace, config.spec.answer_tokens)
        base_url, proxy_command = await arm_front(
            arm, context.processes, context.session, name, server,
            config.disk_budget_mib, config.disk_blocks,
        )  # fmt: skip
        progress(
            f"{name}: {len(context.trace.conversations)} conversations,"
            f" {context.trace.requests} requests, {config.clients} clients over {base_url}"
        )
        proxy = context.processes.find(f"{name}-proxy") if arm == "proxy" else None
        cpu_at_start = (server.cpu_s, proxy.cpu_s() if proxy is not None else 0.0)
        counted_at_start = await server_counters(context.session, server.url)
        started = time.perf_counter()
        client = ChatClient(
            context.session, base_url, config.spec.answer_tokens, context.trace.system, started
        )
        results = await replay(client, context.trace, config.clients)
        wall_s = time.perf_counter() - started
        server_cpu_s = server.cpu_s - cpu_at_start[0]
        proxy_cpu_s = None if proxy is None else proxy.cpu_s() - cpu_at_start[1]
        work = server_work(counted_at_start, await server_counters(context.session, server.url))
        if arm == "proxy":
            counters = await disk_tier_counters(context.session, base_url)
    finally:
        # this arm's processes stop now: the next arm must not share the CPUs with them
        context.processes.stop_named(f"{name}-")
    return ConversationsArmRun(
        round=round_index,
        arm=arm,
        results=tuple(sorted(results, key=lambda result: result.started_s)),
        wall_s=wall_s,
        server_cache_ram_mib=cache_ram_mib,
        llama_server_command=shlex.join(server.args),
        proxy_command=proxy_command,
        counters=counters,
        server_cpu_s=server_cpu_s,
        proxy_cpu_s=proxy_cpu_s,
        server_work=work,
    )


async def run_all(context: ConversationsRunContext) -> list[ConversationsArmRun]:
    runs = []
    for round_index in range(context.config.rounds):
        for arm in rotated(context.config.arms, round_index):  # each arm goes first in turn
            run = await run_arm(context, round_index, arm)
            progress(
                f"round {round_index} {arm}: {len(run.results)} requests, {run.prompt_tokens}"
                f" prompt tokens, decoded {run.decoded}, wall {run.wall_s:.1f} s"
            )
            runs.append(run)
    return runs


async def benchmark(
    config: ConversationsBenchConfig, trace: ConversationsTrace, processes: ProcessSet
) -> list[ConversationsArmRun]:
    progress("locating llama-server and the model (a build in progress is waited for)")
    ensure_llama_server()
    ensure_model(config.model_size)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as session:
        return await run_all(ConversationsRunContext(config, processes, session, trace))


# --- figures ----------------------------------------------------------------------------------


def result_as_json(result: ChatResult) -> dict[str, Any]:
    return {
        "conversation": result.conversation,
        "turn": result.turn,
        "started_ms": result.started_s * 1000,
        "prompt_tokens": result.prompt_tokens,
        "cache_n": result.cache_n,
        "prompt_n": result.prompt_n,
        "output_tokens": result.output_tokens,
        "latency_ms": result.latency_s * 1000,
    }


def run_as_json(run: ConversationsArmRun) -> dict[str, Any]:
    return {
        "round": run.round,
        "arm": run.arm,
        "requests": len(run.results),
        "prompt_tokens": run.prompt_tokens,
        "tokens_cached": run.cached,
        "tokens_decoded": run.decoded,
        "output_tokens": sum(result.output_tokens for result in run.results),
        "wall_s": run.wall_s,
        "server_cpu_s": run.server_cpu_s,
        "proxy_cpu_s": run.proxy_cpu_s,
        "server_work": run.server_work,
        "latency_p50_ms": run.latency_ms(50),
        "latency_p90_ms": run.latency_ms(90),
        "server_cache_ram_mib": run.server_cache_ram_mib,
        "llama_server_command": run.llama_server_command,
        "proxy_command": run.proxy_command,
        "predictions": run.predictions,
        "disk_tier": run.counters,
        "requests_detail": [result_as_json(result) for result in run.results],
    }


def proxy_over_direct(
    runs: Sequence[ConversationsArmRun], round_index: int | None = None
) -> dict[str, float] | None:
    """Proxy / direct within one round, or (None) over every round's sums."""
    chosen = [run for run in runs if round_index is None or run.round == round_index]
    by_arm: dict[str, list[ConversationsArmRun]] = {}
    for run in chosen:
        by_arm.setdefault(run.arm, []).append(run)
    if "direct" not in by_arm or "proxy" not in by_arm:
        return None
    direct_decoded = sum(run.decoded for run in by_arm["direct"])
    direct_wall = sum(run.wall_s for run in by_arm["direct"])
    return {
        "tokens_decoded": (
            sum(run.decoded for run in by_arm["proxy"]) / direct_decoded
            if direct_decoded
            else float("nan")
        ),
        "wall_time": sum(run.wall_s for run in by_arm["proxy"]) / direct_wall,
    }


def conversations_as_json(
    config: ConversationsBenchConfig,
    trace: ConversationsTrace,
    runs: Sequence[ConversationsArmRun],
    model: str,
) -> dict[str, Any]:
    """The figures: the JSON `cacheproxy bench conversations --json` writes."""
    languages = sorted({conversation.language for conversation in trace.conversations})
    return {
        "model": model,
        "seed": config.seed,
        "spec": {**asdict(config.spec), "languages": list(config.spec.languages)},
        "conversations": len(trace.conversations),
        "languages_picked": languages,
        "requests_per_run": trace.requests,
        "system_prompt_words": len(trace.system.split()),
        "arms": list(config.arms),
        "rounds": config.rounds,
        "clients": config.clients,
        "slots": config.slots,
        "slot_context": config.slot_context,
        "server_args": list(config.server_args),
        "direct_cache_ram_mib": config.direct_cache_ram_mib,
        "proxy_cache_ram_mib": config.proxy_cache_ram_mib,
        "disk_blocks": config.disk_blocks,
        "targets": TARGETS,
        "runs": [run_as_json(run) for run in runs],
        "proxy_over_direct": {
            "by_round": [proxy_over_direct(runs, index) for index in range(config.rounds)],
            "all_rounds": proxy_over_direct(runs),
        },
    }


# --- the command ------------------------------------------------------------------------------


def run_conversations_benchmark(
    config: ConversationsBenchConfig, json_path: str | None = None
) -> int:
    """Run every round and arm, print the Markdown report; return an exit code."""
    command = invoked_command()
    load_average = os.getloadavg()  # before our own processes start
    try:
        trace = build_trace(config.spec, config.seed)  # a bad language or count fails here
    except ValueError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2

    async def body(processes: ProcessSet) -> list[ConversationsArmRun]:
        return await benchmark(config, trace, processes)

    code, runs = run_with_processes("cacheproxy-conversations-bench-", body)
    if runs is None:
        return code
    figures = conversations_as_json(config, trace, runs, ensure_model(config.model_size).name)
    machine = {
        "command": command,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(load_average),
        "platform": platform.platform(),
    }
    print(render_markdown(machine, figures))
    if json_path is not None:
        Path(json_path).write_text(json.dumps({**machine, "conversations": figures}, indent=2))
        progress(f"figures written to {json_path}")
    return 0


def run_from_options(
    *,
    conversations: int,
    languages: Sequence[str],
    system_words: int,
    answer_tokens: int,
    clients: int,
    slots: int,
    slot_context: int,
    rounds: int,
    arms: Sequence[str],
    proxy_cache_ram_mib: int,
    size: str,
    seed: int,
    server_args: str,
    json_path: str | None,
    disk_blocks: bool = True,
) -> int:
    """The CLI's entry: options in, exit code out (2 for a configuration that cannot run)."""
    try:
        spec = ConversationsSpec(
            conversations=conversations,
            languages=tuple(dict.fromkeys(languages)),
            system_words=system_words,
            answer_tokens=answer_tokens,
        )
        config = ConversationsBenchConfig(
            spec=spec,
            arms=tuple(dict.fromkeys(arms)),
            rounds=rounds,
            clients=clients,
            model_size=size,
            seed=seed,
            slots=slots,
            slot_context=slot_context,
            server_args=tuple(shlex.split(server_args)),
            proxy_cache_ram_mib=proxy_cache_ram_mib,
            disk_blocks=disk_blocks,
        )
    except ValueError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    return run_conversations_benchmark(config, json_path)
