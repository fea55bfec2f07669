"""`cacheproxy bench report`'s `report.md`: the figures tables, the reading, the plots, the
machine and the exact commands, written from the figures dict alone (no server)."""

from __future__ import annotations

import json
import shlex
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cacheproxy.bench.agents_report import agents_section, command_entries
from cacheproxy.bench.cache_report import (
    FIGURE_COLUMNS,
    command_template,
    describe_workload,
    disk_line,
    server_line,
)
from cacheproxy.bench.harness import table_row
from cacheproxy.bench.report_figures import (
    CONDITION_LABELS,
    CONDITIONS,
    Comparison,
    Run,
    cache_rams_of,
    cache_workloads_of,
    comparisons,
    condition_ttfts,
    config_from_json,
    fmt,
    ks,
    percentile,
    reading,
    runs_for,
)
from cacheproxy.bench.report_plots import plot_agents, plot_decoded, plot_isolation, plot_ttft
from cacheproxy.bench.report_repeats import repeats_section


def figure_row(run: Run) -> str:
    return table_row(
        [
            str(run.get("server_cache_ram_mib", run["cache_ram_mib"])),
            run["arm"],
            str(run["requests"]),
            str(run["prompt_tokens_sent"]),
            str(run["tokens_decoded"]),
            str(run["oracle"]),
            fmt(run["decoded_over_oracle"], ".2f"),
            fmt(run["wall_s"], ".1f"),
            fmt(run["ttft_p50_ms"], ".0f"),
            fmt(run["ttft_p99_ms"], ".0f"),
        ]
    )


def ratio_lines(found: Sequence[Comparison]) -> Iterator[str]:
    if not found:
        return
    yield "Proxy / direct:"
    yield ""
    yield table_row(["cache-ram MiB", "tokens decoded", "wall time", "TTFT p50", "TTFT p99"])
    yield table_row(["---:"] * 5)
    for comparison in found:
        yield table_row(
            [
                str(comparison.cache_ram_mib),
                fmt(comparison.decoded, ".3f"),
                fmt(comparison.wall, ".3f"),
                fmt(comparison.ttft(50), ".3f"),
                fmt(comparison.ttft(99), ".3f"),
            ]
        )
    yield ""


def run_notes(runs: Sequence[Run]) -> Iterator[str]:
    for run in runs:
        where = f"{run['arm']}, cache-ram {run['cache_ram_mib']}"
        if run.get("restarts"):
            yield f"- {where}: llama-server restarted {run['restarts']} time(s) mid-run"
        if run.get("disk_tier"):
            yield f"- {where}: {disk_line(run['disk_tier'])}"
        if run.get("server"):
            yield f"- {where}: {server_line(run['server'])}"
        if run.get("unaccounted_requests"):
            yield (
                f"- note: {where}: {run['unaccounted_requests']} requests with"
                " cache_n + prompt_n != prompt length"
            )


DISK_COLUMNS = (
    "cache-ram MiB",
    "archives",
    "saves",
    "MiB the saves wrote",
    "of it blocks",
    "restores",
    "MiB restored",
    "MiB put together",
    "MiB held at the end",
    "held as whole files",
    "mispredicted",
)
MIB = 1024 * 1024


def mib(value: float | None) -> str:
    return fmt(None if value is None else value / MIB, ".1f")


def disk_row(run: Run, blocks: bool) -> str:
    """A proxy arm's disk tier: what its saves wrote (with `disk.blocks` the server's file and
    then the blocks its cut added), what its restores read and had put together from blocks,
    what the archive folder held once every cut was done, and the answers it mispredicted."""
    disk = run["disk_tier"]
    block_bytes = disk.get("block_written_bytes")
    written = disk["save_bytes"] + (block_bytes or 0.0)
    return table_row(
        [
            str(run.get("server_cache_ram_mib", run["cache_ram_mib"])),
            "blocks" if blocks else "whole files",
            fmt(disk["saves"], ".0f"),
            mib(written),
            mib(block_bytes),
            fmt(disk["restores"], ".0f"),
            mib(disk["restore_bytes"]),
            mib(disk.get("assembled_bytes")),
            mib(disk.get("held_bytes")),
            mib(disk.get("held_as_whole_files_bytes")),
            fmt(disk.get("mispredictions"), ".0f"),
        ]
    )


