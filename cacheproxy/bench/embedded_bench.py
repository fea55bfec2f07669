"""W1 and W2 on the embedded engine, one prompt-cache policy at a time, at one or more byte budgets.

For each budget, workload and policy: prompt tokens decoded (sum of `timings.prompt_n`), decoded /
oracle, wall time, and the peak resident memory of the process that ran the arm (each arm runs in
a fresh process, so its peak is its own: model, context, KV and RAM cache); llama-cpp-python's own
`LlamaRAMCache` (one sequence, whole-context states) runs the same trace as a reference. Requests
are issued one after another, so every arm sees the same order. Then the lookup time of each
policy with 10,000 cached entries, as pure policy calls on synthetic token lists.

The budget means the same in every arm: bytes of KV kept for prompts no slot holds. The copying
policies allocate it as entries are saved; `shared-prefix` reserves it in its unified KV cache
up front (its cached prefixes are cells of that cache), so its context is that much larger.
"""

from __future__ import annotations

import multiprocessing
import random
import resource
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cacheproxy.bench.workloads import (
    Exchange,
    MultiTurnSpec,
    Request,
    SharedPrefixSpec,
    multi_turn_workload,
    oracle,
    shared_prefix_workload,
)
from cacheproxy.embedded.engine import EmbeddedEngine
from cacheproxy.embedded.tasks import (
    CompletionResult,
    CompletionTask,
    EngineConfig,
    EngineError,
    SamplingParams,
)
from cacheproxy.plugins import load_plugin
from cacheproxy.prompt_cache import CacheEntry, EntryId, PromptCacheDeps

POLICIES = ("llama-server", "lru-trie", "radix", "shared-prefix")
REFERENCE = "LlamaRAMCache"
LOOKUP_ENTRIES = 10_000
LOOKUPS = 200


@dataclass(frozen=True)
class ArmFigures:
    workload: str
    arm: str
    decoded: int
    oracle: int
    wall_s: float
    peak_rss_mib: float = float("nan")  # of the process that ran the arm, when run alone
    budget_mib: int = 0

    @property
    def ratio(self) -> float:
        return self.decoded / self.oracle if self.oracle else float("nan")


# ----------------------------------------------------------------------------- the traces


def w1_requests(scale: float, seed: int) -> list[Request]:
    spec = SharedPrefixSpec(
        groups=8,
        prompts_per_group=max(2, round(16 * scale)),
        prefix_tokens=max(16, round(1024 * scale)),
        question_tokens=max(8, round(128 * scale)),
    )
    return shared_prefix_workload(spec, seed)


def w2_spec(scale: float) -> MultiTurnSpec:
    return MultiTurnSpec(
        tenant_prefix_tokens=max(16, round(512 * scale)),
        history_tokens=max(16, round(1024 * scale)),
        question_tokens=max(8, round(128 * scale)),
    )


Complete = Callable[[Sequence[int], int], tuple[list[int], int]]  # -> (output, prompt decoded)


def run_trace(workload: str, complete: Complete, scale: float, seed: int) -> tuple[int, int]:
    """Issue the workload's requests in order; return (tokens decoded, oracle)."""
    exchanges: list[Exchange] = []
    decoded = 0
    if workload == "W1":
        for request in w1_requests(scale, seed):
            output, prompt_decoded = complete(request.prompt, request.n_predict)
            decoded += prompt_decoded
            exchanges.append(Exchange(request.prompt, output))
    else:
        plan = multi_turn_workload(w2_spec(scale), seed)
        answers: list[list[list[int]]] = [[] for _ in plan.conversations]
        for turn in range(plan.turns):
            for index, conversation in enumerate(plan.conversations):
                request = conversation.request(turn, answers[index])
                output, prompt_decoded = complete(request.prompt, request.n_predict)
                decoded += prompt_decoded
                answers[index].append(output)
                exchanges.append(Exchange(request.prompt, output))
    return decoded, sum(oracle(exchanges))


# ----------------------------------------------------------------------------------- arms


def engine_completer(engine: EmbeddedEngine) -> Complete:
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)

    def complete(prompt: Sequence[int], n_predict: int) -> tuple[list[int], int]:
        finished = threading.Event()
        outcome: list[CompletionResult | EngineError] = []

        def done(result: CompletionResult | EngineError) -> None:
            outcome.append(result)
            finished.set()

        engine.submit(
            CompletionTask(
                prompt=list(prompt),
                sampling=replace(sampling, n_predict=n_predict),
                on_text=lambda token, text: None,
                on_done=done,
                on_error=done,
            )
        )
        finished.wait()
        result = outcome[0]
        if isinstance(result, EngineError):
            raise result
        return result.tokens, result.prompt_n

    return complete


