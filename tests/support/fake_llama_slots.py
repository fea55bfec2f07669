"""The fake llama-server's slots: which slot a task gets, what each holds, its RAM prompt cache,
and its slot files.

Slot choice follows llama-server's `get_available_slot` (server-context.cpp 1680-1793): a pinned
task (`id_slot`, wrapped modulo the slot count) takes its slot, waiting while it is busy; an
unpinned one takes the idle non-empty slot most similar to its prompt (similarity above
`-sps` 0.10, lowest id on a tie), else the least recently used idle slot (never-used ones first,
the last of them first). With a RAM cache, a slot chosen with `f_keep < 0.5` (a pinned slot that
holds something sharing at most 10% of the prompt, or an LRU pick) is copied to RAM first, and
the RAM entry that keeps more of the prompt is moved into it (server-task.cpp 1722-1879). An
empty pinned slot skips the RAM cache (f_keep = 0/0).

Slot files are written in llama-server's format (`llama_state_seq_save_file` with a packed
`server_tokens` blob, reference §8) with a small stand-in KV state that has the layout fields a
reader checks (n_stream, cell metadata, per-layer K and V types and rows).
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from dataclasses import dataclass, field
from pathlib import Path

from cacheproxy.tokens import common_prefix_length as common_prefix

SLOT_FILE_MAGIC = 0x67677371  # 'ggsq'
SLOT_FILE_VERSION = 4
PACKED_MARKER = -1
PACKED_VERSION = 1
N_LAYER = 2
ROW_BYTES = 16  # bytes of K (and of V) per cell and layer in the stand-in state
GGML_TYPE_F16 = 1
RAM_MIN_KEEP = 0.25  # a RAM entry keeping less of itself is never loaded


@dataclass
class FakeSlot:
    id: int
    n_ctx: int
    tokens: list[int] = field(default_factory=list)
    processing: bool = False
    id_task: int | None = None  # the last completion task it ran (shown once it ran one)
    t_last_used: int = -1
    n_decoded: int = 0
    n_remain: int = -1

    def report(self) -> dict:
        """The slot as `GET /slots` shows it (server-context.cpp 724-758)."""
        entry: dict = {
            "id": self.id,
            "n_ctx": self.n_ctx,
            "speculative": False,
            "is_processing": self.processing,
        }
        if self.id_task is not None:
            entry.update(
                id_task=self.id_task,
                n_prompt_tokens=len(self.tokens),
                n_prompt_tokens_processed=0,
                n_prompt_tokens_cache=0,
                params={"n_predict": -1, "temperature": 0.8, "stream": False},
                next_token=[
                    {
                        "has_next_token": self.processing,
                        "has_new_line": False,
                        "n_remain": self.n_remain,
                        "n_decoded": self.n_decoded if self.processing else 0,
                    }
                ],
            )
        return entry


class FakeSlots:
    def __init__(
        self,
        n_slots: int,
        n_ctx: int,
        ram_cache: bool,
        unified_kv: bool,
        similarity: float = 0.10,
    ) -> None:
        self.slots = [FakeSlot(index, n_ctx) for index in range(n_slots)]
        self.ram_cache = ram_cache
        self.unified_kv = unified_kv
        self.similarity = similarity
        self.ram: list[list[int]] = []  # the RAM prompt cache's entries
        self.changed = asyncio.Condition()
        self._task_ids = itertools.count()
        self._clock = itertools.count()

    def new_task_id(self) -> int:
        return next(self._task_ids)

    async def acquire(self, prompt: list[int], id_slot: int, completion: bool = True) -> FakeSlot:
        """The slot a task runs on, marked busy; waits (deferred) while none is available."""
        async with self.changed:
            while True:
                choice = self._available(prompt, id_slot)
                if choice is not None and not choice[0].processing:
                    slot, update_cache = choice
                    break
                await self.changed.wait()
            slot.processing = True
            if completion and update_cache and self.ram_cache:
                self._save_to_ram(slot.tokens)
                self._load_from_ram(slot, prompt)
            return slot

    async def acquire_for_action(self, id_slot: int) -> FakeSlot:
        """A slot for a save, restore or erase: deferred while it is busy."""
        async with self.changed:
            slot = self.slots[id_slot % len(self.slots)]
            while slot.processing:
                await self.changed.wait()
            slot.processing = True
            return slot

    async def release(self, slot: FakeSlot, used: bool = True, clear: bool = False) -> None:
        async with self.changed:
            slot.processing = False
            slot.n_decoded = 0
            if used:
                slot.t_last_used = next(self._clock)
            if clear:  # a child task's slot is cleared on release (server-context.cpp 592-595)
                slot.tokens = []
            self.changed.notify_all()

    def launched(self) -> None:
        """After a task starts: with unified KV and the RAM cache (`--cache-idle-slots`), every
        idle slot is copied to RAM and emptied (server-context.cpp 2641-2657)."""
        if not (self.unified_kv and self.ram_cache):
            return
        for slot in self.slots:
            if not slot.processing and slot.tokens:
                self._save_to_ram(slot.tokens)
                slot.tokens = []

    def _available(self, prompt: list[int], id_slot: int) -> tuple[FakeSlot, bool] | None:
        if id_slot != -1:
            slot = self.slots[id_slot % len(self.slots)]
            if slot.processing or not slot.tokens:
                return slot, False  # busy: deferred; empty: f_keep is NaN, no RAM cache
            share = common_prefix(slot.tokens, prompt) / max(len(prompt), 1)
            # chosen by similarity only if its raw id is the one asked for
            chosen = slot.id == id_slot and share > self.similarity
            f_keep = share * len(prompt) / len(slot.tokens) if chosen else 0.0
            return slot, f_keep < 0.5
        best, best_share = None, 0.0
        for slot in self.slots:
            if slot.processing or not slot.tokens:
                continue
            share = common_prefix(slot.tokens, prompt) / max(len(prompt), 1)
            if share > best_share and share > self.similarity:
                best, best_share = slot, share
        if best is not None:
            return best, best_share * len(prompt) / len(best.tokens) < 0.5
        idle = [slot for slot in self.slots if not slot.processing]
        if not idle:
            return None
        lru = idle[0]
        for slot in idle[1:]:
            if slot.t_last_used <= lru.t_last_used:
                lru = slot
        return lru, True

    def _save_to_ram(self, tokens: list[int]) -> None:
        if not tokens:
            return
        for entry in self.ram:
            if len(entry) >= len(tokens) and entry[: len(tokens)] == tokens:
                return  # an entry already holds all of it
        self.ram.append(list(tokens))

    def _load_from_ram(self, slot: FakeSlot, prompt: list[int]) -> None:
        held = common_prefix(slot.tokens, prompt)
        best_keep = held / len(slot.tokens) if slot.tokens else 0.0
        best_sim = held / max(len(prompt), 1)
        best = None
        for entry in self.ram:
            shared = common_prefix(entry, prompt)
            keep, sim = shared / len(entry), shared / max(len(prompt), 1)
            if keep >= RAM_MIN_KEEP and keep > best_keep and sim > best_sim:
                best, best_keep, best_sim = entry, keep, sim
        if best is not None:
            self.ram.remove(best)  # moved out of the cache
            slot.tokens = list(best)


class SlotFileRefused(ValueError):
    """A slot file the fake would not restore (the reason, as llama-server words it)."""


def slot_file_bytes(tokens: list[int], n_stream: int, stream: int) -> bytes:
    """A slot file holding `tokens` in KV stream `stream` of `n_stream`."""
    words = struct.pack("<iII", PACKED_MARKER, PACKED_VERSION, len(tokens))
    words += struct.pack(f"<{len(tokens)}i", *tokens) + struct.pack("<I", 0)  # no media
    header = struct.pack("<III", SLOT_FILE_MAGIC, SLOT_FILE_VERSION, len(words) // 4)
    return header + words + _kv_state(len(tokens), n_stream, stream)


def _kv_state(cells: int, n_stream: int, stream: int) -> bytes:
    state = struct.pack("<I", n_stream) + struct.pack("<I", 0) * stream + struct.pack("<I", cells)
    if cells:
        state += b"".join(struct.pack("<iIi", position, 1, stream) for position in range(cells))
        state += struct.pack("<IIII", 0, N_LAYER, 0, 0)  # v_trans, n_layer, n_rot_k, n_rot_v
        for _ in range(2 * N_LAYER):  # K of every layer, then V of every layer
            state += struct.pack("<iQ", GGML_TYPE_F16, ROW_BYTES) + bytes(cells * ROW_BYTES)
    return state + struct.pack("<I", 0) * (n_stream - stream - 1)


def read_slot_file(path: Path, n_stream: int, n_vocab: int, n_ctx: int) -> list[int]:
    """The tokens of a slot file, checked as llama-server's restore checks it."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SlotFileRefused(f"failed to open {path.name}: {exc.strerror}") from exc
    invalid = SlotFileRefused("No available space in KV cache or invalid slot save file")
    if len(data) < 12:
        raise invalid
    magic, version, n_words = struct.unpack_from("<III", data)
    if magic != SLOT_FILE_MAGIC or version != SLOT_FILE_VERSION or 12 + 4 * n_words > len(data):
        raise invalid
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    tokens = list(words[3 : 3 + words[2]]) if words and words[0] == PACKED_MARKER else list(words)
    state_at = 12 + 4 * n_words
    if len(data) < state_at + 4 or struct.unpack_from("<I", data, state_at)[0] != n_stream:
        raise invalid
    if len(tokens) > n_ctx:
        raise SlotFileRefused("Restored prompt does not fit in the slot context")
    if any(not 0 <= token < n_vocab for token in tokens):
        raise SlotFileRefused("Invalid tokens in slot save file")
    return tokens


FORBIDDEN_IN_NAMES = set('/\\:*?"<>|')


def valid_filename(name: object) -> bool:
    """`fs_validate_filename` (common.cpp 800-872), the checks that matter for ASCII names."""
    if not isinstance(name, str) or not name or len(name.encode()) > 255:
        return False
    if any(ch in FORBIDDEN_IN_NAMES or ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return False
    if name != name.strip(" ") or name.endswith(".") or ".." in name or name == ".":
        return False
    return True
