"""What a `cacheproxy bench cache` run is asked to do: workloads, arms, RAM-cache sizes and the
llama-server flags every arm shares, checked before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from cacheproxy.bench.workloads import MultiTurnSpec, SharedPrefixSpec

WORKLOADS = ("W1", "W2", "W3")
ARMS = ("direct", "proxy")
DEFAULT_WORKLOADS = ("W1", "W2")
DEFAULT_CACHE_RAM_MIB = (0, 8192)
# One compute thread: on a 2-core machine shared with the load generator and the proxy, fewer
# spinning threads means less noise; the figures that matter are token counts anyway.
DEFAULT_SERVER_ARGS = ("--threads", "1")


# llama-server's own RAM cache size (common/common.h `cache_ram_mib = 8192`)
LLAMA_SERVER_CACHE_RAM_MIB = 8192


@dataclass(frozen=True)
class ServerOptions:
    """llama-server flags every arm shares (besides host, port and slot folder). `defaults`:
    llama-server as `llama-server -m MODEL` starts it, with its host and port and nothing else
    but `extra_args` (and `--cache-ram` when another than its own 8192 is asked for): 4 slots
    on a unified KV cache, no slot save path, no `--metrics`."""

    parallel: int = 4
    ctx_size: int = 4 * 4096
    extra_args: tuple[str, ...] = DEFAULT_SERVER_ARGS
    defaults: bool = False

    @property
    def slot_context(self) -> int | None:
        """Tokens a slot holds (None: the server decides, from the model; checked once up)."""
        if self.defaults:
            return None
        # Without unified KV (an explicit --parallel), each slot gets an equal share.
        return self.ctx_size // self.parallel


@dataclass(frozen=True)
class CacheBenchConfig:
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    cache_ram_mib: tuple[int, ...] = DEFAULT_CACHE_RAM_MIB
    arms: tuple[str, ...] = ARMS
    model_size: str = "small"
    seed: int = 1
    in_flight: int = 4
    # The proxy arm's llama-server RAM cache (None: the same as the direct arm's), so the proxy
    # can run with the flags it needs (its disk tier in place of the server's RAM cache).
    proxy_server_cache_ram_mib: int | None = None
    disk_budget_mib: int = 1024
    disk_blocks: bool = True  # the proxy's `disk.blocks`: archives cut into blocks
    server: ServerOptions = field(default_factory=ServerOptions)
    shared_prefix: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)
    multi_turn: MultiTurnSpec = field(default_factory=MultiTurnSpec)
    repeat: int = 1  # every row run this many times, arms alternated (report_repeats.py)
    # several models (`multi_turn.models` > 1): every arm's llama-server is a router over that
    # many test models of the same shape, each with weights of its own, and keeps at most
    # `models_max` loaded (None: llama-server's default, 4)
    models_max: int | None = None

    @property
    def models(self) -> int:
        return self.multi_turn.models

    def __post_init__(self) -> None:
        unknown = (set(self.workloads) - set(WORKLOADS)) | (set(self.arms) - set(ARMS))
        if unknown:
            raise ValueError(f"unknown workload or arm: {sorted(unknown)}")
        if not (self.workloads and self.arms and self.cache_ram_mib):
            raise ValueError("nothing to run: give at least one workload, arm and cache-ram value")
        if self.repeat < 1:
            raise ValueError("repeat must be at least 1")
        if self.in_flight < 1:
            raise ValueError("in_flight must be at least 1")
        if self.models > 1 and "W1" in self.workloads:
            raise ValueError("several models: W2 and W3 only (W1's prompts name no model)")
        if self.models_max is not None and self.models_max < 1:
            raise ValueError("models_max must be at least 1")
        check_context_fits(self)

    def longest_sequence(self, workload: str) -> int:
        if workload == "W1":
            return self.shared_prefix.longest_sequence
        return self.multi_turn.longest_sequence


def check_context_fits(config: CacheBenchConfig) -> None:
    """Fail before starting anything if a slot cannot hold a workload's longest request:
    llama-server refuses a prompt that fills the slot and stops generating one token early."""
    slot_context = config.server.slot_context
    for workload in config.workloads:
        needed = config.longest_sequence(workload) + 1
        if slot_context is not None and needed > slot_context:
            raise ValueError(
                f"{workload}'s longest prompt + output needs {needed} tokens per slot, but"
                f" ctx_size {config.server.ctx_size} / parallel {config.server.parallel} gives"
                f" {config.server.slot_context}: raise ctx_size or shorten the workload"
            )
