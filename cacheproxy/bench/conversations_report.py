"""The conversations benchmark's figures as Markdown: the table per round and arm, proxy/direct
against the targets, and the reading in plain words. Pure: it reads the dict
`conversations_bench.conversations_as_json` returns and writes text."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from typing import Any

from cacheproxy.bench.agents_report import (
    commands_lines,
    fmt,
    machine_lines,
    ratio,
    targets_table,
    verdict,
)
from cacheproxy.bench.cache_report import command_template, disk_line
from cacheproxy.bench.harness import table_row

COLUMNS = (
    "round",
    "arm",
    "server cache-ram MiB",
    "requests",
    "prompt tokens",
    "tokens decoded",
    "decoded / direct",
    "wall s",
    "wall / direct",
    "server CPU s",
    "proxy CPU s",
    "latency p50 ms",
    "latency p90 ms",
    "mispredicted",
)


def describe(figures: dict[str, Any]) -> str:
    spec = figures["spec"]
    system = (
        f"behind one system prompt of {figures['system_prompt_words']} words"
        if figures["system_prompt_words"]
        else "without a system prompt"
    )
    return (
        f"Conversations: {figures['conversations']} recorded conversations"
        f" ({', '.join(figures['languages_picked'])}), {figures['requests_per_run']} requests,"
        f" {system}, on {figures['slots']} slots with {figures['clients']} clients; answers of"
        f" at most {spec['answer_tokens']} tokens; seed {figures['seed']}"
    )


def direct_of(figures: dict[str, Any], round_index: int) -> dict[str, Any] | None:
    return next(
        (run for run in figures["runs"] if run["round"] == round_index and run["arm"] == "direct"),
        None,
    )


def run_row(figures: dict[str, Any], run: dict[str, Any]) -> str:
    direct = direct_of(figures, run["round"])
    decoded_ratio = wall_ratio = None
    if direct is not None:
        decoded_ratio = ratio(run["tokens_decoded"], direct["tokens_decoded"])
        wall_ratio = ratio(run["wall_s"], direct["wall_s"])
    mispredicted = None
    if run["proxy_command"]:
        mispredicted = run["predictions"].get('result="mismatch"', 0.0)
    return table_row(
        [
            str(run["round"]),
            run["arm"],
            str(run["server_cache_ram_mib"]),
            str(run["requests"]),
            str(run["prompt_tokens"]),
            str(run["tokens_decoded"]),
            fmt(decoded_ratio, ".3f"),
            fmt(run["wall_s"], ".1f"),
            fmt(wall_ratio, ".3f"),
            fmt(run.get("server_cpu_s"), ".1f"),
            fmt(run.get("proxy_cpu_s"), ".1f"),
            fmt(run["latency_p50_ms"], ".0f"),
            fmt(run["latency_p90_ms"], ".0f"),
            fmt(mispredicted, ".0f"),
        ]
    )


def ratio_rows(figures: dict[str, Any]) -> Iterator[str]:
    ratios = figures["proxy_over_direct"]
    rows = [(str(index), found) for index, found in enumerate(ratios["by_round"])]
    if len(rows) > 1:
        rows.append(("all (sums)", ratios["all_rounds"]))
    rows = [(label, found) for label, found in rows if found is not None]
    yield from targets_table("round", rows, figures["targets"])


def sentences(figures: dict[str, Any]) -> Iterator[str]:
    """The reading, every number computed from the figures."""
    targets = figures["targets"]
    runs = figures["runs"]
    prompts = {(run["requests"], run["prompt_tokens"]) for run in runs}
    if len(prompts) == 1:
        requests, tokens = prompts.pop()
        yield f"Every run sent the same {requests} requests, {tokens} prompt tokens in all."
    else:
        counts = ", ".join(f"{run['arm']} {run['prompt_tokens']}" for run in runs)
        yield f"The runs' prompts differ (prompt tokens: {counts}): the arms are not comparable."
    found = figures["proxy_over_direct"]["all_rounds"]
    if found is None:
        return
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], []).append(run)
    decoded = {arm: sum(run["tokens_decoded"] for run in its) for arm, its in by_arm.items()}
    wall = {arm: sum(run["wall_s"] for run in its) for arm, its in by_arm.items()}
    over = f" over {figures['rounds']} rounds" if figures["rounds"] > 1 else ""
    decoded_met = verdict(found["tokens_decoded"], targets["tokens_decoded"])
    wall_met = verdict(found["wall_time"], targets["wall_time"])
    yield (
        f"The proxy{over} decoded {fmt(found['tokens_decoded'], '.3f')}x the prompt tokens of"
        f" llama-server alone ({decoded['proxy']} vs {decoded['direct']}, target <="
        f" {targets['tokens_decoded']}x: {decoded_met}) and took {fmt(found['wall_time'], '.3f')}x"
        f" its wall time ({wall['proxy']:.1f} s vs {wall['direct']:.1f} s, target <="
        f" {targets['wall_time']}x: {wall_met})."
    )


def run_notes(figures: dict[str, Any]) -> Iterator[str]:
    for run in figures["runs"]:
        where = f"round {run['round']}, {run['arm']}"
        if work := run.get("server_work"):
            yield (
                f"- {where}: llama-server made {work['decode_calls']:.0f} decode calls,"
                f" {work['busy_slots_per_decode']:.2f} busy slots per call; prompts"
                f" {work['prompt_s']:.2f} s, generation {work['generation_s']:.2f} s"
            )
        if not run["proxy_command"]:
            continue
        if run["disk_tier"]:
            yield f"- {where}: {disk_line(run['disk_tier'])}"
        if run["predictions"]:
            counted = ", ".join(f"{name} {value:.0f}" for name, value in run["predictions"].items())
            yield f"- {where}: predicted reuse against the server's cache_n: {counted}"


def section(figures: dict[str, Any]) -> Iterator[str]:
    yield f"## {describe(figures)}"
    yield ""
    yield (
        f"Model {figures['model']}; every run a fresh llama-server `--parallel {figures['slots']}"
        f" --ctx-size {figures['slots'] * figures['slot_context']}"
        f" {shlex.join(figures['server_args'])}`: direct with `--cache-ram"
        f" {figures['direct_cache_ram_mib']}` (llama-server's default), proxy with `--cache-ram"
        f" {figures['proxy_cache_ram_mib']}` behind `cacheproxy serve` and its disk tier"
        f"{'' if figures.get('disk_blocks', True) else ' (archives kept as whole files)'}."
        " `/v1/chat/completions`, temperature 0, the recorded answers as history; prompt tokens"
        " = cache_n + prompt_n of each answer's timings, decoded = prompt_n; latency = request"
        " to whole answer; mispredicted = the proxy's"
        ' `cacheproxy_predictions_total{result="mismatch"}`.'
    )
    yield ""
    yield table_row(list(COLUMNS))
    yield table_row(["---", "---", *["---:"] * (len(COLUMNS) - 2)])
    for run in figures["runs"]:
        yield run_row(figures, run)
    yield ""
    yield from ratio_rows(figures)
    notes = list(run_notes(figures))
    if notes:
        yield from notes
        yield ""


def command_entries(figures: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for run in figures["runs"]:
        label = f"round {run['round']}/{run['arm']}"
        yield command_template(run["llama_server_command"]), label
        if run["proxy_command"]:
            yield command_template(run["proxy_command"]), label


def render_markdown(machine: dict[str, Any], figures: dict[str, Any]) -> str:
    """`cacheproxy bench conversations`'s report: the machine, the table, the reading, the
    commands."""
    lines = [
        *machine_lines("cacheproxy conversations benchmark", machine),
        *section(figures),
        "## Reading",
        "",
        *(f"- {sentence}" for sentence in sentences(figures)),
        "",
        *commands_lines(command_entries(figures)),
    ]
    return "\n".join(lines) + "\n"
