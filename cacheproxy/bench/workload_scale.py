"""The sizes of W1 and W2 that `--scale` and `--token-scale` multiply, for a machine or a model
too slow for the full runs: the workloads keep their shapes."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from cacheproxy.bench.workloads import MultiTurnSpec, SharedPrefixSpec

SpecT = TypeVar("SpecT", SharedPrefixSpec, MultiTurnSpec)

# The fields `--scale` multiplies, with the least value each may take (W3 needs two turns to put
# a restart between). Tenants are not a size: they are what the workload is about.
SHARED_PREFIX_SIZES = {
    "groups": 1,
    "prompts_per_group": 1,
    "prefix_tokens": 1,
    "question_tokens": 1,
    "n_predict": 1,
}
MULTI_TURN_SIZES = {
    "users_per_tenant": 1,
    "turns": 2,
    "tenant_prefix_tokens": 1,
    "history_tokens": 1,
    "question_tokens": 1,
    "n_predict": 1,
}


# The fields `--token-scale` multiplies: token counts only, so the workloads keep their shapes.
SHARED_PREFIX_TOKENS = {
    name: least
    for name, least in SHARED_PREFIX_SIZES.items()
    if name.endswith("_tokens") or name == "n_predict"
}
MULTI_TURN_TOKENS = {
    name: least
    for name, least in MULTI_TURN_SIZES.items()
    if name.endswith("_tokens") or name == "n_predict"
}


def scaled(spec: SpecT, scale: float, sizes: dict[str, int]) -> SpecT:
    return replace(
        spec,
        **{name: max(least, round(getattr(spec, name) * scale)) for name, least in sizes.items()},
    )
