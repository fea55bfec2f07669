"""`cacheproxy bench report`'s PNG plots: tokens decoded against the oracle, and TTFT
distributions (empirical CDFs) per arm and per W4 condition, drawn with matplotlib's Agg
canvas (no display needed)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
except ModuleNotFoundError as exc:  # a dev dependency: say so before any benchmark starts
    raise ModuleNotFoundError(
        "`cacheproxy bench report` draws its plots with matplotlib: pip install -e '.[dev]'"
    ) from exc

from cacheproxy.bench.cache_config import ARMS
from cacheproxy.bench.report_figures import (
    ARM_LABELS,
    CONDITION_LABELS,
    CONDITIONS,
    cache_rams_of,
    condition_ttfts,
    fmt,
    ks,
    runs_for,
    ttft_samples,
)

ARM_COLORS = {"direct": "tab:blue", "proxy": "tab:orange"}
CONDITION_STYLES = {
    "primed": ("tab:red", "-"),
    "cold": ("tab:blue", "-"),
    "self-primed": ("tab:green", "--"),
}


DPI = 110


def new_figure(width: float, height: float) -> Figure:
    # A bare Figure on the Agg canvas: no pyplot, so no global figure registry and no display.
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save(figure: Figure, path: Path) -> str:
    figure.savefig(path, format="png")
    return path.name


def plot_decoded(figures: dict[str, Any], workload: str, path: Path) -> str:
    """Grouped bars: tokens decoded per arm, grouped by cache-ram; a black line across each
    bar marks the oracle of that arm's own trace, a dashed one the prompt tokens sent."""
    rams = cache_rams_of(figures)
    figure = new_figure(max(5.5, 2.2 * len(rams) + 2.5), 4.5)
    axes = figure.add_subplot()
    width = 0.8 / len(ARMS)
    labelled: set[str] = set()
    top = 0.0

    def once(label: str) -> str | None:
        first = label not in labelled
        labelled.add(label)
        return label if first else None

    for group, cache_ram_mib in enumerate(rams):
        for index, (arm, run) in enumerate(runs_for(figures, workload, cache_ram_mib).items()):
            x = group + (index - (len(ARMS) - 1) / 2) * width
            half = width * 0.45
            axes.bar(
                x,
                run["tokens_decoded"],
                width * 0.9,
                color=ARM_COLORS[arm],
                label=once(ARM_LABELS[arm]),
            )
            axes.hlines(
                run["oracle"],
                x - half,
                x + half,
                colors="black",
                linewidth=2.5,
                label=once("oracle (infinite cache)"),
            )
            axes.hlines(
                run["prompt_tokens_sent"],
                x - half,
                x + half,
                colors="dimgray",
                linestyles="dashed",
                label=once("prompt tokens sent"),
            )
            axes.annotate(
                f"{fmt(run['decoded_over_oracle'], '.2f')}x",
                (x, max(run["tokens_decoded"], run["oracle"])),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=9,
            )
            top = max(top, run["prompt_tokens_sent"], run["tokens_decoded"])
    axes.set_xticks(range(len(rams)), [f"--cache-ram {ram} MiB" for ram in rams])
    axes.set_ylim(0, top * 1.3 or 1)  # headroom for the legend
    axes.set_ylabel("prompt tokens decoded")
    axes.set_title(f"{workload}: tokens decoded per arm (label: decoded / oracle)")
    axes.legend(loc="upper left", fontsize=8, ncols=2)
    axes.grid(axis="y", alpha=0.3)
    return save(figure, path)


def draw_ecdf(axes: Axes, values: Sequence[float], label: str, color: str, style: str) -> None:
    if values:
        axes.ecdf(values, label=label, color=color, linestyle=style)


def wide_spread(samples: Sequence[float]) -> bool:
    """Whether a log axis suits: cache hits and misses differ by an order of magnitude."""
    positive = [value for value in samples if value > 0]
    return bool(positive) and max(positive) / min(positive) > 8


def finish_ttft_axes(axes: Axes, log: bool) -> None:
    if log:
        axes.set_xscale("log")
        # Plain numbers at 1-2-5 steps: the default 2x10^1-style minor labels run into each other.
        axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes.xaxis.set_minor_formatter(NullFormatter())
    for level in (0.5, 0.99):
        axes.axhline(level, color="gray", linewidth=0.6, linestyle=":")
    axes.set_xlabel("time to first token, ms")
    axes.set_ylim(0, 1.02)
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize=8)  # an ECDF leaves a corner free; which one depends


