"""W5's figures as Markdown: the table per API and arm, proxy/direct against the targets, and the
reading in plain words. Pure: it reads the dict `agents_bench.agents_as_json` returns (also the
`agents` entry of `cacheproxy bench report`'s figures) and writes text."""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Iterator
from typing import Any

from cacheproxy.bench.cache_report import command_template, disk_line
from cacheproxy.bench.harness import table_row

API_LABELS = {"messages": "/v1/messages (anthropic SDK)", "responses": "/v1/responses (openai SDK)"}
ARM_LABELS = {"direct": "llama-server alone", "proxy": "through cacheproxy"}

COLUMNS = (
    "API",
    "arm",
    "server cache-ram MiB",
    "requests",
    "prompt tokens",
    "tokens decoded",
    "oracle (est.)",
    "decoded/oracle",
    "wall s",
    "server CPU s",
    "proxy CPU s",
    "TTFT p50 ms",
    "TTFT p99 ms",
)


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


def ratio(top: float, bottom: float) -> float:
    return top / bottom if bottom else math.nan


def describe(agents: dict[str, Any]) -> str:
    spec = agents["spec"]

    def span(name: str) -> str:
        return f"{spec[name]['low']}-{spec[name]['high']}"

    return (
        f"W5 agents: {spec['agents']} agents on {agents['slots']} slots, {span('turns')} turns"
        f" each, system prompt {span('system_words')} words, task {span('task_words')} words,"
        f" a tool output of {span('tool_output_lines')} lines per turn, answers of at most"
        f" {spec['answer_tokens']} tokens; arrivals {spec['arrival_gap_s']} s apart on average,"
        f" tools taking up to {spec['max_tool_s']} s; seed {agents['seed']}"
    )


def rounds_of(agents: dict[str, Any]) -> int:
    return agents.get("rounds", 1)  # figures written before `--rounds` ran once


def run_row(run: dict[str, Any], rounds: int = 1) -> str:
    return table_row(
        [
            *([str(run.get("round", 0))] if rounds > 1 else []),
            run["api"],
            run["arm"],
            str(run["server_cache_ram_mib"]),
            str(run["requests"]),
            str(run["prompt_tokens"]),
            str(run["tokens_decoded"]),
            str(run["oracle_estimate"]),
            fmt(ratio(run["tokens_decoded"], run["oracle_estimate"]), ".2f"),
            fmt(run["wall_s"], ".1f"),
            fmt(run.get("server_cpu_s"), ".1f"),
            fmt(run.get("proxy_cpu_s"), ".1f"),
            fmt(run["ttft_p50_ms"], ".0f"),
            fmt(run["ttft_p99_ms"], ".0f"),
        ]
    )


def verdict(value: float, target: float) -> str:
    if math.isnan(value):
        return "—"
    return "met" if value <= target else "missed"


def ratio_rows(agents: dict[str, Any]) -> Iterator[str]:
    """Each API's ratios; with rounds, each round's and then over the sums of all of them."""
    rows = []
    by_round = agents.get("proxy_over_direct_by_round", {})
    for api, ratios in agents["proxy_over_direct"].items():
        if rounds_of(agents) > 1:
            rows += [(f"{api}, round {index}", r) for index, r in enumerate(by_round[api])]
            rows.append((f"{api}, all rounds (sums)", ratios))
        else:
            rows.append((api, ratios))
    found = [(label, ratios) for label, ratios in rows if ratios is not None]
    yield from targets_table("API", found, agents["targets"])


def targets_table(
    first_column: str, rows: list[tuple[str, dict[str, float]]], targets: dict[str, float]
) -> Iterator[str]:
    """Proxy over direct, each row's tokens decoded and wall time against their targets
    (nothing without rows)."""
    if not rows:
        return
    yield (
        f"Proxy / direct (targets: wall time <= {targets['wall_time']}x, tokens decoded <="
        f" {targets['tokens_decoded']}x):"
    )
    yield ""
    yield table_row([first_column, "tokens decoded", "target", "wall time", "target"])
    yield table_row(["---", "---:", "---", "---:", "---"])
    for label, ratios in rows:
        decoded, wall = ratios["tokens_decoded"], ratios["wall_time"]
        yield table_row(
            [
                label,
                fmt(decoded, ".3f"),
                verdict(decoded, targets["tokens_decoded"]),
                fmt(wall, ".3f"),
                verdict(wall, targets["wall_time"]),
            ]
        )
    yield ""


