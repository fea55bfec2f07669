"""`--repeat N`: every W1-W3 row run N times, the arms alternated, its wall-time ratio given as
the median and range of the N proxy/direct pairs.

One pair of runs on a shared machine moves with whatever else runs: the proxy/direct wall ratio
of one row read 0.68-1.15 between runs under load. Each repetition runs the row's arms back to
back, the first arm alternating between repetitions, so a load that comes and goes falls on
either arm alike; the median of the pairs is the figure, the range says how far one pair can be
trusted. Each run's 1-minute load average at its start is kept beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from typing import Any

from cacheproxy.bench.cache_client import ArmRun
from cacheproxy.bench.harness import table_row


def repeats_as_json(runs: Sequence[ArmRun]) -> list[dict[str, Any]]:
    """Per (workload, cache-ram) row with both arms: every repetition's pair and the wall
    ratio's median and range; the rows in the order they first ran."""
    rows: dict[tuple[str, int], dict[int, dict[str, ArmRun]]] = {}
    for run in runs:
        rows.setdefault((run.workload, run.cache_ram_mib), {}).setdefault(run.repetition, {})[
            run.arm
        ] = run
    found = []
    for (workload, cache_ram_mib), repetitions in rows.items():
        pairs = []
        for repetition, arms in sorted(repetitions.items()):
            direct, proxy = arms.get("direct"), arms.get("proxy")
            if direct is None or proxy is None:
                continue
            pairs.append(
                {
                    "repetition": repetition,
                    "first_arm": min(arms.values(), key=lambda run: run.order).arm,
                    "direct_wall_s": direct.wall_s,
                    "proxy_wall_s": proxy.wall_s,
                    "wall_ratio": proxy.wall_s / direct.wall_s,
                    "direct_decoded_over_oracle": direct.decoded / direct.oracle,
                    "proxy_decoded_over_oracle": proxy.decoded / proxy.oracle,
                    "direct_load_1m": direct.load_average[0] if direct.load_average else None,
                    "proxy_load_1m": proxy.load_average[0] if proxy.load_average else None,
                }
            )
        if not pairs:
            continue
        ratios = [pair["wall_ratio"] for pair in pairs]
        found.append(
            {
                "workload": workload,
                "cache_ram_mib": cache_ram_mib,
                "pairs": pairs,
                "wall_ratio_median": statistics.median(ratios),
                "wall_ratio_min": min(ratios),
                "wall_ratio_max": max(ratios),
                "proxy_decoded_over_oracle_max": max(
                    pair["proxy_decoded_over_oracle"] for pair in pairs
                ),
            }
        )
    return found


def repeats_section(repeats: Sequence[dict[str, Any]]) -> Iterator[str]:
    """The Markdown table of `repeats_as_json`'s rows."""
    if not repeats or max(len(row["pairs"]) for row in repeats) < 2:
        return
    yield "## Wall time over repetitions (arms alternated)"
    yield ""
    columns = [
        "workload",
        "cache-ram MiB",
        "pairs",
        "proxy/direct wall median",
        "min",
        "max",
        "each pair",
        "proxy decoded/oracle max",
        "load 1m at runs' start",
    ]
    yield table_row(columns)
    yield table_row(["---", "---:", "---:", "---:", "---:", "---:", "---", "---:", "---"])
    for row in repeats:
        pairs = row["pairs"]
        loads = [
            load
            for pair in pairs
            for load in (pair["direct_load_1m"], pair["proxy_load_1m"])
            if load is not None
        ]
        yield table_row(
            [
                row["workload"],
                str(row["cache_ram_mib"]),
                str(len(pairs)),
                f"{row['wall_ratio_median']:.3f}",
                f"{row['wall_ratio_min']:.3f}",
                f"{row['wall_ratio_max']:.3f}",
                " ".join(f"{pair['wall_ratio']:.2f}" for pair in pairs),
                f"{row['proxy_decoded_over_oracle_max']:.3f}",
                f"{min(loads):.1f}-{max(loads):.1f}" if loads else "",
            ]
        )
    yield ""