def plot_ttft(figures: dict[str, Any], workload: str, path: Path) -> str:
    """Empirical CDFs of TTFT, one panel per cache-ram value (on one shared axis, so the panels
    compare), one line per arm."""
    rams = cache_rams_of(figures)
    runs = {ram: runs_for(figures, workload, ram) for ram in rams}
    log = wide_spread(
        [v for by_arm in runs.values() for r in by_arm.values() for v in ttft_samples(r)]
    )
    figure = new_figure(4.6 * len(rams) + 0.6, 4.0)
    panels = figure.subplots(1, len(rams), sharex=True, sharey=True, squeeze=False)[0]
    for axes, cache_ram_mib in zip(panels, rams, strict=True):
        for arm, run in runs[cache_ram_mib].items():
            label = (
                f"{ARM_LABELS[arm]}: p50 {fmt(run['ttft_p50_ms'], '.0f')},"
                f" p99 {fmt(run['ttft_p99_ms'], '.0f')} ms"
            )
            draw_ecdf(axes, ttft_samples(run), label, ARM_COLORS[arm], "-")
        axes.set_title(f"{workload}, --cache-ram {cache_ram_mib} MiB")
        finish_ttft_axes(axes, log)
    panels[0].set_ylabel("fraction of requests")
    return save(figure, path)


def plot_isolation(audit: dict[str, Any], path: Path) -> str:
    ttft = condition_ttfts(audit)
    figure = new_figure(7.0, 4.3)
    axes = figure.add_subplot()
    for condition in CONDITIONS:
        color, style = CONDITION_STYLES[condition]
        values = ttft[condition]
        label = f"{CONDITION_LABELS[condition]} (n={len(values)})"
        draw_ecdf(axes, values, label, color, style)
    leak = ks(ttft["primed"], ttft["cold"])
    verdict = "" if leak is None else f": KS D = {leak.distance:.3f}, p = {leak.p_value:.3g}"
    axes.set_title(f"W4: tenant B's TTFT, another tenant primed vs nobody{verdict}", fontsize=10)
    axes.set_ylabel("fraction of trials")
    finish_ttft_axes(axes, wide_spread(list(itertools.chain.from_iterable(ttft.values()))))
    return save(figure, path)


def plot_agents(agents: dict[str, Any], path: Path) -> str:
    """W5: per API, tokens decoded (a dashed line marks the prompt tokens) and wall time, one
    bar per arm, each labelled with proxy/direct."""
    apis = list(agents["apis"])
    runs = {(run["api"], run["arm"]): run for run in agents["runs"]}
    figure = new_figure(max(7.0, 3.2 * len(apis) + 1.5), 4.3)
    decoded_axes, wall_axes = figure.subplots(1, 2)
    width = 0.8 / len(ARMS)
    for axes, key, label in (
        (decoded_axes, "tokens_decoded", "prompt tokens decoded"),
        (wall_axes, "wall_s", "wall time, s"),
    ):
        top = 0.0
        for group, api in enumerate(apis):
            for index, arm in enumerate(ARMS):
                run = runs.get((api, arm))
                if run is None:
                    continue
                x = group + (index - (len(ARMS) - 1) / 2) * width
                first = group == 0
                axes.bar(
                    x,
                    run[key],
                    width * 0.9,
                    color=ARM_COLORS[arm],
                    label=ARM_LABELS[arm] if first else None,
                )
                if key == "tokens_decoded":
                    axes.hlines(
                        run["prompt_tokens"],
                        x - width * 0.45,
                        x + width * 0.45,
                        colors="dimgray",
                        linestyles="dashed",
                        label="prompt tokens" if first and index == 0 else None,
                    )
                top = max(top, run[key], run["prompt_tokens"] if key == "tokens_decoded" else 0)
            ratios = agents["proxy_over_direct"].get(api)
            if ratios is not None:
                ratio = ratios["wall_time" if key == "wall_s" else "tokens_decoded"]
                axes.annotate(
                    f"proxy/direct {fmt(ratio, '.2f')}x",
                    (group, 0),
                    xytext=(0, -28),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                )
        axes.set_xticks(range(len(apis)), [f"/v1/{api}" for api in apis])
        axes.set_ylim(0, top * 1.3 or 1)
        axes.set_ylabel(label)
        axes.grid(axis="y", alpha=0.3)
        axes.legend(loc="upper left", fontsize=8)
    figure.suptitle(f"W5: {agents['spec']['agents']} agents on {agents['slots']} slots")
    return save(figure, path)
