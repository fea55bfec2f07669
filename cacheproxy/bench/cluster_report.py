"""What `cacheproxy bench cluster` reports: per arm, the run against the oracle; for the kill,
the requests lost, the takeover time, and the requests sent after the kill (and after the
takeover) against their share of the oracle, apart from the rest of the run."""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from cacheproxy.bench.cache_client import ArmRun
from cacheproxy.bench.harness import table_row
from cacheproxy.bench.workloads import oracle


@dataclass
class KillFigures:
    lost_in_flight: int = 0  # cut by the kill (sent before it)
    lost_after: int = 0  # failed although sent after the kill: must be none
    refused: int = 0  # connections the dead proxy refused, sent to the other at once
    takeover_s: float | None = None  # kill -> the survivor holds the dead one's upstream
    killed_at_request: int = 0
    # the requests (issue indices) first sent after the kill, and after the takeover
    after_kill: set[int] = field(default_factory=set)
    after_takeover: set[int] = field(default_factory=set)


@dataclass
class ClusterRun:
    arm: str
    run: ArmRun
    kill: KillFigures | None
    leases_at_start: dict[str, str]


@dataclass(frozen=True)
class RunPart:
    """Some of a run's requests: how many, the tokens they decoded, their part of the oracle."""

    requests: int
    decoded: int
    oracle: int

    @property
    def ratio(self) -> float:
        return self.decoded / self.oracle if self.oracle else float("nan")


def share_of(run: ArmRun, issued: Collection[int]) -> RunPart:
    """The requests of `run` whose issue index is in `issued`, against the oracle of the whole
    trace (what an infinite cache would still decode of each, given everything before it)."""
    completions = run.in_issue_order
    owed = oracle(completion.exchange for completion in completions)
    chosen = [(c, o) for c, o in zip(completions, owed, strict=True) if c.issue_index in issued]
    return RunPart(len(chosen), sum(c.prompt_n for c, _ in chosen), sum(o for _, o in chosen))


def render(runs: list[ClusterRun], command: str) -> str:
    lines = [
        f"`{command}` (load average before: {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)",
        "",
        table_row(
            ["arm", "answered", "decoded", "oracle", "decoded/oracle", "wall s", "TTFT p50 ms"]
        ),
        table_row(["---"] * 7),
    ]
    for item in runs:
        run = item.run
        lines.append(
            table_row(
                [
                    item.arm,
                    str(len(run.completions)),
                    str(run.decoded),
                    str(run.oracle),
                    f"{run.decoded / run.oracle:.3f}",
                    f"{run.wall_s:.1f}",
                    f"{run.ttft_ms(50):.0f}",
                ]
            )
        )
    for item in runs:
        if item.kill is not None:
            lines += ["", *kill_lines(item.run, item.kill)]
    return "\n".join(lines)


def kill_lines(run: ArmRun, kill: KillFigures) -> list[str]:
    if kill.takeover_s is None:
        return ["kill: no takeover seen"]
    lines = [
        f"kill: proxy killed after {kill.killed_at_request} answers; requests lost in"
        f" flight {kill.lost_in_flight}, lost after the kill {kill.lost_after},"
        f" refused connections sent to the survivor {kill.refused}; upstream taken over"
        f" after {kill.takeover_s:.2f} s"
    ]
    for label, issued in (
        ("after the kill", kill.after_kill),
        ("after the takeover", kill.after_takeover),
    ):
        share = share_of(run, issued)
        if share.requests:
            lines.append(
                f"{label}: {share.requests} requests decoded {share.decoded} tokens, oracle"
                f" {share.oracle}: {share.ratio:.3f}x"
            )
    return lines


def as_json(runs: list[ClusterRun], command: str) -> dict[str, Any]:
    return {
        "command": command,
        "arms": [
            {
                "arm": item.arm,
                "answered": len(item.run.completions),
                "decoded": item.run.decoded,
                "oracle": item.run.oracle,
                "decoded_over_oracle": item.run.decoded / item.run.oracle,
                "wall_s": item.run.wall_s,
                "ttft_p50_ms": item.run.ttft_ms(50),
                "leases_at_start": item.leases_at_start,
                "kill": None if item.kill is None else kill_json(item.run, item.kill),
            }
            for item in runs
        ],
    }


def kill_json(run: ArmRun, kill: KillFigures) -> dict[str, Any]:
    figures: dict[str, Any] = {
        name: value for name, value in vars(kill).items() if not isinstance(value, set)
    }
    for name in ("after_kill", "after_takeover"):
        share = share_of(run, getattr(kill, name))
        figures[name] = {
            "requests": share.requests,
            "decoded": share.decoded,
            "oracle": share.oracle,
            "decoded_over_oracle": share.ratio if share.oracle else None,
        }
    return figures