def agents_sentences(agents: dict[str, Any]) -> Iterator[str]:
    """The reading of W5, every number computed from the figures."""
    targets = agents["targets"]
    for api, ratios in agents["proxy_over_direct"].items():
        if ratios is None:
            continue
        decoded, wall = ratios["tokens_decoded"], ratios["wall_time"]
        sums = {
            arm: {
                figure: sum(
                    run[figure] for run in agents["runs"] if (run["api"], run["arm"]) == (api, arm)
                )
                for figure in ("tokens_decoded", "wall_s")
            }
            for arm in ("direct", "proxy")
        }
        rounds = rounds_of(agents)
        over = f" over {rounds} rounds" if rounds > 1 else ""
        both = [
            f"decoded {fmt(decoded, '.2f')}x the prompt tokens of llama-server alone"
            f" ({sums['proxy']['tokens_decoded']} vs {sums['direct']['tokens_decoded']}{over},"
            f" target <= {targets['tokens_decoded']}x:"
            f" {verdict(decoded, targets['tokens_decoded'])})",
            f"took {fmt(wall, '.2f')}x its wall time ({sums['proxy']['wall_s']:.1f} s vs"
            f" {sums['direct']['wall_s']:.1f} s{over}, target <= {targets['wall_time']}x:"
            f" {verdict(wall, targets['wall_time'])})",
        ]
        sentence = f"W5 over {API_LABELS.get(api, api)}: the proxy {both[0]} and {both[1]}"
        if rounds > 1:
            walls = [r["wall_time"] for r in agents["proxy_over_direct_by_round"][api] if r]
            sentence += (
                f"; round by round {', '.join(fmt(w, '.2f') for w in walls)}x"
                f" ({sum(w <= targets['wall_time'] for w in walls)} of {len(walls)} at or under"
                " the target)"
            )
        yield sentence + "."


def run_notes(agents: dict[str, Any]) -> Iterator[str]:
    for run in agents["runs"]:
        where = f"{run['api']}, {run['arm']}"
        if rounds_of(agents) > 1:
            where += f", round {run.get('round', 0)}"
        if run.get("disk_tier"):
            yield f"- {where}: {disk_line(run['disk_tier'])}"
        implausible = [
            detail
            for detail in run["requests_detail"]
            if not 0 <= detail["decoded"] <= detail["prompt_tokens"]
        ]
        if implausible:
            yield f"- note: {where}: {len(implausible)} requests with usage outside 0..prompt"


def agents_section(agents: dict[str, Any], image: str | None = None) -> Iterator[str]:
    """The section; `image` (a Markdown image link) goes under its title."""
    yield f"## {describe(agents)}"
    yield ""
    if image is not None:
        yield image
        yield ""
    yield (
        f"Model {agents['model']}; every arm a fresh llama-server `--parallel {agents['slots']}"
        f" --ctx-size {agents['slots'] * agents['slot_context']}"
        f" {shlex.join(agents['server_args'])}`: direct with `--cache-ram"
        f" {agents['direct_cache_ram_mib']}` (llama-server's default), proxy with `--cache-ram"
        f" {agents['proxy_cache_ram_mib']}` behind `cacheproxy serve` and its disk tier."
        " Streamed, temperature 0; tokens from each answer's usage (Messages: input_tokens +"
        " cache_read_input_tokens, decoded = input_tokens; Responses: input_tokens, decoded ="
        " input_tokens - input_tokens_details.cached_tokens). The oracle is estimated from the"
        " same counts: each agent's first prompt, then per turn what the prompt grew by beyond"
        " the previous prompt and its answer."
    )
    yield ""
    rounds = rounds_of(agents)
    first = ["round"] if rounds > 1 else []
    yield table_row([*first, *COLUMNS])
    yield table_row([*(["---:"] * len(first)), "---", "---", *["---:"] * (len(COLUMNS) - 2)])
    for api in agents["apis"]:
        for arm in agents["arms"]:
            for run in agents["runs"]:
                if run["api"] == api and run["arm"] == arm:
                    yield run_row(run, rounds)
    yield ""
    yield from ratio_rows(agents)
    notes = list(run_notes(agents))
    if notes:
        yield from notes
        yield ""


def command_entries(agents: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(command with placeholders, who ran it) for every process W5 started."""
    for run in agents["runs"]:
        label = f"W5/{run['api']}/{run['arm']}"
        yield command_template(run["llama_server_command"]), label
        if run.get("proxy_command"):
            yield command_template(run["proxy_command"]), label


def machine_lines(title: str, machine: dict[str, Any]) -> list[str]:
    """A benchmark report's title and the machine it ran on."""
    load = ", ".join(f"{value:.2f}" for value in machine["load_average_at_start"])
    return [
        f"# {title}",
        "",
        f"- command: `{machine['command']}`",
        f"- machine: {machine['cpu_count']} CPUs, {machine['platform']}; load average"
        f" (1, 5, 15 min) at start: {load}",
        "- ratios are within this run only; absolute times depend on the machine",
        "",
    ]


def commands_lines(entries: Iterable[tuple[str, str]]) -> list[str]:
    """Each distinct command (with placeholders) once, with who ran it."""
    lines = ["## Commands (ports and folders differ per run; the JSON has each exact command)", ""]
    users: dict[str, list[str]] = {}
    for template, label in entries:
        users.setdefault(template, []).append(label)
    for template, labels in users.items():
        lines += [f"- `{template}`", f"  ({', '.join(labels)})"]
    return lines


def render_markdown(machine: dict[str, Any], agents: dict[str, Any]) -> str:
    """`cacheproxy bench agents`'s own report: the machine, the section, the reading, the
    commands."""
    lines = [
        *machine_lines("cacheproxy agents benchmark (W5)", machine),
        *agents_section(agents),
        "## Reading",
        "",
        *(f"- {sentence}" for sentence in agents_sentences(agents)),
        "",
        *commands_lines(command_entries(agents)),
    ]
    return "\n".join(lines) + "\n"
