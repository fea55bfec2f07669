"""An in-process llama.cpp engine with N slots, run the way llama-server runs its slots.

One `llama_context` holds every slot as a sequence (`n_seq_max = N`, per-slot KV). A single
worker thread owns that context and runs a continuous-batching loop: each `llama_decode` carries
one token for every generating slot and prompt chunks for the slots still reading theirs. The
RAM prompt cache is a plugin (`cacheproxy.prompt_cache`): this module only does what its
decisions say, in the order documented there, and keeps the entries' bytes, copied in and out
with `llama_state_seq_get_data_ext` / `llama_state_seq_set_data_ext`. A policy that shares KV
(`SharedKvPolicy`) gets a unified KV cache instead, with spare sequence ids beyond the slots and
extra cells for its cached prefixes; it then answers in `llama_memory_seq_cp` / `seq_rm` calls,
and in spills and restores of cells to and from host RAM (sequence states, kept here by entry id),
having been told what a held cell and a spill cost on this context (kv_costs, at start).

Callers on other threads talk to the worker through a command queue; results come back through
the callbacks a task carries, which the asyncio side wraps in `loop.call_soon_threadsafe`.
It stays one module (over 700 lines): everything in it runs on the worker thread that owns the
llama.cpp context, and splitting it would spread that ownership across files.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import llama_cpp as llama

from cacheproxy.disk.slot_file import SlotFileError, encode_slot_file, parse_slot_file
from cacheproxy.embedded.kv_costs import measure_kv_costs
from cacheproxy.embedded.state_format import StateFormatError, engine_to_server, server_to_engine
from cacheproxy.errors import ApiError
from cacheproxy.prompt_cache import (
    EntryId,
    KvOp,
    PromptCacheDeps,
    PromptCachePolicy,
    RestoreCells,
    SeqCopy,
    SeqRemove,
    SharedKvPolicy,
    SlotView,
    SpillCells,
)
from cacheproxy.tokens import common_prefix_length

log = logging.getLogger(__name__)

StopType = Literal["none", "eos", "limit", "word"]
STATE_FLAGS = 0  # LLAMA_STATE_SEQ_FLAGS_NONE, as llama-server saves its slots


@llama.llama_log_callback
def _drop_llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp logs every load and context creation to stderr; the proxy has its own log."""


class EngineError(ApiError):
    """A request the engine refuses, with llama-server's HTTP status and error type."""


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    n_slots: int = 4
    ctx_size: int = 16384  # total, shared by the slots as llama-server's -c is
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 2


@dataclass(frozen=True)
class SamplingParams:
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random one
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class CompletionResult:
    """What llama-server reports for a finished task (its final response's fields)."""

    content: str
    tokens: list[int]
    id_slot: int
    stop_type: StopType
    stopping_word: str
    tokens_cached: int
    tokens_evaluated: int
    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float

    def timings(self) -> dict[str, float | int]:
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / max(1, self.prompt_n),
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / max(1, self.predicted_n),
            "predicted_per_second": (
                1e3 * self.predicted_n / self.predicted_ms if self.predicted_ms else 0.0
            ),
        }


@dataclass
class CompletionTask:
    """One completion; the callbacks are called on the worker thread."""

    prompt: list[int]
    sampling: SamplingParams
    on_text: Callable[[int, str], None]  # (token id, new text): one call per sampled token
    on_done: Callable[[CompletionResult], None]
    on_error: Callable[[EngineError], None]
    requested_slot_id: int | None = None
    cache_prompt: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class SlotCommand:
    """Save, restore or erase a slot; deferred while the slot is busy, as llama-server does."""

    action: Literal["save", "restore", "erase"]
    slot_id: int
    path: Path | None
    filename: str
    on_done: Callable[[dict[str, Any]], None]
    on_error: Callable[[EngineError], None]


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    ram_cache_saves: int = 0
    ram_cache_restores: int = 0


class _Slot:
    """A sequence in the context: the tokens whose KV it holds, and the task it runs."""

    def __init__(self, slot_id: int, n_ctx: int) -> None:
        self.id = slot_id
        self.n_ctx = n_ctx
        self.tokens: list[int] = []  # exactly the tokens whose KV is in the sequence
        self.t_last_used = -1
        self.task: CompletionTask | None = None
        self.sampler: Any = None
        self.next_token: int | None = None  # sampled, not decoded yet
        self.generated: list[int] = []
        self.text = ""
        self.sent_chars = 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.n_cached = 0
        self.t_start = 0.0
        self.t_prompt_done = 0.0

    @property
    def busy(self) -> bool:
        return self.task is not None

    @property
    def prefilling(self) -> bool:
        return self.task is not None and len(self.tokens) < len(self.task.prompt)


