"""`cacheproxy bench embedded` on a tiny scale: every arm runs, and the figures add up."""

from __future__ import annotations

from pathlib import Path

from cacheproxy.bench.embedded_bench import (
    BenchOptions,
    lookup_micros,
    run_policy_arm,
    run_reference_arm,
    synthetic_entries,
)


def test_arms_decode_at_least_the_oracle_and_a_small_budget_costs_more(tiny_model: Path) -> None:
    options = BenchOptions(scale=0.05, threads=1)
    roomy = run_policy_arm("W1", "llama-server", tiny_model, 64 << 20, options)
    tight = run_policy_arm("W1", "llama-server", tiny_model, 0, options)
    reference = run_reference_arm("W1", tiny_model, 64 << 20, options)
    assert roomy.oracle == tight.oracle == reference.oracle > 0
    assert roomy.oracle <= roomy.decoded < tight.decoded
    assert reference.decoded >= reference.oracle


def test_lookups_run_on_every_policy() -> None:
    assert len(set(synthetic_entries(50, seed=1))) == 50
    for arm in ("llama-server", "lru-trie", "radix", "LlamaRAMCache"):
        assert lookup_micros(arm, 200, seed=1) > 0