def disk_table(figures: dict[str, Any], runs: Sequence[Run]) -> Iterator[str]:
    found = [run for run in runs if run.get("disk_tier")]
    if not found:
        return
    blocks = bool((figures.get("config") or {}).get("disk_blocks"))
    yield "The proxy's disk tier (MiB = 2^20 bytes; held: archive and block files once cut):"
    yield ""
    yield table_row(list(DISK_COLUMNS))
    yield table_row(["---:", "---", *["---:"] * (len(DISK_COLUMNS) - 2)])
    for run in found:
        yield disk_row(run, blocks)
    yield ""


def workload_title(figures: dict[str, Any], workload: str) -> str:
    if figures.get("config"):
        return describe_workload(config_from_json(figures["config"]), workload)
    return workload


def workload_section(figures: dict[str, Any], workload: str, out_dir: Path) -> Iterator[str]:
    runs = [
        run
        for cache_ram_mib in cache_rams_of(figures)
        for run in runs_for(figures, workload, cache_ram_mib).values()
    ]
    decoded_png = plot_decoded(figures, workload, out_dir / f"{workload}-decoded.png")
    ttft_png = plot_ttft(figures, workload, out_dir / f"{workload}-ttft.png")
    found = [c for c in comparisons(figures) if c.workload == workload]
    yield f"## {workload_title(figures, workload)}"
    yield ""
    yield f"![{workload}: tokens decoded per arm and cache-ram, against the oracle]({decoded_png})"
    yield ""
    yield table_row(list(FIGURE_COLUMNS))
    yield table_row(["---:", "---", *["---:"] * (len(FIGURE_COLUMNS) - 2)])
    yield from map(figure_row, runs)
    yield ""
    yield from ratio_lines(found)
    yield from disk_table(figures, runs)
    notes = list(run_notes(runs))
    if notes:
        yield from notes
        yield ""
    yield f"![{workload}: time to first token per arm, empirical CDF]({ttft_png})"
    yield ""


def isolation_section(audit: dict[str, Any], out_dir: Path) -> Iterator[str]:
    png = plot_isolation(audit, out_dir / "W4-ttft.png")
    ttft = condition_ttfts(audit)
    yield (
        f"## W4 isolation: two tenants, one llama-server slot, --cache-ram 0; a fresh"
        f" {audit['prefix_tokens']}-token prefix each trial + a {audit['question_tokens']}-token"
        f" question; {audit['trials_per_condition']} trials per condition, seed {audit['seed']}"
    )
    yield ""
    yield f"![W4: tenant B's time to first token by condition, empirical CDF]({png})"
    yield ""
    yield table_row(
        [
            "B's first token after",
            "trials",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "mean ms",
            "B's cache_n (max)",
        ]
    )
    yield table_row(["---", *["---:"] * 6])
    for condition in CONDITIONS:
        values = ttft[condition]
        cache_n = [trial["cache_n"] for trial in audit["trials"].get(condition, ())]
        yield table_row(
            [
                CONDITION_LABELS[condition],
                str(len(values)),
                fmt(percentile(values, 50), ".1f"),
                fmt(percentile(values, 90), ".1f"),
                fmt(percentile(values, 99), ".1f"),
                fmt(statistics.fmean(values) if values else None, ".1f"),
                str(max(cache_n)) if cache_n else "—",
            ]
        )
    yield ""
    yield table_row(["comparison", "KS D", "p", f"differ at p <= {audit['significance']}"])
    yield table_row(["---", "---:", "---:", "---"])
    for name, first in (
        ("another tenant primed vs nobody", "primed"),
        ("control: B primed itself vs nobody", "self-primed"),
    ):
        result = ks(ttft[first], ttft["cold"])
        if result is not None:
            differ = "yes" if result.p_value <= audit["significance"] else "no"
            yield table_row([name, f"{result.distance:.3f}", f"{result.p_value:.3g}", differ])
    yield ""