def run_policy_arm(
    workload: str, policy: str, model: Path, budget_bytes: int, options: BenchOptions
) -> ArmFigures:
    config = EngineConfig(
        model_path=model,
        n_slots=options.slots,
        ctx_size=options.slot_context * options.slots,
        n_threads=options.threads,
    )

    def make_policy(deps: PromptCacheDeps) -> Any:
        return load_plugin("prompt_cache", policy, {"limit_bytes": budget_bytes}, deps)

    engine = EmbeddedEngine(config, make_policy)
    try:
        started = time.perf_counter()
        decoded, oracle_count = run_trace(
            workload, engine_completer(engine), options.scale, options.seed
        )
        wall = time.perf_counter() - started
    finally:
        engine.close()
    return ArmFigures(workload, policy, decoded, oracle_count, wall)


def run_reference_arm(
    workload: str, model: Path, budget_bytes: int, options: BenchOptions
) -> ArmFigures:
    """llama-cpp-python's high-level `Llama` with its `LlamaRAMCache`: one sequence, and a
    cache keyed by whole token lists holding whole-context states."""
    from llama_cpp import Llama, LlamaRAMCache

    llm = Llama(
        model_path=str(model),
        n_ctx=options.slot_context,
        n_batch=2048,
        n_threads=options.threads,
        n_threads_batch=options.threads,
        verbose=False,
    )
    llm.set_cache(LlamaRAMCache(capacity_bytes=budget_bytes))
    ban_eos = {token: float("-inf") for token in (llm.token_eos(),) if token >= 0}
    evaluated: list[int] = []
    sampled: list[int] = []
    plain_eval, plain_sample = llm.eval, llm.sample

    def counting_eval(tokens: Sequence[int]) -> None:
        evaluated.append(len(tokens))
        plain_eval(tokens)

    def recording_sample(*args: Any, **kwargs: Any) -> int:
        token = plain_sample(*args, **kwargs)
        sampled.append(token)
        return token

    llm.eval = counting_eval  # type: ignore[method-assign]
    llm.sample = recording_sample  # type: ignore[method-assign]

    def complete(prompt: Sequence[int], n_predict: int) -> tuple[list[int], int]:
        evaluated.clear()
        sampled.clear()
        llm.create_completion(
            list(prompt), max_tokens=n_predict, temperature=0.0, logit_bias=ban_eos
        )
        # the first eval of a completion is the prompt's uncached part
        return sampled[:n_predict], evaluated[0] if evaluated else 0

    try:
        started = time.perf_counter()
        decoded, oracle_count = run_trace(workload, complete, options.scale, options.seed)
        wall = time.perf_counter() - started
    finally:
        llm.close()
    return ArmFigures(workload, REFERENCE, decoded, oracle_count, wall)


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _arm_in_this_process(
    workload: str, arm: str, model: Path, budget_bytes: int, options: BenchOptions
) -> ArmFigures:
    if arm == REFERENCE:
        figures = run_reference_arm(workload, model, budget_bytes, options)
    else:
        figures = run_policy_arm(workload, arm, model, budget_bytes, options)
    return replace(figures, peak_rss_mib=peak_rss_mib(), budget_mib=budget_bytes >> 20)


def _arm_child(
    connection: Any, workload: str, arm: str, model: Path, budget_bytes: int, options: Any
) -> None:
    try:
        connection.send(_arm_in_this_process(workload, arm, model, budget_bytes, options))
    except BaseException as exc:  # report it to the parent rather than die silently
        connection.send(RuntimeError(f"{workload} {arm}: {exc!r}"))
    finally:
        connection.close()


def run_arm_alone(
    workload: str, arm: str, model: Path, budget_bytes: int, options: BenchOptions
) -> ArmFigures:
    """One arm in a fresh process, so that its peak memory is its own."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_arm_child,
        args=(sender, workload, arm, model, budget_bytes, options),
        name=f"bench-{workload}-{arm}",
    )
    process.start()
    sender.close()
    try:
        result = receiver.recv()
    except EOFError as exc:
        raise RuntimeError(f"the {workload} {arm} arm died (exit {process.exitcode})") from exc
    finally:
        process.join()
    if isinstance(result, BaseException):
        raise result
    return result


# ------------------------------------------------------------------------------ lookups


def synthetic_entries(count: int, seed: int) -> list[tuple[int, ...]]:
    """Prompts as a cache sees them: 100 shared system prefixes, each with its own tails."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(100, 30000) for _ in range(256)) for _ in range(100)]
    return [
        prefixes[index % len(prefixes)] + tuple(rng.randrange(100, 30000) for _ in range(64))
        for index in range(count)
    ]


