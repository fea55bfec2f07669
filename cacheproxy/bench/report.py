"""`cacheproxy bench report`: the workloads of design §8, run and written up with plots.

One command runs the cache benchmark (W1 shared prefix, W2 multi-turn, W3 multi-turn with a
restart; `cache_bench.py`) against llama-server alone and through the proxy, for every
`--cache-ram` value asked for, then the W4 isolation audit (`isolation.py`), and writes to `--out`:

- `report.md`: the figures tables, the reading of them, the machine and the exact commands;
- `W1-decoded.png` ...: tokens decoded per arm and cache-ram setting against the oracle;
- `W1-ttft.png` ...: time-to-first-token distributions (empirical CDFs) per arm;
- `W4-ttft.png`: tenant B's TTFT after another tenant primed the prefix, after nobody did, and
  after B primed it itself (the control);
- `figures.json`: every figure the report was drawn from (`render_report` redraws it).

Running and rendering are separate: `run_benchmarks` returns the figures as a JSON-like dict (the
shape of `cache_bench.report_as_json`, plus an `isolation` entry from `isolation_as_json`), and
`render_report(figures, out_dir)` draws and writes from that dict alone, with no server.

`cacheproxy bench report --out DIR [--workload W1 W2 W3 W4] [--cache-ram 0 8192]
[--size small|large] [--trials N]`

`--scale F` (not in `--help`: it is for tests and quick looks) multiplies every size of the W1-W3
specs by F (groups, prompts per group, users per tenant, turns, every token count; at least 1,
turns at least 2), so `--scale 0.1` runs the same workloads, tiny. W4's size is `--trials`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

try:
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
except ModuleNotFoundError as exc:  # a dev dependency: say so before any benchmark starts
    raise ModuleNotFoundError(
        "`cacheproxy bench report` draws its plots with matplotlib: pip install -e '.[dev]'"
    ) from exc

from cacheproxy.bench import cache_bench, isolation
from cacheproxy.bench.cache_bench import (
    ARMS,
    FIGURE_COLUMNS,
    CacheBenchConfig,
    ServerOptions,
    command_template,
    describe_workload,
    disk_line,
    report_as_json,
)
from cacheproxy.bench.overhead import ProcessSet, progress, run_with_processes, table_row
from cacheproxy.bench.workloads import MultiTurnSpec, SharedPrefixSpec, TokenRange
from cacheproxy.provision.make_model import ensure_model

CACHE_WORKLOADS = cache_bench.WORKLOADS  # W1, W2, W3
WORKLOADS = (*CACHE_WORKLOADS, "W4")
DEFAULT_TRIALS = 200
# The W4 control gets trials // 4 trials; below 12 it cannot reach p < 0.01 even when every
# self-primed trial is faster than every cold one, so the audit could never show it works.
MIN_TRIALS = 12
CONDITIONS = ("primed", "cold", "self-primed")

ARM_LABELS = {"direct": "llama-server alone", "proxy": "through cacheproxy"}
ARM_PHRASES = {"direct": "for llama-server alone", "proxy": "through the proxy"}
ARM_COLORS = {"direct": "tab:blue", "proxy": "tab:orange"}
CONDITION_LABELS = {
    "primed": "another tenant primed the prefix",
    "cold": "nobody primed it",
    "self-primed": "B primed it itself (control)",
}
CONDITION_STYLES = {"primed": ("tab:red", "-"), "cold": ("tab:blue", "-"),
                    "self-primed": ("tab:green", "--")}  # fmt: skip
# Below this, a proxy/direct ratio reads as "the same".
SAME_WITHIN = 0.005
DPI = 110

# --- options ----------------------------------------------------------------------------------

SpecT = TypeVar("SpecT", SharedPrefixSpec, MultiTurnSpec)

# The fields `--scale` multiplies, with the least value each may take (W3 needs two turns to put
# a restart between). Tenants are not a size: they are what the workload is about.
SHARED_PREFIX_SIZES = {"groups": 1, "prompts_per_group": 1, "prefix_tokens": 1,
                       "question_tokens": 1, "n_predict": 1}  # fmt: skip
MULTI_TURN_SIZES = {"users_per_tenant": 1, "turns": 2, "tenant_prefix_tokens": 1,
                    "history_tokens": 1, "question_tokens": 1, "n_predict": 1}  # fmt: skip


def scaled(spec: SpecT, scale: float, sizes: dict[str, int]) -> SpecT:
    return replace(
        spec,
        **{name: max(least, round(getattr(spec, name) * scale)) for name, least in sizes.items()},
    )


@dataclass(frozen=True)
class ReportOptions:
    out_dir: Path
    workloads: tuple[str, ...] = WORKLOADS
    cache_ram_mib: tuple[int, ...] = cache_bench.DEFAULT_CACHE_RAM_MIB
    model_size: str = "small"
    trials: int = DEFAULT_TRIALS
    seed: int = 1
    server_args: tuple[str, ...] = cache_bench.DEFAULT_SERVER_ARGS
    scale: float = 1.0

    def __post_init__(self) -> None:
        unknown = set(self.workloads) - set(WORKLOADS)
        if unknown or not self.workloads:
            raise ValueError(f"workloads must be some of {', '.join(WORKLOADS)}, not {unknown}")
        if "W4" in self.workloads and self.trials < MIN_TRIALS:
            raise ValueError(f"W4 needs --trials {MIN_TRIALS} or more, not {self.trials}")
        if not self.scale > 0:
            raise ValueError(f"--scale must be positive, not {self.scale}")

    @property
    def cache_workloads(self) -> tuple[str, ...]:
        return tuple(workload for workload in self.workloads if workload in CACHE_WORKLOADS)

    def cache_config(self) -> CacheBenchConfig | None:
        """The cache benchmark's configuration, or None when only W4 is asked for."""
        if not self.cache_workloads:
            return None
        return CacheBenchConfig(
            workloads=self.cache_workloads,
            cache_ram_mib=self.cache_ram_mib,
            model_size=self.model_size,
            seed=self.seed,
            server=ServerOptions(extra_args=self.server_args),
            shared_prefix=scaled(SharedPrefixSpec(), self.scale, SHARED_PREFIX_SIZES),
            multi_turn=scaled(MultiTurnSpec(), self.scale, MULTI_TURN_SIZES),
        )