def command_lines(figures: dict[str, Any]) -> Iterator[str]:
    """Each distinct command once (ports and folders as placeholders), with who ran it."""
    users: dict[str, list[str]] = {}
    for run in figures.get("runs", ()):
        label = f"{run['workload']}/cache-ram {run['cache_ram_mib']}/{run['arm']}"
        users.setdefault(command_template(run["llama_server_command"]), []).append(label)
        if run.get("proxy_command"):
            users.setdefault(command_template(run["proxy_command"]), []).append(label)
    audit = figures.get("isolation")
    if audit:
        for key in ("llama_server_command", "proxy_command"):
            users.setdefault(command_template(audit[key]), []).append("W4")
    if figures.get("agents"):
        for template, label in command_entries(figures["agents"]):
            users.setdefault(template, []).append(label)
    for template, labels in users.items():
        yield f"- `{template}`"
        yield f"  ({', '.join(labels)})"


def header_lines(figures: dict[str, Any]) -> Iterator[str]:
    load = ", ".join(f"{value:.2f}" for value in figures["load_average_at_start"])
    yield f"- command: `{figures['command']}`"
    yield (
        f"- machine: {figures['cpu_count']} CPUs, {figures['platform']}; load average"
        f" (1, 5, 15 min) at start: {load}"
    )
    config = figures.get("config")
    if config:
        server = config["server"]
        yield f"- model: {figures['model']} (random weights); seed {config['seed']}"
        yield (
            f"- W1-W3, every arm: a fresh llama-server `--parallel {server['parallel']}"
            f" --ctx-size {server['ctx_size']} --cache-ram <as in the tables>"
            f" {shlex.join(server['extra_args'])}` (plus host, port, `--slot-save-path`,"
            " `--metrics`); direct = requests sent to it, proxy = requests sent through"
            " `cacheproxy serve --upstream` in front of it; before each run the disk has"
            " written out what earlier runs wrote (`sync`), and each run's slot folder is"
            " removed after it"
        )
        yield (
            "- requests: POST /completion, token-id prompts, temperature 0, ignore_eos,"
            " stream; decoded = sum of timings.prompt_n; oracle = prompt tokens an infinite"
            " cache would still decode, from that arm's own prompts and outputs"
        )
    audit = figures.get("isolation")
    if audit:
        yield (
            f"- W4: model {audit['model']}, one llama-server with one slot and the proxy with"
            " tenants a and b in front (their flags: Commands, below)"
        )
    yield "- ratios are within this run only; absolute times depend on the machine"
    yield "- raw figures: [figures.json](figures.json)"


def render_markdown(figures: dict[str, Any], out_dir: Path) -> str:
    """The report's text; draws each plot into `out_dir` as its section is written."""
    lines = ["# cacheproxy benchmark report", "", *header_lines(figures), "", "## Reading", ""]
    lines += [f"- {sentence}" for sentence in reading(figures)] or ["- (nothing to compare)"]
    lines.append("")
    lines += repeats_section(figures.get("repeats") or [])
    for workload in cache_workloads_of(figures):
        lines += workload_section(figures, workload, out_dir)
    if figures.get("isolation"):
        lines += isolation_section(figures["isolation"], out_dir)
    if figures.get("agents"):
        png = plot_agents(figures["agents"], out_dir / "W5.png")
        image = f"![W5: tokens decoded and wall time per API and arm]({png})"
        lines += agents_section(figures["agents"], image)
    lines += ["## Commands (ports and folders differ per run)", "", *command_lines(figures)]
    return "\n".join(lines) + "\n"


def render_report(figures: dict[str, Any], out_dir: Path) -> Path:
    """Write `out_dir/report.md`, its PNGs and the figures themselves (`figures.json`, which the
    report links) from the figures alone; return the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    path = out_dir / "report.md"
    path.write_text(render_markdown(figures, out_dir))
    return path
