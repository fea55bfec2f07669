"""What the embedded engine is handed and hands back, and what it keeps per slot.

Callers on any thread hand it completion tasks and slot commands (save, restore, erase), each
carrying the callbacks its result comes back through, called on the worker thread; a refusal is
an `EngineError` with llama-server's HTTP status and error type. Per slot the worker keeps one
`EngineSlot`: the tokens whose KV its sequence holds, and the task it runs.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cacheproxy.errors import ApiError

StopType = Literal["none", "eos", "limit", "word"]


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


class EngineSlot:
    """A sequence in the context: the tokens whose KV it holds, and the task it runs (the
    worker's alone: other threads read it only for a report that may be one step stale)."""

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