# --- running ----------------------------------------------------------------------------------


def invoked_as() -> str:
    """The command as one would type it again (`python -m cacheproxy` leaves __main__.py in
    argv[0], which nobody types)."""
    program = Path(sys.argv[0]).name
    if program == "__main__.py":
        program = "python -m cacheproxy"
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])


def machine_figures(command: str, load_average: Sequence[float]) -> dict[str, Any]:
    """The top of `report_as_json`'s shape, for a run with no cache workload."""
    return {
        "command": command,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(load_average),
        "platform": platform.platform(),
        "model": None,
        "config": None,
        "runs": [],
        "proxy_over_direct": {},
    }


def isolation_as_json(
    results: dict[str, list[isolation.Trial]],
    *,
    trials: int,
    seed: int,
    model: str,
    llama_server_command: str,
    proxy_command: str,
) -> dict[str, Any]:
    return {
        "trials_per_condition": trials,
        "seed": seed,
        "prefix_tokens": isolation.PREFIX_TOKENS,
        "question_tokens": isolation.QUESTION_TOKENS,
        "significance": isolation.SIGNIFICANCE,
        "model": model,
        "llama_server_command": llama_server_command,
        "proxy_command": proxy_command,
        "trials": {
            condition: [{"ttft_ms": trial.ttft_ms, "cache_n": trial.cache_n} for trial in found]
            for condition, found in results.items()
        },
    }


def process_command(processes: ProcessSet, name: str) -> str:
    return shlex.join(str(arg) for arg in processes.find(name).process.args)


