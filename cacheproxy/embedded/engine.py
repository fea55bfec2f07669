"""An in-process llama.cpp engine with N slots, run the way llama-server runs its slots.

One `llama_context` holds every slot as a sequence (`n_seq_max = N`, per-slot KV). A single
worker thread owns that context and runs a continuous-batching loop: each `llama_decode` carries
one token for every generating slot and prompt chunks for the slots still reading theirs. Around
the loop, each in its own module: the model and what is read from it (model.py, safe off the
worker thread), the KV operations the prompt-cache plugin decides (kv_ops.py: the RAM tier, or a
unified cache whose prefixes the slots share), llama-server's slot files in and out
(slot_files.py), and the work handed in and the results handed back (tasks.py).

The worker loads the model and frees it at the end: the context lives and dies on the one thread
that uses it (a caller on an event loop passes `on_loaded` and `close(on_closed)` and awaits them,
embedded/server.py, borrowing no thread). Callers talk to the worker through a command queue;
results come back through a task's callbacks, wrapped in `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp as llama

from cacheproxy.embedded.kv_ops import EngineKv
from cacheproxy.embedded.model import LlamaModel
from cacheproxy.embedded.slot_files import run_slot_command
from cacheproxy.embedded.tasks import (
    CompletionResult,
    CompletionTask,
    EngineConfig,
    EngineError,
    EngineSlot,
    EngineStats,
    SlotCommand,
    StopType,
)
from cacheproxy.prompt_cache import PromptCacheDeps, PromptCachePolicy, SharedKvPolicy
from cacheproxy.tokens import common_prefix_length

log = logging.getLogger(__name__)


class EmbeddedEngine:
    """The model, one context with `n_slots` sequences, a prompt-cache policy, a worker thread."""

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
        self.model = LlamaModel(config.model_path)
        context_params = llama.llama_context_default_params()
        context_params.n_ctx = config.ctx_size
        context_params.n_batch = config.n_batch
        context_params.n_ubatch = config.n_ubatch
        context_params.n_seq_max = config.n_slots
        context_params.kv_unified = False  # per-slot KV, as llama-server with an explicit -np
        context_params.n_threads = config.n_threads
        context_params.n_threads_batch = config.n_threads
        self._ctx = None
        self.shared_kv: SharedKvPolicy | None = None
        try:
            self._ctx = self.model.new_context(context_params)
            self.n_ctx_slot = min(llama.llama_n_ctx_seq(self._ctx), self.model.n_ctx_train)
            self.kv_bytes_per_cell = self.model.kv_bytes_per_cell
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
            self.model.close()
            raise
        self._eog_tokens = self.model.eog_tokens  # asked for every token sampled
        self._slots = [EngineSlot(slot_id, self.n_ctx_slot) for slot_id in range(config.n_slots)]
        self.stats = EngineStats()
        self.kv = EngineKv(self._ctx, self.policy, self.shared_kv, self._slots, self.stats)
        self._batch = llama.llama_batch_init(config.n_batch, 0, 1)
        self.kv.measure_costs(self._batch, config.n_batch, self.model.n_vocab)
        self._deferred: list[CompletionTask | SlotCommand] = []
        self._clock = 0  # release order: llama-server's t_last_used, as a counter

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
        return self.model.new_context(context_params, "the unified llama.cpp context")

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

    def kv_sharing_report(self) -> dict[str, int]:
        """Cell counts of a KV-sharing policy (empty otherwise), and the cells each slot holds
        (shared or its own) and the cache holds alone, as of the last KV decision."""
        return self.kv.sharing_report(self.kv_bytes_per_cell)

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
            self.model.close()
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
                        self.kv.clear(slot)
                work.on_error(EngineError(500, f"could not start the task: {exc}"))
                continue
            if not started:
                self._deferred.append(work)

    # ----------------------------------------------------------------------- launching a task

    def _launch(self, task: CompletionTask) -> bool:
        """Place a task on a slot, with the prompt-cache steps in llama-server's order."""
        prompt = task.prompt
        if not prompt:
            task.on_error(EngineError(400, "empty prompt"))
            return True
        if not self.model.valid(prompt):
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
        slot = self.kv.place(task)
        if slot is None:
            return False
        self._start(slot, task)
        if self.shared_kv is None:
            self.kv.cache_idle_slots()  # once the task holds its slot, as llama-server does
        return True

    def _start(self, slot: EngineSlot, task: CompletionTask) -> None:
        """Keep the common prefix with what the slot holds, minus one token at least: the last
        prompt token is always evaluated, for its logits (llama-server's n_past rule)."""
        n_past = common_prefix_length(slot.tokens, task.prompt) if task.cache_prompt else 0
        if n_past == len(task.prompt):
            n_past -= 1
        n_past = self.kv.keep(slot, n_past)
        slot.task = task
        slot.n_cached = n_past
        slot.generated = []
        slot.text = ""
        slot.sent_chars = 0
        slot.utf8.reset()
        slot.next_token = None
        slot.sampler = self.model.make_sampler(task.sampling)
        slot.t_start = time.perf_counter()
        slot.t_prompt_done = 0.0

    # ------------------------------------------------------------------------- decoding

    def _step(self) -> None:
        """One `llama_decode`: a token per generating slot first, then prompt chunks."""
        batch = self._batch
        capacity = self.config.n_batch
        count = 0
        outputs: list[tuple[EngineSlot, int]] = []
        chunks: list[tuple[EngineSlot, list[int]]] = []

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

    def _take_token(self, slot: EngineSlot, token: int) -> None:
        task = slot.task
        assert task is not None
        slot.generated.append(token)
        is_eog = token in self._eog_tokens and not task.sampling.ignore_eos
        stop_type: StopType = "none"
        stopping_word = ""
        if is_eog:
            stop_type = "eos"
        else:
            slot.text += slot.utf8.decode(self.model.token_piece(token, special=False))
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

    def _finish(self, slot: EngineSlot, stop_type: StopType, stopping_word: str) -> None:
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

    def _release(self, slot: EngineSlot) -> None:
        if slot.sampler is not None:
            llama.llama_sampler_free(slot.sampler)
        slot.sampler = None
        was_running = slot.task is not None
        slot.task = None
        if was_running:
            self.kv.published(slot)  # what it decoded joins the shared prefixes, if any
        slot.next_token = None
        self._clock += 1
        slot.t_last_used = self._clock

    def _fail_running(self, error: EngineError) -> None:
        """After a failed decode no running slot's KV can be trusted: clear them all."""
        for slot in self._slots:
            if slot.task is not None:
                task = slot.task
                self._release(slot)
                self.kv.clear(slot)
                task.on_error(error)

    def _fail_all(self, error: EngineError) -> None:
        self._fail_running(error)
        for work in self._deferred:
            work.on_error(error)
        self._deferred = []

    def _slot_command(self, command: SlotCommand) -> bool:
        """Save, restore or erase a slot (slot_files.py); False: it is busy, the command waits."""
        slot = self._slots[command.slot_id % len(self._slots)]
        if slot.busy:
            return False
        run_slot_command(command, slot, self.kv, self.model)
        return True


_STOP = object()


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
