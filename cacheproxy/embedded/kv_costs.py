"""What a KV cell costs on this engine's own context, measured once at start.

In a unified KV cache attention spans every used cell (llama.cpp's `get_n_kv`: the highest used
cell + 1, padded), masked per sequence, so each cell held for a cached prefix slows every token
decoded beside it; a cell moved to host RAM costs nothing until it is read back. Which is
cheaper depends on the model and the machine (on a small model attention dominates, on a large
one the bytes of a state do), so both are measured here rather than assumed:

- attention: a prompt chunk and a few single-token steps decoded beside `HELD_CELLS` cells of
  another sequence, against the same with those cells freed;
- round trip: those cells' state read out of the context, freed, and written back.

Each is the best of a few tries, alternated, as the machine may be shared and busy.
"""

from __future__ import annotations

import ctypes
import random
import time
from typing import Any

import llama_cpp as llama

from cacheproxy.prompt_cache import KvCosts

HELD_CELLS = 2048
PROMPT_TOKENS = 64
STEPS = 8
TRIES = 5
STATE_FLAGS = 0


def measure_kv_costs(
    ctx: Any, batch: Any, n_batch: int, n_vocab: int, held_seq: int, active_seq: int
) -> KvCosts:
    """Uses sequences `held_seq` and `active_seq` of an empty context and leaves them empty."""
    memory = llama.llama_get_memory(ctx)
    rng = random.Random(0)
    tokens = [rng.randrange(n_vocab) for _ in range(HELD_CELLS + PROMPT_TOKENS + STEPS)]

    def decode(run: list[int], start: int, seq_id: int) -> None:
        for offset in range(0, len(run), n_batch):
            chunk = run[offset : offset + n_batch]
            for index, token in enumerate(chunk):
                batch.token[index] = token
                batch.pos[index] = start + offset + index
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = seq_id
                batch.logits[index] = offset + index == len(run) - 1
            batch.n_tokens = len(chunk)
            if llama.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed while measuring KV costs")

    def active_work() -> float:
        started = time.perf_counter()
        decode(tokens[:PROMPT_TOKENS], 0, active_seq)
        for step in range(STEPS):
            decode([tokens[PROMPT_TOKENS + step]], PROMPT_TOKENS + step, active_seq)
        elapsed = time.perf_counter() - started
        llama.llama_memory_seq_rm(memory, active_seq, -1, -1)
        return elapsed

    try:
        decode(tokens[:HELD_CELLS], 0, held_seq)
        alone, beside, round_trip = [], [], []
        # Alternate, so that a machine whose load drifts weighs on both sides alike.
        for _ in range(TRIES):
            beside.append(active_work())
            started = time.perf_counter()
            held_state = _read_state(ctx, held_seq)
            llama.llama_memory_seq_rm(memory, held_seq, -1, -1)
            spilled = time.perf_counter() - started
            alone.append(active_work())
            started = time.perf_counter()
            _write_state(ctx, held_seq, held_state)
            round_trip.append(spilled + time.perf_counter() - started)
    finally:
        llama.llama_memory_seq_rm(memory, held_seq, -1, -1)
        llama.llama_memory_seq_rm(memory, active_seq, -1, -1)
    cell_tokens = HELD_CELLS * (PROMPT_TOKENS + STEPS)
    return KvCosts(
        attention_s_per_cell_token=max(0.0, min(beside) - min(alone)) / cell_tokens,
        round_trip_s_per_cell=min(round_trip) / HELD_CELLS,
    )


def _read_state(ctx: Any, seq_id: int) -> ctypes.Array[ctypes.c_uint8]:
    size = llama.llama_state_seq_get_size_ext(ctx, seq_id, STATE_FLAGS)
    data = (ctypes.c_uint8 * size)()
    llama.llama_state_seq_get_data_ext(ctx, data, size, seq_id, STATE_FLAGS)
    return data


def _write_state(ctx: Any, seq_id: int, data: ctypes.Array[ctypes.c_uint8]) -> None:
    if llama.llama_state_seq_set_data_ext(ctx, data, len(data), seq_id, STATE_FLAGS) != len(data):
        raise RuntimeError("could not restore a state while measuring KV costs")