async def run_benchmarks(
    options: ReportOptions, processes: ProcessSet, command: str
) -> dict[str, Any]:
    """Every workload asked for, one after the other (never two at once: they share the CPUs)."""
    load_average = os.getloadavg()  # before our own processes start
    config = options.cache_config()
    parts = int(config is not None) + int("W4" in options.workloads)
    if config is None:
        figures = machine_figures(command, load_average)
    else:
        arm_runs = len(config.workloads) * len(config.cache_ram_mib) * len(config.arms)
        progress(
            f"part 1/{parts}: {' '.join(config.workloads)} at cache-ram"
            f" {' '.join(map(str, config.cache_ram_mib))} MiB, direct and proxy"
            f" ({arm_runs} runs, each on a fresh llama-server)"
        )
        figures = report_as_json(await cache_bench.benchmark(config, processes, command))
    if "W4" in options.workloads:
        total = 2 * options.trials + options.trials // 4
        progress(
            f"part {parts}/{parts}: W4 isolation audit, {options.trials} trials per condition"
            f" ({total} with the control, progress every 50)"
        )
        results = await isolation.audit(processes, options.trials, options.seed)
        figures["isolation"] = isolation_as_json(
            results,
            trials=options.trials,
            seed=options.seed,
            model=ensure_model("small").name,  # the audit always runs the small model
            # The audit names its two processes so; their commands are the record of its flags.
            llama_server_command=process_command(processes, "llama-server"),
            proxy_command=process_command(processes, "proxy"),
        )
    return figures


def run_report(options: ReportOptions) -> int:
    """Run, then write the report into `options.out_dir`; return an exit code."""
    options.out_dir.mkdir(parents=True, exist_ok=True)  # fail now, not after the run
    command = invoked_as()
    code, figures = run_with_processes(
        "cacheproxy-report-", lambda processes: run_benchmarks(options, processes, command)
    )
    if figures is None:
        return code
    progress("drawing the plots")
    path = render_report(figures, options.out_dir)
    progress(f"report written to {path}")
    print(path)
    return 0


def run_from_options(
    *,
    out_dir: Path,
    workloads: Sequence[str],
    cache_ram_mib: Sequence[int],
    size: str,
    trials: int,
    seed: int,
    server_args: str,
    scale: float,
) -> int:
    """The CLI's entry: options in, exit code out (2 for options that cannot run)."""
    try:
        options = ReportOptions(
            out_dir=out_dir,
            workloads=tuple(dict.fromkeys(workloads)),
            cache_ram_mib=tuple(dict.fromkeys(cache_ram_mib)),
            model_size=size,
            trials=trials,
            seed=seed,
            server_args=tuple(shlex.split(server_args)),
            scale=scale,
        )
        options.cache_config()  # checks that the workloads fit the slots
    except ValueError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    return run_report(options)


# --- reading the figures ----------------------------------------------------------------------

Run = dict[str, Any]


def config_from_json(config: dict[str, Any]) -> CacheBenchConfig:
    """The cache benchmark's configuration back from `asdict`, to describe the workloads with
    the benchmark's own words."""

    def spec(kind: type[SpecT], fields: dict[str, Any]) -> SpecT:
        return kind(**{**fields, "tokens": TokenRange(**fields["tokens"])})

    server = config["server"]
    return CacheBenchConfig(
        workloads=tuple(config["workloads"]),
        cache_ram_mib=tuple(config["cache_ram_mib"]),
        arms=tuple(config["arms"]),
        model_size=config["model_size"],
        seed=config["seed"],
        in_flight=config["in_flight"],
        server=ServerOptions(server["parallel"], server["ctx_size"], tuple(server["extra_args"])),
        shared_prefix=spec(SharedPrefixSpec, config["shared_prefix"]),
        multi_turn=spec(MultiTurnSpec, config["multi_turn"]),
    )


