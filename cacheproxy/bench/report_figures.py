"""`cacheproxy bench report`'s figures read back from the JSON-like dict a run returns, and the
plain-words reading of them (which arm decoded less, whether W4 found a timing signal)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cacheproxy.bench import isolation
from cacheproxy.bench.agents_report import agents_sentences
from cacheproxy.bench.cache_config import ARMS, CacheBenchConfig, ServerOptions
from cacheproxy.bench.workloads import MultiTurnSpec, SharedPrefixSpec, TokenRange

SpecT = TypeVar("SpecT", SharedPrefixSpec, MultiTurnSpec)


CONDITIONS = ("primed", "cold", "self-primed")
ARM_LABELS = {"direct": "llama-server alone", "proxy": "through cacheproxy"}


ARM_PHRASES = {"direct": "for llama-server alone", "proxy": "through the proxy"}
CONDITION_LABELS = {
    "primed": "another tenant primed the prefix",
    "cold": "nobody primed it",
    "self-primed": "B primed it itself (control)",
}


# Below this, a proxy/direct ratio reads as "the same".
SAME_WITHIN = 0.005
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
        repeat=config.get("repeat", 1),
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
    if figures.get("agents"):
        sentences += agents_sentences(figures["agents"])
    return sentences
