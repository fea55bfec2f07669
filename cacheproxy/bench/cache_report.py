"""`cacheproxy bench cache`'s figures: per arm, the proxy against direct, as Markdown and JSON.

Pure: it reads the runs `cache_bench.py` measured and writes text; nothing here talks to a
server.
"""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cacheproxy.bench.cache_client import ArmRun, Completion
from cacheproxy.bench.cache_config import CacheBenchConfig
from cacheproxy.bench.harness import table_row
from cacheproxy.bench.report_repeats import repeats_as_json
from cacheproxy.bench.workloads import with_restart


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
        "server": run.server,
        "load_average_at_its_start": list(run.load_average) if run.load_average else None,
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
    """The row's runs of the first repetition (the others are in `repeats_as_json`)."""
    return [
        run
        for run in report.runs
        if run.workload == workload and run.cache_ram_mib == cache_ram_mib and run.repetition == 0
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
    models = ""
    if config.models > 1:
        limit = config.models_max if config.models_max is not None else "llama-server's 4"
        models = (
            f"; {config.models} models (user u -> model u mod {config.models}), each arm's"
            f" llama-server a router over them (--models-dir), at most {limit} loaded; the"
            " oracle counts each model's requests apart"
        )
    return (
        f"{workload} multi-turn: {spec.tenants} tenants x {spec.users_per_tenant} users x"
        f" {spec.turns} turns, tenant prefix {spec.tenant_prefix_tokens} + history"
        f" {spec.history_tokens}, question {spec.question_tokens}, answer {spec.n_predict}"
        f" generated tokens appended, {config.in_flight} in flight, round-robin over users"
        + restart
        + models
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
    line = (
        f"disk tier: {disk['saves']:.0f} saves ({disk['save_bytes'] / mib:.1f} MiB,"
        f" {disk['save_s'] * 1000:.0f} ms), {disk['restores']:.0f} restores"
        f" ({disk['restore_bytes'] / mib:.1f} MiB, {disk['restore_s'] * 1000:.0f} ms),"
        f" {disk['failed_restores']:.0f} failed restores,"
        f" {disk.get('queued', 0):.0f} requests waited"
        f" {disk.get('queue_wait_s', 0):.2f} s for a slot in all"
    )
    reasons = sorted(
        ((name.removeprefix("wait_"), s) for name, s in disk.items() if name.startswith("wait_")),
        key=lambda item: -item[1],
    )
    if reasons:  # what they still waited for when served: the longest first
        line += " (" + ", ".join(f"{reason} {s:.2f} s" for reason, s in reasons) + ")"
    answered = [
        f"a {action} after {disk[f'{action}_round_trip_s'] / count * 1000:.1f} ms"
        f" ({disk.get(f'{action}_stall_s', 0.0) / count * 1000:.2f} ms of it the {work})"
        for action, work in (("save", "write"), ("restore", "read"))
        if (count := disk.get(f"{action}_round_trips", 0))
    ]
    if answered:  # beside busy slots, what is not the server's own is mostly the batch under way
        line += "; the server answered " + " and ".join(answered) + " on average"
    if "ram_cache_budget_bytes" in disk:  # a server with a RAM cache: what the proxy counts on
        budget_mib, shown = disk["ram_cache_budget_bytes"] / mib, disk["ram_cache_shown_bytes"]
        counted = (
            "taken as a fact"
            if shown < 0
            else f"{shown / mib:.1f} MiB of it shown kept (counted on that far)"
        )
        line += f"; the server's RAM cache followed at a budget of {budget_mib:.0f} MiB, {counted}"
    if "proxy_waiting_s" in disk:
        # every request passes through the proxy's loop twice (its way in, its first event
        # out): on a loaded machine, time it waits for a CPU is time the request waits
        line += (
            f"; the proxy's CPU {disk['proxy_cpu_s']:.1f} s, its loop waited"
            f" {disk['proxy_waiting_s']:.1f} s for a CPU"
        )
    return line


def server_line(server: dict[str, float]) -> str:
    """Where llama-server's time went: its CPU, and its own counters (the last process's)."""
    parts = [f"llama-server CPU {server['cpu_s']:.1f} s"] if "cpu_s" in server else []
    if "waiting_s" in server:
        # a loaded machine: its loop ready to run, waiting for a CPU
        parts.append(f"its loop waited {server['waiting_s']:.1f} s for a CPU")
    if "n_decode_total" in server:
        parts.append(
            f"{server['n_decode_total']:.0f} decode calls,"
            f" {server.get('n_busy_slots_per_decode', 0):.2f} busy slots per call"
        )
    if "prompt_seconds_total" in server:
        parts.append(
            f"prompt {server.get('prompt_tokens_total', 0):.0f} tokens in"
            f" {server['prompt_seconds_total']:.1f} s"
        )
    return ", ".join(parts)


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
        " `cacheproxy serve --upstream` in front of it; before each run the disk has written"
        " out what earlier runs wrote (`sync`), and each run's slot folder is removed after it",
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
            if run.repetition == 0
        ],
        "proxy_over_direct": {
            f"{workload}/cache-ram-{cache_ram_mib}": proxy_over_direct(
                runs_of(report, workload, cache_ram_mib)
            )
            for workload in report.config.workloads
            for cache_ram_mib in report.config.cache_ram_mib
        },
        "repeats": repeats_as_json(report.runs) if report.config.repeat > 1 else [],
    }