def ordered(values: Iterator[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def cache_workloads_of(figures: dict[str, Any]) -> list[str]:
    if figures.get("config"):
        return list(figures["config"]["workloads"])
    return ordered(run["workload"] for run in figures.get("runs", ()))


def cache_rams_of(figures: dict[str, Any]) -> list[int]:
    if figures.get("config"):
        return list(figures["config"]["cache_ram_mib"])
    return ordered(run["cache_ram_mib"] for run in figures.get("runs", ()))


def runs_for(figures: dict[str, Any], workload: str, cache_ram_mib: int) -> dict[str, Run]:
    """The runs of one workload at one cache-ram value, by arm, in `ARMS` order."""
    found = {
        run["arm"]: run
        for run in figures.get("runs", ())
        if run["workload"] == workload and run["cache_ram_mib"] == cache_ram_mib
    }
    return {arm: found[arm] for arm in ARMS if arm in found}


def ttft_samples(run: Run) -> list[float]:
    return [detail["ttft_ms"] for detail in run["requests_detail"]]


def percentile(values: Sequence[float], quantile: int) -> float:
    """Percentile `quantile` (1..99), inclusive method, as the cache benchmark computes it."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[quantile - 1]


def ratio(top: float, bottom: float) -> float:
    return top / bottom if bottom else math.nan


@dataclass(frozen=True)
class Comparison:
    """Proxy against direct, for one workload at one cache-ram value."""

    workload: str
    cache_ram_mib: int
    direct: Run
    proxy: Run

    @property
    def decoded(self) -> float:
        return ratio(self.proxy["tokens_decoded"], self.direct["tokens_decoded"])

    @property
    def wall(self) -> float:
        return ratio(self.proxy["wall_s"], self.direct["wall_s"])

    def ttft(self, quantile: int) -> float:
        key = f"ttft_p{quantile}_ms"
        return ratio(self.proxy[key], self.direct[key])


def comparisons(figures: dict[str, Any]) -> list[Comparison]:
    found = []
    for workload, cache_ram_mib in itertools.product(
        cache_workloads_of(figures), cache_rams_of(figures)
    ):
        runs = runs_for(figures, workload, cache_ram_mib)
        if "direct" in runs and "proxy" in runs:
            found.append(Comparison(workload, cache_ram_mib, runs["direct"], runs["proxy"]))
    return found


@dataclass(frozen=True)
class KsResult:
    distance: float
    p_value: float


def ks(first: Sequence[float], second: Sequence[float]) -> KsResult | None:
    if not first or not second:
        return None
    return KsResult(*isolation.ks_two_sample(list(first), list(second)))


def condition_ttfts(audit: dict[str, Any]) -> dict[str, list[float]]:
    return {
        condition: [trial["ttft_ms"] for trial in audit["trials"].get(condition, ())]
        for condition in CONDITIONS
    }


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


# --- the plain reading --------------------------------------------------------------------------


def comparison_sentence(comparison: Comparison) -> str:
    direct, proxy = comparison.direct, comparison.proxy
    decoded = comparison.decoded
    if math.isnan(decoded):
        verdict = "llama-server alone decoded no prompt token, so there is no ratio"
    elif abs(decoded - 1) < SAME_WITHIN:
        verdict = f"the proxy decoded as many tokens as llama-server alone ({decoded:.2f}x)"
    else:
        fewer = "fewer" if decoded < 1 else "more"
        verdict = (
            f"the proxy decoded {decoded:.2f}x the tokens of llama-server alone ({fewer}:"
            f" {proxy['tokens_decoded']} vs {direct['tokens_decoded']})"
        )
    over_oracle = (
        f"{fmt(proxy['decoded_over_oracle'], '.2f')}x the oracle through the proxy,"
        f" {fmt(direct['decoded_over_oracle'], '.2f')}x alone"
    )
    return (
        f"{comparison.workload} at cache-ram {comparison.cache_ram_mib}: {verdict};"
        f" {over_oracle}. Proxy/direct TTFT p50 {fmt(comparison.ttft(50), '.2f')}x,"
        f" p99 {fmt(comparison.ttft(99), '.2f')}x, wall time {fmt(comparison.wall, '.2f')}x."
    )


def tally_sentence(found: Sequence[Comparison]) -> str | None:
    if len(found) < 2:
        return None
    fewer = sum(c.decoded < 1 - SAME_WITHIN for c in found)
    more = sum(c.decoded > 1 + SAME_WITHIN for c in found)
    same = len(found) - fewer - more
    best = min(found, key=lambda c: c.decoded if not math.isnan(c.decoded) else math.inf)
    return (
        f"Over the {len(found)} workload and cache-ram pairs, the proxy decoded fewer prompt"
        f" tokens than llama-server alone in {fewer}, more in {more}, as many in {same}; its"
        f" lowest ratio was {fmt(best.decoded, '.2f')}x ({best.workload} at cache-ram"
        f" {best.cache_ram_mib})."
    )


def cache_ram_sentences(figures: dict[str, Any]) -> Iterator[str]:
    """What raising llama-server's --cache-ram did to each arm, lowest value against highest."""
    rams = cache_rams_of(figures)
    if len(rams) < 2:
        return
    low, high = min(rams), max(rams)
    key = "tokens_decoded"
    for workload in cache_workloads_of(figures):
        before, after = runs_for(figures, workload, low), runs_for(figures, workload, high)
        changes = [
            f"by {fmt(ratio(after[arm][key], before[arm][key]), '.2f')} {ARM_PHRASES[arm]}"
            for arm in ARMS
            if arm in before and arm in after
        ]
        if changes:
            yield (
                f"{workload}: raising --cache-ram from {low} to {high} MiB multiplied the tokens"
                f" decoded {' and '.join(changes)}."
            )


def isolation_sentences(audit: dict[str, Any]) -> Iterator[str]:
    ttft = condition_ttfts(audit)
    significance = audit["significance"]
    leak, control = ks(ttft["primed"], ttft["cold"]), ks(ttft["self-primed"], ttft["cold"])
    if leak is None:
        return
    if leak.p_value > significance:
        verdict = (
            f"they cannot be told apart (p > {significance}): no sign that a tenant can time"
            " another's cache"
        )
    else:
        verdict = f"they DIFFER (p <= {significance}): a tenant can tell another primed the prefix"
    yield (
        f"W4: tenant B's first-token latency after another tenant primed the prefix vs"
        f" after nobody did: KS D = {leak.distance:.3f}, p = {leak.p_value:.3g}; {verdict}."
    )
    if control is None:
        return
    if control.p_value <= significance:
        power = "so the test does see a real cache hit"
    else:
        power = "so this run could not even see a real cache hit: too few trials to conclude"
    yield (
        f"Control, B primed the prefix itself: KS D = {control.distance:.3f},"
        f" p = {control.p_value:.3g}, {power}."
    )


def reading(figures: dict[str, Any]) -> list[str]:
    """The results in plain sentences, every number computed from `figures`."""
    found = comparisons(figures)
    sentences = [comparison_sentence(comparison) for comparison in found]
    tally = tally_sentence(found)
    if tally is not None:
        sentences.append(tally)
    sentences += cache_ram_sentences(figures)
    if figures.get("isolation"):
        sentences += isolation_sentences(figures["isolation"])
    return sentences


# --- plots --------------------------------------------------------------------------------------


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
            axes.bar(x, run["tokens_decoded"], width * 0.9, color=ARM_COLORS[arm],
                     label=once(ARM_LABELS[arm]))  # fmt: skip
            axes.hlines(run["oracle"], x - half, x + half, colors="black", linewidth=2.5,
                        label=once("oracle (infinite cache)"))  # fmt: skip
            axes.hlines(run["prompt_tokens_sent"], x - half, x + half, colors="dimgray",
                        linestyles="dashed", label=once("prompt tokens sent"))  # fmt: skip
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


# --- Markdown -------------------------------------------------------------------------------------


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
        if run.get("unaccounted_requests"):
            yield (
                f"- note: {where}: {run['unaccounted_requests']} requests with"
                " cache_n + prompt_n != prompt length"
            )


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
    yield table_row(["B's first token after", "trials", "p50 ms", "p90 ms", "p99 ms",
                     "mean ms", "B's cache_n (max)"])  # fmt: skip
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
    for name, first in (("another tenant primed vs nobody", "primed"),
                        ("control: B primed itself vs nobody", "self-primed")):  # fmt: skip
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
            " `cacheproxy serve --upstream` in front of it"
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
    for workload in cache_workloads_of(figures):
        lines += workload_section(figures, workload, out_dir)
    if figures.get("isolation"):
        lines += isolation_section(figures["isolation"], out_dir)
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