class EmbeddedEngine:
    """The model, one context with `n_slots` sequences, a prompt-cache policy, a worker thread.

    The worker thread loads the model, runs every step and frees it all at the end: the
    llama.cpp context lives and dies on the one thread that uses it. A caller on an event loop
    passes `on_loaded` and `close(on_closed)` and awaits them (embedded/server.py), so loading
    a model and waiting for the last step borrow no thread of its own."""

    def __init__(
        self,
        config: EngineConfig,
        policy_factory: Callable[[PromptCacheDeps], Any],
        on_loaded: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """Start the worker, which loads the model. Without `on_loaded`, wait here until it is
        loaded (raising what stopped it); with it, return at once: the worker calls it with
        None once loaded, or with the error, and the engine may be used only then."""
        self.config = config
        self._commands: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._lifecycle = threading.Lock()  # guards _closed, _freed and _on_closed
        self._freed = False
        self._on_closed: list[Callable[[], None]] = []
        outcome: list[BaseException | None] = []
        loaded = threading.Event()

        def wait_here(error: BaseException | None) -> None:
            outcome.append(error)
            loaded.set()

        self._thread = threading.Thread(
            target=self._work,
            args=(policy_factory, on_loaded or wait_here),
            name="embedded-engine",
            daemon=True,
        )
        self._thread.start()
        if on_loaded is None:
            loaded.wait()
            if outcome[0] is not None:
                raise outcome[0]

    def _load(self, policy_factory: Callable[[PromptCacheDeps], Any]) -> None:
        config = self.config
        llama.llama_log_set(_drop_llama_log, None)
        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        self._model = llama.llama_model_load_from_file(
            str(config.model_path).encode(), model_params
        )
        if not self._model:
            raise EngineError(500, f"cannot load model {config.model_path}")
        self._vocab = llama.llama_model_get_vocab(self._model)
        self.n_vocab = llama.llama_vocab_n_tokens(self._vocab)
        context_params = llama.llama_context_default_params()
        context_params.n_ctx = config.ctx_size
        context_params.n_batch = config.n_batch
        context_params.n_ubatch = config.n_ubatch
        context_params.n_seq_max = config.n_slots
        context_params.kv_unified = False  # per-slot KV, as llama-server with an explicit -np
        context_params.n_threads = config.n_threads
        context_params.n_threads_batch = config.n_threads
        self._ctx = llama.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            llama.llama_model_free(self._model)
            raise EngineError(500, "cannot create the llama.cpp context")
        self.n_ctx_slot = min(
            llama.llama_n_ctx_seq(self._ctx), llama.llama_model_n_ctx_train(self._model)
        )
        self.kv_bytes_per_cell = kv_bytes_per_cell(self._model)
        self.shared_kv: SharedKvPolicy | None = None
        self._kv_report: dict[str, int] = {}
        try:
            self.policy: PromptCachePolicy = policy_factory(
                PromptCacheDeps(
                    n_ctx=llama.llama_n_ctx(self._ctx),
                    n_slots=config.n_slots,
                    kv_bytes_per_cell=self.kv_bytes_per_cell,
                )
            )
            if isinstance(self.policy, SharedKvPolicy) and self.policy.shares_kv:
                self._ctx = self._unified_context(self.policy, context_params)
                self.shared_kv = self.policy
        except Exception:
            if self._ctx:
                llama.llama_free(self._ctx)
            llama.llama_model_free(self._model)
            raise
        self._memory = llama.llama_get_memory(self._ctx)
        self._eog_tokens = tuple(
            token for token in range(self.n_vocab) if llama.llama_vocab_is_eog(self._vocab, token)
        )
        self._slots = [_Slot(slot_id, self.n_ctx_slot) for slot_id in range(config.n_slots)]
        self._ram_entries: dict[EntryId, ctypes.Array[ctypes.c_uint8]] = {}
        self._batch = llama.llama_batch_init(config.n_batch, 0, 1)
        if self.shared_kv is not None and self.shared_kv.needs_costs():
            # a slot's and a spare's sequence ids, in the still empty cache
            try:
                costs = measure_kv_costs(
                    self._ctx,
                    self._batch,
                    config.n_batch,
                    self.n_vocab,
                    held_seq=config.n_slots,
                    active_seq=0,
                )
            except RuntimeError:
                log.warning("could not measure KV cell costs: cached cells stay in the KV cache")
            else:
                self.shared_kv.set_costs(costs)
            self._kv_report = self.shared_kv.kv_report()
        self._deferred: list[CompletionTask | SlotCommand] = []
        self._clock = 0  # release order: llama-server's t_last_used, as a counter
        self.stats = EngineStats()

    def _unified_context(self, policy: SharedKvPolicy, context_params: Any) -> Any:
        """One KV stream for every sequence, so `seq_cp` shares cells instead of copying them:
        the slots keep their -np share each (n_ctx_slot, as before), the policy's spare
        sequences and extra cells come on top."""
        layout = policy.kv_layout(self.config.n_slots, self.n_ctx_slot)
        llama.llama_free(self._ctx)
        self._ctx = None
        context_params.kv_unified = True
        context_params.n_seq_max = (
            self.config.n_slots + layout.spare_sequences + layout.transfer_sequences
        )
        context_params.n_ctx = self.config.n_slots * self.n_ctx_slot + layout.extra_cells
        ctx = llama.llama_init_from_model(self._model, context_params)
        if not ctx:
            raise EngineError(500, "cannot create the unified llama.cpp context")
        return ctx

    # ------------------------------------------------------------------ thread-safe, any caller

    def submit(self, work: CompletionTask | SlotCommand) -> None:
        self._commands.put(work)

    def cancel(self, task: CompletionTask) -> None:
        task.cancelled.set()
        self._commands.put(None)  # wake the worker

    def close(self, on_closed: Callable[[], None] | None = None) -> None:
        """Stop the worker, which then frees the context and the model. Without `on_closed`,
        wait here until it has; with it, return at once: the worker calls it when done."""
        with self._lifecycle:
            first, self._closed = not self._closed, True
            done = self._freed
            if on_closed is not None and not done:
                self._on_closed.append(on_closed)
        if first:
            self._commands.put(_STOP)
        if on_closed is None:
            self._thread.join()
        elif done:
            on_closed()

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """The vocabulary is read-only once loaded: safe to use off the worker thread."""
        data = text.encode()
        capacity = len(data) + 8
        buffer = (llama.llama_token * capacity)()
        count = llama.llama_tokenize(
            self._vocab, data, len(data), buffer, capacity, add_special, parse_special
        )
        if count < 0:
            buffer = (llama.llama_token * -count)()
            count = llama.llama_tokenize(
                self._vocab, data, len(data), buffer, -count, add_special, parse_special
            )
        return list(buffer[:count])

    def token_piece(self, token: int, special: bool = True) -> bytes:
        buffer = ctypes.create_string_buffer(64)
        length = llama.llama_token_to_piece(self._vocab, token, buffer, 64, 0, special)
        if length < 0:
            buffer = ctypes.create_string_buffer(-length)
            length = llama.llama_token_to_piece(self._vocab, token, buffer, -length, 0, special)
        return buffer.raw[:length]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(token) for token in tokens).decode(errors="replace")

    def model_meta(self) -> dict[str, int]:
        """What llama-server's GET /v1/models reports of the model (its `meta`)."""
        return {
            "vocab_type": int(llama.llama_vocab_type(self._vocab)),
            "n_vocab": self.n_vocab,
            "n_ctx": self.n_ctx_slot,
            "n_ctx_train": int(llama.llama_model_n_ctx_train(self._model)),
            "n_embd": int(llama.llama_model_n_embd(self._model)),
            "n_params": int(llama.llama_model_n_params(self._model)),
            "size": int(llama.llama_model_size(self._model)),
        }

    def chat_template(self) -> str | None:
        template = llama.llama_model_chat_template(self._model, None)
        return template.decode() if template else None

    def special_token_text(self, which: Literal["bos", "eos"]) -> str:
        token = (llama.llama_vocab_bos if which == "bos" else llama.llama_vocab_eos)(self._vocab)
        return self.token_piece(token).decode(errors="replace") if token >= 0 else ""

    @property
    def adds_bos(self) -> bool:
        return bool(llama.llama_vocab_get_add_bos(self._vocab))

    def slot_report(self) -> list[dict[str, Any]]:
        """A snapshot for `GET /slots`; read without locking, so it may be one step stale."""
        report = []
        for slot in self._slots:
            task = slot.task
            report.append(
                {
                    "id": slot.id,
                    "n_ctx": slot.n_ctx,
                    "is_processing": task is not None,
                    "id_task": -1,
                    "n_prompt_tokens": len(slot.tokens),
                    "next_token": [
                        {"has_next_token": task is not None, "n_decoded": len(slot.generated)}
                    ],
                }
            )
        return report

    # ------------------------------------------------------------------------- worker thread

    def _work(
        self,
        policy_factory: Callable[[PromptCacheDeps], Any],
        on_loaded: Callable[[BaseException | None], None],
    ) -> None:
        """The worker thread's life: load, serve until closed, free."""
        try:
            self._load(policy_factory)
        except BaseException as exc:  # the load freed what it had made
            self._end()
            on_loaded(exc)
            return
        on_loaded(None)
        try:
            self._run()
        finally:
            llama.llama_batch_free(self._batch)
            llama.llama_free(self._ctx)
            llama.llama_model_free(self._model)
            self._end()

    def _end(self) -> None:
        with self._lifecycle:
            self._freed = True
            on_closed, self._on_closed = self._on_closed, []
        for callback in on_closed:
            callback()

    def _run(self) -> None:
        while True:
            # Sleep on the queue only when nothing runs and nothing waits: work deferred while
            # every slot was busy must be offered again as soon as one is released.
            idle = not self._deferred and not any(slot.busy for slot in self._slots)
            try:
                command = self._commands.get(block=idle)
            except queue.Empty:
                command = None
            while True:
                if command is _STOP:
                    self._fail_all(EngineError(503, "the engine stopped"))
                    return
                if command is not None:
                    self._deferred.append(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
            self._drop_cancelled()
            self._start_deferred()
            if any(slot.busy for slot in self._slots):
                try:
                    self._step()
                except Exception as exc:  # any failure ends the running tasks
                    log.exception("decode step failed")
                    self._fail_running(EngineError(500, f"decode failed: {exc}"))

    def _drop_cancelled(self) -> None:
        self._deferred = [
            work
            for work in self._deferred
            if not (isinstance(work, CompletionTask) and work.cancelled.is_set())
        ]
        for slot in self._slots:
            if slot.task is not None and slot.task.cancelled.is_set():
                self._release(slot)

    def _start_deferred(self) -> None:
        """Offer waiting work to the slots in arrival order; what cannot start waits on."""
        waiting, self._deferred = self._deferred, []
        for work in waiting:
            try:
                started = (
                    self._launch(work)
                    if isinstance(work, CompletionTask)
                    else self._slot_command(work)
                )
            except Exception as exc:  # a failing policy or library call ends this task only
                log.exception("could not start a task")
                for slot in self._slots:
                    if slot.task is work:  # it failed after taking the slot: give it back
                        self._release(slot)
                        self._clear(slot)
                work.on_error(EngineError(500, f"could not start the task: {exc}"))
                continue
            if not started:
                self._deferred.append(work)

    # ----------------------------------------------------------------------- launching a task

    def _slot_views(self) -> list[SlotView]:
        return [
            SlotView(slot.id, tuple(slot.tokens), slot.busy, slot.t_last_used)
            for slot in self._slots
        ]

    def _launch(self, task: CompletionTask) -> bool:
        """Place a task on a slot, with the prompt-cache steps in llama-server's order."""
        prompt = task.prompt
        if not prompt:
            task.on_error(EngineError(400, "empty prompt"))
            return True
        if any(token < 0 or token >= self.n_vocab for token in prompt):
            task.on_error(EngineError(400, "Prompt contains invalid tokens"))
            return True
        if len(prompt) >= self.n_ctx_slot:
            task.on_error(
                EngineError(
                    400,
                    f"request ({len(prompt)} tokens) exceeds the available context size"
                    f" ({self.n_ctx_slot} tokens), try increasing it",
                    "exceed_context_size_error",
                )
            )
            return True
        policy = self.policy
        choice = policy.choose_slot(
            prompt, self._slot_views(), requested_slot_id=task.requested_slot_id
        )
        if choice.must_defer or choice.slot_id is None:
            return False
        slot = self._slots[choice.slot_id]
        if self.shared_kv is not None:
            back = self.shared_kv.bring_back(prompt, task.cache_prompt)
            restored = self._run_kv_ops(back.ops)
            if back.seq_id is not None:
                self._run_kv_ops(self.shared_kv.bring_back_finished(back.seq_id, restored))
            start = self.shared_kv.attach(slot.id, prompt, task.cache_prompt)
            self._run_kv_ops(start.ops)
            slot.tokens = list(prompt[: start.n_past])
            self._start(slot, task)
            return True
        if choice.save_slot:
            self._save_to_ram(slot)
        if choice.try_load:
            self._load_from_ram(slot, prompt)
        if choice.update_cache:
            self._drop_entries(policy.update())
        self._start(slot, task)
        plan = policy.idle_slots_to_cache(self._slot_views())
        for slot_id in plan.slot_ids:
            idle = self._slots[slot_id]
            if self._save_to_ram(idle):
                self._drop_entries(policy.update())
            if plan.clear_after_save:
                self._clear(idle)
        return True

    def _start(self, slot: _Slot, task: CompletionTask) -> None:
        """Keep the common prefix with what the slot holds, minus one token at least: the last
        prompt token is always evaluated, for its logits (llama-server's n_past rule)."""
        n_past = common_prefix_length(slot.tokens, task.prompt) if task.cache_prompt else 0
        if n_past == len(task.prompt):
            n_past -= 1
        llama.llama_memory_seq_rm(self._memory, slot.id, n_past, -1)
        del slot.tokens[n_past:]
        slot.task = task
        slot.n_cached = n_past
        slot.generated = []
        slot.text = ""
        slot.sent_chars = 0
        slot.utf8.reset()
        slot.next_token = None
        slot.sampler = self._make_sampler(task.sampling)
        slot.t_start = time.perf_counter()
        slot.t_prompt_done = 0.0

    def _make_sampler(self, sampling: SamplingParams) -> Any:
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if sampling.ignore_eos and self._eog_tokens:
            biases = (llama.llama_logit_bias * len(self._eog_tokens))()
            for index, token in enumerate(self._eog_tokens):
                biases[index].token = token
                biases[index].bias = float("-inf")
            llama.llama_sampler_chain_add(
                chain,
                llama.llama_sampler_init_logit_bias(self.n_vocab, len(self._eog_tokens), biases),
            )
        if sampling.temperature <= 0.0:
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
            return chain
        if sampling.top_k > 0:
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_k(sampling.top_k))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_p(sampling.top_p, 1))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_min_p(sampling.min_p, 1))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_temp(sampling.temperature))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_dist(sampling.seed))
        return chain

    # ------------------------------------------------------------------------ the RAM tier

    def _save_to_ram(self, slot: _Slot) -> bool:
        """`save()` the slot and copy its state if the policy stores it; True when stored."""
        size = llama.llama_state_seq_get_size_ext(self._ctx, slot.id, STATE_FLAGS)
        # the size llama-server would measure for the same tokens (see state_format)
        decision = self.policy.save(tuple(slot.tokens), size)
        self._drop_entries(decision.evicted)
        if not decision.stored or decision.entry_id is None:
            return False
        try:
            data = (ctypes.c_uint8 * size)()
        except MemoryError:
            self._drop_entries(self.policy.allocation_failed(decision.entry_id))
            return False
        llama.llama_state_seq_get_data_ext(self._ctx, data, size, slot.id, STATE_FLAGS)
        self._ram_entries[decision.entry_id] = data
        self.stats.ram_cache_saves += 1
        return True

    def _load_from_ram(self, slot: _Slot, prompt: Sequence[int]) -> None:
        found = self.policy.load(tuple(slot.tokens), prompt)
        if found.entry_id is None:
            return
        data = self._ram_entries.get(found.entry_id)
        restored = data is not None and (
            llama.llama_state_seq_set_data_ext(self._ctx, data, len(data), slot.id, STATE_FLAGS)
            == len(data)
        )
        self.policy.load_finished(found.entry_id, restored)
        if restored:
            slot.tokens = list(found.tokens)
            self.stats.ram_cache_restores += 1
        else:
            self._clear(slot)
        self._sync_entries()

    def _drop_entries(self, entry_ids: Sequence[EntryId]) -> None:
        for entry_id in entry_ids:
            self._ram_entries.pop(entry_id, None)

    def _sync_entries(self) -> None:
        """Free the bytes of entries the policy no longer lists (a restored entry leaves some
        caches without being reported as evicted)."""
        cached = {entry.entry_id for entry in self.policy.entries()}
        for entry_id in [entry_id for entry_id in self._ram_entries if entry_id not in cached]:
            del self._ram_entries[entry_id]

    def _run_kv_ops(self, ops: Sequence[KvOp]) -> bool:
        """Run a KV-sharing policy's operations in order; False if a restore failed (the
        rest still run: the policy's bookkeeping expects them)."""
        restored = True
        for op in ops:
            if isinstance(op, SeqCopy):
                llama.llama_memory_seq_cp(self._memory, op.src, op.dst, op.p0, op.p1)
            elif isinstance(op, SeqRemove):
                llama.llama_memory_seq_rm(self._memory, op.seq_id, op.p0, op.p1)
            elif isinstance(op, SpillCells):
                self._spill(op)
            elif isinstance(op, RestoreCells):
                restored = self._restore_spilled(op) and restored
        if self.shared_kv is not None:
            if any(isinstance(op, SpillCells | RestoreCells) for op in ops) or len(
                self._ram_entries
            ):
                spilled = self.shared_kv.spilled_ids()
                for entry_id in [entry for entry in self._ram_entries if entry not in spilled]:
                    del self._ram_entries[entry_id]
            for slot in self._slots:
                # An idle slot the policy parked still holds its tokens, as llama-server's
                # would (the proxy relies on idle slots keeping them), as long as the cache
                # can give them back: unpark() does so before its KV is read.
                if not slot.busy and len(slot.tokens) > self.shared_kv.held_by(slot.id):
                    del slot.tokens[self.shared_kv.retained(slot.tokens) :]
            # a snapshot for other threads: the tree is the worker's alone
            self._kv_report = self.shared_kv.kv_report()
        return restored

    def _spill(self, op: SpillCells) -> None:
        """The cells go to host RAM through the transfer sequence (seq_cp shares, no copy)."""
        llama.llama_memory_seq_cp(self._memory, op.src, op.via, op.p0, op.p1)
        size = llama.llama_state_seq_get_size_ext(self._ctx, op.via, STATE_FLAGS)
        try:
            data = (ctypes.c_uint8 * size)()
        except MemoryError:
            log.warning("no memory to spill %d KV cells: they will be decoded again", size)
        else:
            llama.llama_state_seq_get_data_ext(self._ctx, data, size, op.via, STATE_FLAGS)
            self._ram_entries[op.entry_id] = data
        llama.llama_memory_seq_rm(self._memory, op.via, -1, -1)

    def _restore_spilled(self, op: RestoreCells) -> bool:
        data = self._ram_entries.pop(op.entry_id, None)
        restored = data is not None and (
            llama.llama_state_seq_set_data_ext(self._ctx, data, len(data), op.via, STATE_FLAGS)
            == len(data)
        )
        if restored:
            llama.llama_memory_seq_cp(self._memory, op.via, op.dst, -1, -1)
            self.stats.ram_cache_restores += 1
        llama.llama_memory_seq_rm(self._memory, op.via, -1, -1)
        return restored

    def _unpark(self, slot: _Slot) -> None:
        """Put a parked idle slot's content back in its own sequence (shared, not copied)."""
        shared = self.shared_kv
        if shared is None or shared.held_by(slot.id) >= len(slot.tokens):
            return
        tokens = tuple(slot.tokens)
        back = shared.bring_back(tokens, True)
        restored = self._run_kv_ops(back.ops)
        if back.seq_id is not None:
            self._run_kv_ops(shared.bring_back_finished(back.seq_id, restored))
        start = shared.attach(slot.id, tokens, True, whole=True)
        self._run_kv_ops(start.ops)
        slot.tokens = list(tokens[: start.n_past])
        self._run_kv_ops(shared.publish(slot.id, tuple(slot.tokens)))

    def _reset_shared(self, slot: _Slot) -> None:
        """The slot's KV was replaced here, not through the policy: tell it."""
        if self.shared_kv is not None:
            self._run_kv_ops(self.shared_kv.reset(slot.id, tuple(slot.tokens)))

    def kv_sharing_report(self) -> dict[str, int]:
        """Cell counts of a KV-sharing policy (empty otherwise), and the cells each slot holds
        (shared or its own) and the cache holds alone, as of the last KV decision."""
        if self.shared_kv is None:
            return {}
        report = {f"kv_{name}": value for name, value in self._kv_report.items()}
        report["kv_bytes_per_cell"] = self.kv_bytes_per_cell
        for slot in self._slots:
            report[f'kv_cells_held_by{{holder="slot_{slot.id}"}}'] = len(slot.tokens)
        report['kv_cells_held_by{holder="cache"}'] = report.get("kv_cells_cached", 0)
        return report

    def _clear(self, slot: _Slot) -> None:
        llama.llama_memory_seq_rm(self._memory, slot.id, -1, -1)
        slot.tokens = []
        self._reset_shared(slot)

    # ------------------------------------------------------------------------- decoding

    def _step(self) -> None:
        """One `llama_decode`: a token per generating slot first, then prompt chunks."""
        batch = self._batch
        capacity = self.config.n_batch
        count = 0
        outputs: list[tuple[_Slot, int]] = []
        chunks: list[tuple[_Slot, list[int]]] = []

        def add(token: int, position: int, slot_id: int, wants_logits: bool) -> None:
            nonlocal count
            batch.token[count] = token
            batch.pos[count] = position
            batch.n_seq_id[count] = 1
            batch.seq_id[count][0] = slot_id
            batch.logits[count] = wants_logits
            count += 1

        for slot in self._slots:
            if slot.busy and slot.next_token is not None:
                outputs.append((slot, count))
                add(slot.next_token, len(slot.tokens), slot.id, True)
                chunks.append((slot, [slot.next_token]))
        for slot in self._slots:
            if count >= capacity:
                break
            if slot.task is None or not slot.prefilling:
                continue
            start = len(slot.tokens)
            chunk = slot.task.prompt[start : start + capacity - count]
            for offset, token in enumerate(chunk):
                last = start + offset == len(slot.task.prompt) - 1
                if last:
                    outputs.append((slot, count))
                add(token, start + offset, slot.id, last)
            chunks.append((slot, chunk))
        if count == 0:
            return
        batch.n_tokens = count
        status = llama.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        self.stats.n_decode_total += 1
        now = time.perf_counter()
        for slot, chunk in chunks:
            slot.tokens.extend(chunk)
            slot.next_token = None
        for slot, index in outputs:
            if slot.t_prompt_done == 0.0:
                slot.t_prompt_done = now
            token = llama.llama_sampler_sample(slot.sampler, self._ctx, index)
            self._take_token(slot, token)

    def _take_token(self, slot: _Slot, token: int) -> None:
        task = slot.task
        assert task is not None
        slot.generated.append(token)
        is_eog = token in self._eog_tokens and not task.sampling.ignore_eos
        stop_type: StopType = "none"
        stopping_word = ""
        if is_eog:
            stop_type = "eos"
        else:
            slot.text += slot.utf8.decode(self.token_piece(token, special=False))
            found = _find_stop(slot.text, task.sampling.stop, slot.sent_chars)
            if found is not None:
                position, stopping_word = found
                slot.text = slot.text[:position]
                stop_type = "word"
        n_predict = task.sampling.n_predict
        if stop_type == "none" and n_predict >= 0 and len(slot.generated) >= n_predict:
            stop_type = "limit"
        if stop_type == "none" and len(slot.tokens) + 1 >= slot.n_ctx:
            stop_type = "limit"  # the slot is full and context shift is off
        # Stream only text no stop string can still claim.
        sendable = (
            len(slot.text) if stop_type != "none" else _safe_length(slot.text, task.sampling.stop)
        )
        new_text = slot.text[slot.sent_chars : max(sendable, slot.sent_chars)]
        slot.sent_chars = max(sendable, slot.sent_chars)
        task.on_text(token, new_text)
        if stop_type == "none":
            slot.next_token = token
            return
        self._finish(slot, stop_type, stopping_word)

    def _finish(self, slot: _Slot, stop_type: StopType, stopping_word: str) -> None:
        task = slot.task
        assert task is not None
        now = time.perf_counter()
        prompt_n = len(task.prompt) - slot.n_cached
        prompt_ms = 1e3 * (slot.t_prompt_done - slot.t_start)
        predicted_ms = 1e3 * (now - slot.t_prompt_done)
        result = CompletionResult(
            content=slot.text,
            tokens=list(slot.generated),
            id_slot=slot.id,
            stop_type=stop_type,
            stopping_word=stopping_word,
            tokens_cached=len(slot.tokens),
            tokens_evaluated=len(task.prompt),
            cache_n=slot.n_cached,
            prompt_n=prompt_n,
            prompt_ms=prompt_ms,
            predicted_n=len(slot.generated),
            predicted_ms=predicted_ms,
        )
        stats = self.stats
        stats.prompt_tokens_total += prompt_n
        stats.prompt_tokens_cached_total += slot.n_cached
        stats.prompt_seconds_total += prompt_ms / 1e3
        stats.tokens_predicted_total += len(slot.generated)
        stats.tokens_predicted_seconds_total += predicted_ms / 1e3
        self._release(slot)
        task.on_done(result)

    def _release(self, slot: _Slot) -> None:
        if slot.sampler is not None:
            llama.llama_sampler_free(slot.sampler)
        slot.sampler = None
        was_running = slot.task is not None
        slot.task = None
        if was_running and self.shared_kv is not None:
            # what the slot decoded joins the shared prefixes
            self._run_kv_ops(self.shared_kv.publish(slot.id, tuple(slot.tokens)))
        slot.next_token = None
        self._clock += 1
        slot.t_last_used = self._clock

    def _fail_running(self, error: EngineError) -> None:
        """After a failed decode no running slot's KV can be trusted: clear them all."""
        for slot in self._slots:
            if slot.task is not None:
                task = slot.task
                self._release(slot)
                self._clear(slot)
                task.on_error(error)

    def _fail_all(self, error: EngineError) -> None:
        self._fail_running(error)
        for work in self._deferred:
            work.on_error(error)
        self._deferred = []

    # -------------------------------------------------------------------------- slot files

    def _slot_command(self, command: SlotCommand) -> bool:
        slot = self._slots[command.slot_id % len(self._slots)]
        if slot.busy:
            return False
        try:
            if command.action == "save":
                command.on_done(self._save_file(slot, command))
            elif command.action == "restore":
                command.on_done(self._restore_file(slot, command))
            else:
                n_erased = len(slot.tokens)
                self._clear(slot)
                command.on_done({"id_slot": slot.id, "n_erased": n_erased})
        except EngineError as error:
            command.on_error(error)
        return True

    def _save_file(self, slot: _Slot, command: SlotCommand) -> dict[str, Any]:
        assert command.path is not None
        started = time.perf_counter()
        self._unpark(slot)
        size = llama.llama_state_seq_get_size_ext(self._ctx, slot.id, STATE_FLAGS)
        state = (ctypes.c_uint8 * size)()
        llama.llama_state_seq_get_data_ext(self._ctx, state, size, slot.id, STATE_FLAGS)
        # a unified cache saves as llama-server with the same -np and per-slot KV would
        layout = (len(self._slots), slot.id) if self.shared_kv is not None else None
        data = encode_slot_file(slot.tokens, engine_to_server(bytes(state), layout))
        try:
            command.path.write_bytes(data)
        except OSError as exc:
            raise EngineError(500, "Unable to save slot") from exc
        return {
            "id_slot": slot.id,
            "filename": command.filename,
            "n_saved": len(slot.tokens),
            "n_written": len(data),
            "timings": {"save_ms": 1e3 * (time.perf_counter() - started)},
        }

    def _restore_file(self, slot: _Slot, command: SlotCommand) -> dict[str, Any]:
        """On any failure the slot is cleared and the answer is 400, as in llama-server."""
        assert command.path is not None
        started = time.perf_counter()
        try:
            data = command.path.read_bytes()
            header = parse_slot_file(data)
            tokens = list(header.tokens)
            if len(tokens) > slot.n_ctx:
                raise SlotFileError("Restored prompt does not fit in the slot context")
            if any(token < 0 or token >= self.n_vocab for token in tokens):
                raise SlotFileError("Invalid tokens in slot save file")
            state_bytes = server_to_engine(
                data[header.state_offset :], slot.id, unified=self.shared_kv is not None
            )
            state = (ctypes.c_uint8 * len(state_bytes)).from_buffer_copy(state_bytes)
            read = llama.llama_state_seq_set_data_ext(
                self._ctx, state, len(state), slot.id, STATE_FLAGS
            )
            if read != len(state):
                raise SlotFileError("No available space in KV cache or invalid slot save file")
        except (OSError, SlotFileError, StateFormatError) as exc:
            self._clear(slot)
            raise EngineError(400, f"Unable to restore slot: {exc}") from exc
        slot.tokens = tokens
        self._reset_shared(slot)
        return {
            "id_slot": slot.id,
            "filename": command.filename,
            "n_restored": len(tokens),
            "n_read": len(data),
            "timings": {"restore_ms": 1e3 * (time.perf_counter() - started)},
        }


_STOP = object()


def kv_bytes_per_cell(model: Any) -> int:
    """Bytes of K and V one token takes over all layers, with the default f16 cache."""
    n_head = max(1, llama.llama_model_n_head(model))
    n_head_kv = llama.llama_model_n_head_kv(model)
    head_dim = llama.llama_model_n_embd(model) // n_head
    f16_bytes = 2
    return 2 * llama.llama_model_n_layer(model) * n_head_kv * head_dim * f16_bytes


def _find_stop(text: str, stops: Sequence[str], sent_chars: int) -> tuple[int, str] | None:
    """The earliest complete stop string in the text not yet sent, with its position."""
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        position = text.find(stop, max(0, sent_chars - len(stop) + 1))
        if position >= 0 and (best is None or position < best[0]):
            best = (position, stop)
    return best


def _safe_length(text: str, stops: Sequence[str]) -> int:
    """How much of `text` can be sent: all but a tail that might begin a stop string."""
    safe = len(text)
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                safe = min(safe, len(text) - length)
                break
    return safe
