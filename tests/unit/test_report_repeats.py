"""`bench report --repeat N`: every row's arms alternated, its wall ratio as median and range."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheproxy.bench.cache_client import ArmRun, Completion
from cacheproxy.bench.report import ReportOptions
from cacheproxy.bench.report_repeats import repeats_as_json, repeats_section
from cacheproxy.bench.workloads import Request


def arm_run(arm: str, repetition: int, order: int, wall_s: float, decoded: int) -> ArmRun:
    # one request of 10 prompt tokens: the oracle decodes all 10 of them
    request = Request(list(range(10)), 2, "tenant-0", "c")
    completion = Completion(request, 0, [1, 2], decoded, 10 - decoded, 0.1, 0.2)
    return ArmRun(
        workload="W2",
        cache_ram_mib=8192,
        arm=arm,
        completions=(completion,),
        wall_s=wall_s,
        restarts=0,
        llama_server_command="llama-server",
        proxy_command=None,
        server_cache_ram_mib=8192,
        repetition=repetition,
        order=order,
        load_average=(1.0 + order, 0.0, 0.0),
    )


def test_each_pair_gives_a_ratio_and_the_row_its_median_and_range() -> None:
    runs = [
        arm_run("direct", 0, 0, 10.0, 10),
        arm_run("proxy", 0, 1, 9.0, 10),
        arm_run("proxy", 1, 2, 12.0, 11),  # the other arm first this time
        arm_run("direct", 1, 3, 10.0, 10),
        arm_run("direct", 2, 4, 10.0, 10),
        arm_run("proxy", 2, 5, 9.5, 10),
    ]
    (row,) = repeats_as_json(runs)
    assert [pair["first_arm"] for pair in row["pairs"]] == ["direct", "proxy", "direct"]
    assert [round(pair["wall_ratio"], 2) for pair in row["pairs"]] == [0.9, 1.2, 0.95]
    assert row["wall_ratio_median"] == pytest.approx(0.95)
    assert (row["wall_ratio_min"], row["wall_ratio_max"]) == pytest.approx((0.9, 1.2))
    assert row["proxy_decoded_over_oracle_max"] == pytest.approx(1.1)
    assert row["pairs"][1]["proxy_load_1m"] == 3.0
    table = "\n".join(repeats_section([row]))
    assert "| W2 | 8192 | 3 | 0.950 | 0.900 | 1.200 | 0.90 1.20 0.95 | 1.100 | 1.0-6.0 |" in table


def test_one_repetition_adds_no_section() -> None:
    (row,) = repeats_as_json([arm_run("direct", 0, 0, 10.0, 10), arm_run("proxy", 0, 1, 9, 10)])
    assert list(repeats_section([row])) == []


def test_repeat_reaches_the_benchmark_and_must_be_positive(tmp_path: Path) -> None:
    config = ReportOptions(out_dir=tmp_path, workloads=("W1",), repeat=3).cache_config()
    assert config is not None and config.repeat == 3
    with pytest.raises(ValueError, match="repeat"):
        ReportOptions(out_dir=tmp_path, repeat=0)
