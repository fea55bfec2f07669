"""`cacheproxy bench report`: the workloads of design §8, run and written up with plots.

One command runs the cache benchmark (W1 shared prefix, W2 multi-turn, W3 multi-turn with a
restart; `cache_bench.py`) against llama-server alone and through the proxy, for every
`--cache-ram` value asked for, then the W4 isolation audit (`isolation.py`), then W5, coding
agents over the Anthropic and Responses APIs (`agents_bench.py`: llama-server alone with its
default RAM cache against the proxy in front of `--cache-ram 0`), and writes to `--out`:

- `report.md`: the figures tables, the reading of them, the machine and the exact commands;
- `W1-decoded.png` ...: tokens decoded per arm and cache-ram setting against the oracle;
- `W1-ttft.png` ...: time-to-first-token distributions (empirical CDFs) per arm;
- `W4-ttft.png`: tenant B's TTFT after another tenant primed the prefix, after nobody did, and
  after B primed it itself (the control);
- `W5.png`: tokens decoded and wall time per API and arm;
- `figures.json`: every figure the report was drawn from (`render_report` redraws it).

Running and rendering are separate: `run_benchmarks` returns the figures as a JSON-like dict (the
shape of `cache_report.report_as_json`, plus an `isolation` entry from `isolation_as_json`), and
`render_report(figures, out_dir)` draws and writes from that dict alone, with no server. W5's
figures are its `agents` entry (`agents_bench.agents_as_json`).

`cacheproxy bench report --out DIR [--workload W1 W2 W3 W4 W5] [--cache-ram 0 8192]
[--size small|large] [--trials N]`

`--token-scale F` multiplies only the token counts of W1-W3 (prefixes, histories, questions,
answers) and keeps their shapes (groups, prompts, tenants, users, turns, the restart): for a model
too slow to prefill the full sizes in reasonable time (the kv-heavy model on a shared CPU), the
same workloads with shorter texts. The report's command line says it was used.

`--repeat N` runs every W1-W3 row N times, its arms alternated, and adds the wall-time ratio's
median and range over the N pairs (`report_repeats.py`): one pair moves with the machine's load.

`--scale F` (not in `--help`: it is for tests and quick looks) multiplies every size of the W1-W3
specs by F (groups, prompts per group, users per tenant, turns, every token count; at least 1,
turns at least 2), so `--scale 0.1` runs the same workloads, tiny; W5's agent spec likewise
(`AgentSpec.scaled`), on fewer slots than agents. W4's size is `--trials`.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheproxy.bench import agents_bench, cache_bench, cache_config, isolation
from cacheproxy.bench.agents_trace import AgentSpec
from cacheproxy.bench.cache_config import CacheBenchConfig, ServerOptions
from cacheproxy.bench.cache_report import (
    report_as_json,
)
from cacheproxy.bench.harness import ProcessSet, invoked_command, progress, run_with_processes
from cacheproxy.bench.report_render import render_report
from cacheproxy.bench.workload_scale import (
    MULTI_TURN_SIZES,
    MULTI_TURN_TOKENS,
    SHARED_PREFIX_SIZES,
    SHARED_PREFIX_TOKENS,
    scaled,
)
from cacheproxy.bench.workloads import MultiTurnSpec, SharedPrefixSpec
from cacheproxy.provision.make_model import ensure_model

CACHE_WORKLOADS = cache_config.WORKLOADS  # W1, W2, W3
WORKLOADS = (*CACHE_WORKLOADS, "W4", "W5")
DEFAULT_TRIALS = 200
# The W4 control gets trials // 4 trials; below 12 it cannot reach p < 0.01 even when every
# self-primed trial is faster than every cold one, so the audit could never show it works.
MIN_TRIALS = 12


# --- options ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportOptions:
    out_dir: Path
    workloads: tuple[str, ...] = WORKLOADS
    cache_ram_mib: tuple[int, ...] = cache_config.DEFAULT_CACHE_RAM_MIB
    model_size: str = "small"
    trials: int = DEFAULT_TRIALS
    seed: int = 1
    server_args: tuple[str, ...] = cache_config.DEFAULT_SERVER_ARGS
    scale: float = 1.0
    token_scale: float = 1.0
    repeat: int = 1  # W1-W3: every row this many times, arms alternated (report_repeats.py)
    disk_blocks: bool = True  # the proxy's `disk.blocks`: archives cut into blocks

    def __post_init__(self) -> None:
        unknown = set(self.workloads) - set(WORKLOADS)
        if unknown or not self.workloads:
            raise ValueError(f"workloads must be some of {', '.join(WORKLOADS)}, not {unknown}")
        if "W4" in self.workloads and self.trials < MIN_TRIALS:
            raise ValueError(f"W4 needs --trials {MIN_TRIALS} or more, not {self.trials}")
        if not self.scale > 0:
            raise ValueError(f"--scale must be positive, not {self.scale}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be at least 1, not {self.repeat}")
        if not self.token_scale > 0:
            raise ValueError(f"--token-scale must be positive, not {self.token_scale}")

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
            repeat=self.repeat,
            disk_blocks=self.disk_blocks,
            server=ServerOptions(extra_args=self.server_args),
            shared_prefix=scaled(
                scaled(SharedPrefixSpec(), self.scale, SHARED_PREFIX_SIZES),
                self.token_scale,
                SHARED_PREFIX_TOKENS,
            ),
            multi_turn=scaled(
                scaled(MultiTurnSpec(), self.scale, MULTI_TURN_SIZES),
                self.token_scale,
                MULTI_TURN_TOKENS,
            ),
        )

    def agents_config(self) -> agents_bench.AgentsBenchConfig | None:
        """W5's configuration, or None when it is not asked for."""
        if "W5" not in self.workloads:
            return None
        spec = AgentSpec() if self.scale == 1.0 else AgentSpec().scaled(self.scale)
        return agents_bench.AgentsBenchConfig(
            spec=spec,
            model_size=self.model_size,
            seed=self.seed,
            slots=min(agents_bench.DEFAULT_SLOTS, spec.agents - 1),  # more agents than slots
            server_args=self.server_args,
            disk_blocks=self.disk_blocks,
        )


# --- running ----------------------------------------------------------------------------------


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
    agents_config = options.agents_config()
    parts = [config is not None, "W4" in options.workloads, agents_config is not None].count(True)
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
    part = int(config is not None)
    if "W4" in options.workloads:
        part += 1
        total = 2 * options.trials + options.trials // 4
        progress(
            f"part {part}/{parts}: W4 isolation audit, {options.trials} trials per condition"
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
    if agents_config is not None:
        part += 1
        progress(
            f"part {part}/{parts}: W5 agents, {agents_config.spec.agents} agents on"
            f" {agents_config.slots} slots, /v1/messages and /v1/responses, direct and proxy"
        )
        runs = await agents_bench.benchmark(agents_config, processes)
        model = ensure_model(agents_config.model_size).name
        figures["agents"] = agents_bench.agents_as_json(agents_config, runs, model)
    return figures


def run_report(options: ReportOptions) -> int:
    """Run, then write the report into `options.out_dir`; return an exit code."""
    options.out_dir.mkdir(parents=True, exist_ok=True)  # fail now, not after the run
    command = invoked_command()
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
    token_scale: float = 1.0,
    repeat: int = 1,
    disk_blocks: bool = True,
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
            token_scale=token_scale,
            repeat=repeat,
            disk_blocks=disk_blocks,
        )
        options.cache_config()  # checks that the workloads fit the slots
        options.agents_config()
    except ValueError as exc:
        print(f"cannot run: {exc}", file=sys.stderr)
        return 2
    return run_report(options)
