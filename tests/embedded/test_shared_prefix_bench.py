"""`cacheproxy bench embedded` with the shared-prefix arm, on a tiny scale."""

from __future__ import annotations

from pathlib import Path

from cacheproxy.bench.embedded_bench import (
    POLICIES,
    BenchOptions,
    format_table,
    lookup_micros,
    run_arm_alone,
)


def test_the_shared_arm_runs_alone_and_decodes_no_more_than_a_copying_one(
    tiny_model: Path,
) -> None:
    assert "shared-prefix" in POLICIES
    options = BenchOptions(scale=0.05, threads=1, budget_mib=(1,))
    # a budget too small for the copying policies to keep whole states of every group
    shared = run_arm_alone("W1", "shared-prefix", tiny_model, 1 << 20, options)
    copying = run_arm_alone("W1", "lru-trie", tiny_model, 1 << 20, options)
    assert shared.oracle == copying.oracle > 0
    assert shared.oracle <= shared.decoded <= copying.decoded
    # each arm's own process: a peak that includes the model and the context
    assert shared.peak_rss_mib > 1 and copying.peak_rss_mib > 1
    table = format_table([shared, copying], {}, options)
    assert "shared-prefix" in table and "peak MiB" in table


def test_the_shared_arm_has_a_lookup_figure() -> None:
    assert lookup_micros("shared-prefix", 300, seed=1) > 0