def lookup_micros(policy_name: str, count: int, seed: int) -> float:
    """Mean time of one `load()` (the lookup a task launch makes) with `count` entries."""
    entries = synthetic_entries(count, seed)
    size = 1024 * len(entries[0])
    if policy_name == REFERENCE:
        from llama_cpp import LlamaRAMCache

        cache = LlamaRAMCache(capacity_bytes=1 << 62)
        for tokens in entries:
            cache.cache_state[tokens] = None  # type: ignore[assignment]  # only keys are searched
        lookup: Callable[[tuple[int, ...]], Any] = cache._find_longest_prefix_key
    elif policy_name == "shared-prefix":
        # One sequence per entry, as if each were a slot (a context has at most 256, but the
        # tree does not care): the lookup is the tree walk a task launch makes.
        policy = load_plugin(
            "prompt_cache",
            policy_name,
            {"limit_bytes": 0},
            PromptCacheDeps(n_slots=len(entries), kv_bytes_per_cell=1024),
        )
        for seq_id, tokens in enumerate(entries):
            policy.reset(seq_id, tokens)
        lookup = policy.longest_prefix
    else:
        policy = load_plugin("prompt_cache", policy_name, {"limit_bytes": -1}, PromptCacheDeps())
        if policy_name == "llama-server":
            # Its save() compares the new prompt with every entry (as llama-server does), so
            # 10,000 saves cost 10^8 comparisons; fill its FIFO directly instead.
            for entry_id, tokens in enumerate(entries):
                policy._entries[entry_id] = CacheEntry(EntryId(entry_id), tokens, size)
        else:
            for tokens in entries:
                policy.save(tokens, size)

        def lookup(task: tuple[int, ...]) -> Any:
            return policy.load((), task)

    rng = random.Random(seed + 1)
    tasks = [
        rng.choice(entries)[:300] + tuple(rng.randrange(100, 30000) for _ in range(40))
        for _ in range(LOOKUPS)
    ]
    started = time.perf_counter()
    for task in tasks:
        lookup(task)
    return 1e6 * (time.perf_counter() - started) / len(tasks)


# ------------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class BenchOptions:
    workloads: tuple[str, ...] = ("W1", "W2")
    arms: tuple[str, ...] = (*POLICIES, REFERENCE)
    budget_mib: tuple[int, ...] = (16,)
    slots: int = 4
    slot_context: int = 4096
    threads: int = 1
    scale: float = 1.0
    seed: int = 1
    lookup_entries: int = LOOKUP_ENTRIES


def format_table(
    figures: list[ArmFigures], lookups: dict[str, float], options: BenchOptions
) -> str:
    budgets = ", ".join(f"{mib} MiB" for mib in options.budget_mib)
    lines = [
        f"embedded engine, {options.slots} slots of {options.slot_context} tokens, RAM budget"
        f" {budgets}, workload scale {options.scale}, seed {options.seed}, requests one at a time,"
        " each arm in its own process",
        "",
        f"{'budget':>7} {'workload':<9}{'arm':<15}{'decoded':>10}{'oracle':>10}{'dec/oracle':>12}"
        f"{'wall s':>9}{'peak MiB':>10}",
    ]
    for row in figures:
        lines.append(
            f"{row.budget_mib:>7} {row.workload:<9}{row.arm:<15}{row.decoded:>10}{row.oracle:>10}"
            f"{row.ratio:>12.2f}{row.wall_s:>9.2f}{row.peak_rss_mib:>10.1f}"
        )
    lines += [
        "",
        f"lookup with {options.lookup_entries:,} cached entries (mean of {LOOKUPS} lookups)",
    ]
    for arm, micros in lookups.items():
        lines.append(f"  {arm:<15}{micros:>12.1f} us")
    return "\n".join(lines)


def run_embedded_benchmark(model: Path, options: BenchOptions) -> str:
    figures = []
    for budget_mib in options.budget_mib:
        for workload in options.workloads:
            for arm in options.arms:
                figures.append(run_arm_alone(workload, arm, model, budget_mib << 20, options))
    lookups = {
        arm: lookup_micros(arm, options.lookup_entries, options.seed) for arm in options.arms
    }
    return format_table(figures, lookups, options)


def run_from_options(**values: Any) -> int:
    from cacheproxy.provision.make_model import ensure_model

    size = values.pop("size", "small")
    if isinstance(values.get("budget_mib"), int):
        values["budget_mib"] = (values["budget_mib"],)
    options = BenchOptions(**{key: value for key, value in values.items() if value is not None})
    print(run_embedded_benchmark(ensure_model(size), options), flush=True)
    return 0
