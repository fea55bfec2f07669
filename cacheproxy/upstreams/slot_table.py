"""What every slot of every upstream holds, token by token, and how the server will reuse it.

The table is exact where the server tells us the tokens and bounded where it does not: a slot
holds `known` tokens for certain, then `unknown_tail` more whose ids we were not given (a
streamed OAI reply carries text, not ids). Every prediction is checked against the server's
`timings.cache_n`, and every finished request rewrites its slot from what the server reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.adapters import Requested, Scales, effective
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.ram_shadow import RamCacheShadow, RamPrediction, ShadowSlot
from cacheproxy.upstreams.rates import PrefillThroughput, Smoothed

UNKNOWN = None  # an unknown_tail of unknown length


@dataclass(frozen=True)
class ReuseBounds:
    """The server's `cache_n` for a prompt will lie in [low, high]."""

    low: int
    high: int

    def holds(self, cache_n: int) -> bool:
        return self.low <= cache_n <= self.high


NO_REUSE = ReuseBounds(0, 0)  # the server reuses nothing (frozen: one object serves all)
# A conversation's next turn re-templates the answer it continues, whose last few tokens may
# tokenize otherwise than generated: a request reusing all but these continues the text
CONTINUATION_SLACK_TOKENS = 16


def branch_point(held: int, reused: int) -> int | None:
    """Where a request that reuses `reused` of a text of `held` tokens branches off it (another
    question on the same document); None when it continues the text, or reuses none of it."""
    if reused <= 0 or held - reused <= CONTINUATION_SLACK_TOKENS:
        return None
    return reused


@dataclass(frozen=True)
class TaskOutcome:
    """What the server reported about a finished request on a slot."""

    ok: bool
    cache_n: int | None = None
    prompt_n: int | None = None
    prompt_ms: float | None = None
    tokens_cached: int | None = None  # tokens in the slot's KV after the task
    generated: list[int] | None = None  # every generated id, when the server sent them all
    predicted_n: int | None = None  # tokens generated, as the server counted them
    predicted_ms: float | None = None  # the time it took to generate them, after the prompt
    slot_id: int | None = None  # the slot it ran on, when the answer says (native `id_slot`)
    cut: bool = False  # broken off, its figures read from its slot (slots/cut_tasks.py): charged
    # the generation reached the slot's context: a server started with `--context-shift` then
    # drops part of the slot's text (server-context.cpp `pre_decode`), which the answer
    # does not say; without it the answer stops there
    truncated: bool = False


# a task that has not answered yet, or failed without a report (frozen: one object serves all)
UNANSWERED = TaskOutcome(ok=False)


@dataclass(frozen=True)
class SlotContent:
    """What a slot held at one moment, and whose text it was (None: nobody known)."""

    known: list[int]
    unknown_tail: int | None
    owner: str | None
    turns: int = 1  # requests of one conversation the slot served in a row
    last_used: float = 0.0  # monotonic end of its last request; 0: not known
    branch: int | None = None  # see `SlotState.branch`
    # how often its owner's requests continued the whole text they reused (1: always, as a
    # conversation's turns do; near 0: they branch off it, as questions on one document do)
    continues: float = 1.0
    # the same, counting only those that left out at most one of its tokens (what a state that
    # is restored whole or not at all needs: `disk.policy.restore_is_whole`)
    continues_exactly: float = 1.0
    # the LoRA scales it was computed under (`SlotState.adapters`; None: not known)
    adapters: Scales | None = None

    @property
    def n_tokens_at_least(self) -> int:
        return len(self.known) + (self.unknown_tail or 0)

    def held_whole_by(self, archived: int) -> bool:
        """Whether an archive holding its first `archived` tokens holds all of it (never when
        some of its tokens are not known)."""
        return self.unknown_tail == 0 and archived >= len(self.known)


@dataclass(frozen=True)
class SlotHint:
    """What a slot whose ids are not known here held when its last holder recorded it: the
    hashes of its first `n_tokens` ids (slots/slot_hints.py), never the ids. A prompt of its
    tenant that starts with those tokens names them (the slot then holds them, as far as the
    server has not changed it since)."""

    n_tokens: int
    whole: bytes  # the hash of all `n_tokens` ids
    blocks: tuple[bytes, ...]  # chained hashes of each whole block of them


@dataclass
class SlotState:
    slot_id: int
    n_ctx: int
    known: list[int] = field(default_factory=list)
    unknown_tail: int | None = 0
    tenant: str | None = None
    session: str | None = None
    busy: bool = False
    saving: bool = False  # busy only while the disk tier saves it in the background
    lease_started: float = 0.0
    last_used: float = 0.0
    turns: int = 0  # requests of the conversation it holds, each continuing the one before
    # The prefix its text branched from: its request restored an archive of its tenant's and
    # reused only that prefix of it (another question on the same document), and each request
    # since branched there again. Only that prefix is expected back. None: a conversation's
    # text, or nothing known of its lineage.
    branch: int | None = None
    version: int = (
        0  # bumped whenever the proxy changes the slot: a report older than that is stale
    )
    # what its last holder recorded of a content whose ids are not known here (a proxy's start,
    # a takeover); dropped as soon as the slot changes
    hint: SlotHint | None = None
    # its known ids were named by a hint, not by a request run here: a request may have run
    # after the hint was written, so they are a guess for its own tenant only until one does
    hinted: bool = False
    # the LoRA scales its text was computed under, as its last request here ran (upstreams/
    # adapters.py); None: not known (what the proxy did not run here), which a server with
    # adapters reuses for nobody
    adapters: Scales | None = None

    @property
    def empty(self) -> bool:
        return not self.known and self.unknown_tail == 0

    @property
    def n_tokens(self) -> int | None:
        return None if self.unknown_tail is UNKNOWN else len(self.known) + self.unknown_tail

    @property
    def n_tokens_at_least(self) -> int:
        """Its tokens, a tail of unknown length counted as none (as `SlotContent`'s)."""
        return len(self.known) + (self.unknown_tail or 0)

    def content(
        self, owner: str | None, continues: float = 1.0, continues_exactly: float = 1.0
    ) -> SlotContent:
        """What the slot holds now, as `owner`'s text, whose requests continue the whole text
        they reuse this often (`SlotContent.continues`, `continues_exactly`)."""
        return SlotContent(
            known=self.known,
            unknown_tail=self.unknown_tail,
            owner=owner,
            turns=self.turns,
            last_used=self.last_used,
            branch=self.branch,
            continues=continues,
            continues_exactly=continues_exactly,
            adapters=self.adapters,
        )

    def shared_with(self, prompt: Sequence[int]) -> int:
        """How many of the slot's known tokens begin `prompt`."""
        return common_prefix_length(self.known, prompt)

    def reuse_bounds(self, prompt: Sequence[int], shared: int | None = None) -> ReuseBounds:
        """The `cache_n` the server will report for `prompt` on this slot."""
        # a prompt already wholly cached still decodes its last token: cache_n is n - 1
        cap = max(len(prompt) - 1, 0)
        if shared is None:
            shared = self.shared_with(prompt)
        low = min(shared, cap)
        if shared < len(self.known) or self.unknown_tail == 0:
            return ReuseBounds(low, low)
        tail = cap if self.unknown_tail is UNKNOWN else self.unknown_tail
        return ReuseBounds(low, min(shared + tail, cap))

    def tokens_lost_to(self, prompt: Sequence[int], shared: int | None = None) -> int:
        """Tokens this slot holds past what `prompt` shares with it: overwritten if it runs here."""
        held = self.n_tokens
        if held is None:
            held = len(self.known)
        if shared is None:
            shared = self.shared_with(prompt)
        return max(held - shared, 0)

    def hold(self, known: list[int], unknown_tail: int | None = 0) -> None:
        self.known = known
        self.unknown_tail = unknown_tail
        self.hint = None
        self.hinted = False
        self.adapters = None  # what it was computed under: told by whoever knows it
        self.version += 1

    def forget(self, n_tokens: int | None = UNKNOWN) -> None:
        """The slot holds `n_tokens` tokens (None: how many is unknown) that we cannot name."""
        self.hold([], n_tokens)

    def _filled_by(self, prompt: list[int], generated: int | None) -> bool:
        """Whether a prompt and what was generated after it reached the slot's context (an
        answer that does not say `truncated`: an OpenAI one, a stream's)."""
        return (
            self.n_ctx > 0 and generated is not None and len(prompt) + generated + 1 >= self.n_ctx
        )

    def record(self, prompt: list[int], outcome: TaskOutcome) -> None:
        """Rewrite the slot from a finished request: (prompt + generated)[:tokens_cached]."""
        if not outcome.ok or outcome.tokens_cached is None:
            self.forget()
            return
        if outcome.truncated or self._filled_by(prompt, outcome.predicted_n):
            self.forget(outcome.tokens_cached)  # its text may have been shifted: not which
            return
        if outcome.generated is not None:
            self.hold((prompt + outcome.generated)[: outcome.tokens_cached])
            return
        known = prompt[: outcome.tokens_cached]
        self.hold(known, outcome.tokens_cached - len(known))


@dataclass(eq=False)
class UpstreamSlots:
    """One upstream's slots and the measurements the router needs about it."""

    index: int
    upstream: Upstream
    slots: list[SlotState]
    # pinned requests may be answered from the server's RAM cache: it is on, or not known to be
    # off (a probe that could not run); either way it is shared by all slots, hence all tenants
    ram_cache: bool = False
    ram_cache_known: bool = True
    # what that RAM cache holds, replayed from the requests sent (None: no cache, or not followed)
    ram_shadow: RamCacheShadow | None = None
    # every task launch empties the idle slots into that RAM cache (unified KV with
    # --cache-idle-slots: llama-server's default topology); a task pinned to an empty slot then
    # never loads from the cache, so tasks go without `id_slot` and the server picks the slot
    clears_idle: bool = False
    healthy: bool = True
    loading: bool = False  # down because it answers 503 while it loads the model
    model_names: frozenset[str] = frozenset()  # its model's ids and aliases (empty: unknown)
    model_id: str | None = None  # its model, as the metrics and the ledger name it
    # a router's instance not loaded: its slots hold nothing; loaded when its model is asked for
    unloaded: bool = False
    router: bool = False  # a router itself: no slots (its instances' tables: router_instances)
    n_vocab: int | None = None  # the model's vocabulary size; None: not known
    # whether a task that does not say `cache_prompt` reuses its slot's text: the server's
    # default, off with --no-cache-prompt (found by the probe; until then taken as on)
    reuses_by_default: bool = True
    # whether the server answers OAI requests with `__verbose` unasked (`--verbose`); None: not
    # known yet (see apis/observe.py)
    verbose_default: bool | None = None
    # The request times are guesses until measured: averaged with the first measurements
    # they would misprice every wait for the next several requests. The prefill rate keeps its
    # guess in the average: the disk tier's restore-or-prefill choice reads it too.
    prefill_ms_per_token: Smoothed = field(default_factory=lambda: Smoothed(0.1))
    # what a prompt token costs the server across its batches (the disk tier's cost model)
    prefill_throughput: PrefillThroughput = field(default_factory=PrefillThroughput)
    request_s: Smoothed = field(default_factory=lambda: Smoothed(1.0, prior=True))
    # how long a request holds its slot once its prompt is computed (generating, answering)
    after_prefill_s: Smoothed = field(default_factory=lambda: Smoothed(1.0, prior=True))
    # pinned tasks the server answered since the table was built: one process that ran that
    # many has numbered them up to at least that many minus one (monitor.process_restarted)
    tasks_answered: int = 0
    # the slots those tasks ran on: the process shows a task id for each of them ever after
    tasked_slots: set[int] = field(default_factory=set)
    # the LoRA adapters' global scales (`GET /lora-adapters`), and their files; (): none
    # loaded, or not told
    adapters: Scales = ()
    adapter_files: tuple[str, ...] = ()

    def scales_of(self, asked: Requested) -> Scales | None:
        """The LoRA scales a request asking `asked` runs under here (upstreams/adapters.py)."""
        return effective(asked, self.adapters) if self.adapters else ()

    def same_scales(self, slot: SlotState, asked: Requested) -> bool:
        """Whether what `slot` holds was computed under the scales a request asking `asked`
        runs under here: always, on a server without adapters."""
        if not self.adapters:
            return True
        scales = self.scales_of(asked)
        return scales is not None and slot.adapters == scales

    def server_ms_per_token(self) -> float:
        """What a prompt token costs the server: measured across its batches, or, until a
        prompt has measured that, the per-request figure. (A prompt computed beside others
        reports the batches' whole time as its own: per request, a token looks as dear as the
        batch's tokens together.)"""
        measured = self.prefill_throughput.ms_per_token()
        return self.prefill_ms_per_token.value if measured is None else measured

    @classmethod
    def from_slots_report(
        cls, index: int, upstream: Upstream, report: list[dict], ram_cache: bool = False
    ) -> UpstreamSlots:
        """Build from `GET /slots`: what a slot holds is counted, but not yet known by id."""
        table = cls(index, upstream, [SlotState(s["id"], s["n_ctx"]) for s in report], ram_cache)
        table.reconcile(report)
        return table

    @property
    def ram_cache_state(self) -> str:
        """ "on", "off" or "unknown" (treated as on until a probe tells)."""
        if not self.ram_cache_known:
            return "unknown"
        return "on" if self.ram_cache else "off"

    def set_ram_cache(self, state: str) -> None:
        self.ram_cache = state != "off"
        self.ram_cache_known = state != "unknown"

    @property
    def server_picks(self) -> bool:
        """Tasks go out without `id_slot`: the server takes the slot, as the shadow predicts."""
        return self.clears_idle and self.ram_shadow is not None

    def shadow_slots(self) -> list[ShadowSlot]:
        """The slots as the RAM-cache shadow sees them: exact tokens where known, busy, and
        when each last finished a task (in microseconds, as llama-server keeps it)."""
        return [
            ShadowSlot(
                s.slot_id,
                s.known if s.unknown_tail == 0 else None,
                s.busy,
                int(s.last_used * 1e6) if s.last_used > 0 else -1,
            )
            for s in self.slots
        ]

    def server_pick(self, prompt: list[int]) -> tuple[int, RamPrediction] | None:
        """The idle slot the server takes for `prompt` sent without `id_slot`, and what its RAM
        cache does there (None: no idle slot, or the server's choice is not followed)."""
        if self.ram_shadow is None:
            return None
        return self.ram_shadow.pick(self.shadow_slots(), prompt)

    def placement(
        self,
        slot: SlotState,
        prompt: list[int],
        shared: int,
        reuse: ReuseBounds,
        ram: bool,
        found: RamPrediction | None = None,
    ) -> tuple[ReuseBounds, int, RamPrediction | None]:
        """The reuse of `prompt` on `slot`, and the tokens lost by placing it there: what the
        slot holds past the shared prefix. With `ram` (the server's RAM cache may serve the
        prompt), as the shadow replays it: the cache may restore more than the slot keeps, what
        it keeps of the slot is not lost, and an entry it restores there is (past the prompt).
        `found`: the shadow's prediction for it, when asked already (`server_pick`). Last, the
        shadow's prediction (None: not asked), for the grant's claim to reuse."""
        lost = slot.tokens_lost_to(prompt, shared)
        if not ram or slot.busy or self.ram_shadow is None:
            return reuse, lost, None
        if found is None:
            found = self.ram_shadow.predict(self.shadow_slots(), slot.slot_id, prompt)
        lost = (0 if found.slot_kept else lost) + found.entry_lost
        if found.cache_n > reuse.high:
            # a load the server has not shown it makes is a chance: not counted on (an archive
            # restored rather), though the server may make it
            low = found.cache_n if found.proven else reuse.low
            return ReuseBounds(low, found.cache_n), lost, found
        return reuse, lost, found

    def shadow_claim(
        self,
        slot_id: int,
        prompt: list[int],
        predicted: RamPrediction | None = None,
        pinned: bool = True,
    ) -> None:
        """Tell the RAM-cache shadow that a task with `prompt` is placed on idle `slot_id`:
        what it will load there is gone for the others before it is sent. `predicted`: the
        placement's prediction for it, made with the table as it still is; `pinned`: it goes
        with `id_slot` (else the server picks `slot_id`, as `server_pick` said)."""
        if self.ram_shadow is not None:
            self.ram_shadow.claim(self.shadow_slots(), slot_id, prompt, predicted, pinned)

    def shadow_unclaim(self, slot_id: int) -> None:
        if self.ram_shadow is not None:
            self.ram_shadow.unclaim(slot_id)

    def shadow_dispatch(
        self, slot_id: int, held: list[int] | None, prompt: list[int], pinned: bool = True
    ) -> None:
        """A task with `prompt` goes out on `slot_id` now, which held `held` before it (None:
        not all of it known); `pinned`: with `id_slot`. The RAM-cache shadow replays it; where
        the server empties idle slots at every launch, the table empties them too, their text
        now in the RAM cache (as the shadow has it), nobody's in a slot."""
        if self.ram_shadow is not None:
            self.ram_shadow.dispatched(self.shadow_slots(), slot_id, held, prompt, pinned)
        if self.clears_idle:
            for slot in self.slots:  # SC:2641-2657 (TAG_IDLE_SLOT_CLEAR)
                if slot.slot_id != slot_id and not slot.busy and not slot.empty:
                    slot.hold([])
                    slot.tenant = slot.session = None

    def relabel(self, slot: SlotState, slot_id: int) -> None:
        """The server ran the task leased on `slot` on slot `slot_id` (it picks the slot
        itself, and took another than predicted): the two records swap ids, so `slot` holds
        what that task left, under the server's id for it, and the other record (idle, or
        leased to a task the server will have put elsewhere) takes the id predicted."""
        if slot.slot_id == slot_id or not 0 <= slot_id < len(self.slots):
            return
        other = self.slots[slot_id]
        if other is slot:
            return
        slot.slot_id, other.slot_id = slot_id, slot.slot_id
        self.slots[slot.slot_id], self.slots[other.slot_id] = slot, other
        slot.version += 1
        other.version += 1
        if self.ram_shadow is not None:
            self.ram_shadow.relabelled(other.slot_id, slot_id)

    def learn_verbose_default(self, sent_unasked: bool) -> None:
        self.verbose_default = sent_unasked

    def hold_probe_leftovers(self, left: dict[int, list[int]], report: list[dict]) -> None:
        """Slots the probe wrote and could not erase hold its prompts, which are nobody's."""
        held = {entry["id"]: entry.get("n_prompt_tokens", 0) for entry in report}
        for slot_id, tokens in left.items():
            slot = self.slots[slot_id]
            if held.get(slot_id) == len(tokens):
                slot.hold(tokens)
            slot.tenant = slot.session = None

    def learnt(
        self,
        slot_id: int,
        n_tokens: int,
        tenant: str | None,
        tokens: list[int] | None,
        hint: SlotHint | None,
    ) -> None:
        """What a slot of a table built afresh holds, as its last holder recorded it: `tenant`'s
        text (None: nobody's), `n_tokens` of it, named by `tokens` (read from a save of it), or
        else only hinted (slots/slot_learning.py)."""
        slot = self.slots[slot_id]
        if tokens and len(tokens) == n_tokens:
            slot.hold(tokens)
        else:
            slot.forget(n_tokens)
            slot.hint = hint
        slot.tenant, slot.session = tenant, None

    def reconcile(self, report: list[dict], versions: dict[int, int] | None = None) -> list[int]:
        """Align idle slots with `GET /slots`; return the ids whose content we had wrong.

        `versions` are the slots' versions from before the report was asked for: a slot the
        proxy changed since then is newer than the report, and is left alone.
        """
        corrected = []
        for entry in report:
            slot = self.slots[entry["id"]]
            if slot.busy or entry.get("is_processing"):
                continue
            if versions is not None and versions.get(slot.slot_id) != slot.version:
                continue
            held = entry.get("n_prompt_tokens", 0)
            if held != slot.n_tokens:
                if held:
                    slot.forget(held)
                else:
                    slot.hold([])
                corrected.append(slot.slot_id)
        return corrected

    def after_slot_action(self, slot_id: int, action: str | None, answer: object) -> None:
        """A client's slot action went through (no tenants: they have none): `erase` leaves
        the slot empty, `restore` holding as many tokens as the server's answer says it
        restored (`n_restored`), which the table cannot name; either way nobody's. A save
        changes nothing."""
        if action not in ("erase", "restore") or not 0 <= slot_id < len(self.slots):
            return
        slot = self.slots[slot_id]
        if action == "erase":
            slot.hold([])
        else:
            restored = None
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
                restored = orjson.loads(answer).get("n_restored")  # type: ignore[arg-type]
            slot.forget(restored if isinstance(restored, int) and restored >= 0 else UNKNOWN)
        slot.tenant = slot.session = None

    def lost(self, slot_id: int) -> None:
        """What slot `slot_id` holds is no longer known (a failed restore cleared it, or not)."""
        for slot in self.slots:
            if slot.slot_id == slot_id:
                slot.forget()

    def emptied_by_sleep(self) -> list[int]:
        """The server went to sleep, which frees its context: every idle slot is empty (a
        busy one is being woken by its request, whose answer says what it holds). Returns the
        ids of the slots that held something."""
        emptied = []
        for slot in self.slots:
            if slot.busy or slot.empty:
                continue
            slot.hold([])
            slot.tenant = slot.session = None
            emptied.append(slot.slot_id)
        return emptied

    def task_answered(self, slot_id: int) -> None:
        """The server ran a pinned task on `slot_id` (and numbered it). Where the server picks
        the slot itself, which one is known only when the answer says: the count stands, the
        slot is not noted (a slot it never ran a task on would read as a restart)."""
        self.tasks_answered += 1
        if not self.clears_idle:
            self.tasked_slots.add(slot_id)

    def new_process(self) -> None:
        """What the proxy counted of the server's tasks belongs to a process that is gone."""
        self.tasks_answered = 0
        self.tasked_slots = set()

    def clear(self) -> None:
        """The server restarted: every slot is empty."""
        for slot in self.slots:
            slot.hold([])
            slot.tenant = slot.session = None
        if self.ram_shadow is not None:
            self.ram_shadow.reset()


@dataclass(frozen=True)
class Lease:
    """A slot held by one request, from routing until its response has been read; changed only
    by the scheduler (slots/scheduler.py), as a new lease (`prepared`)."""

    table: UpstreamSlots
    slot: SlotState
    prompt: list[int]
    predicted: ReuseBounds
    queued_s: float
    isolate: bool  # the slot holds another tenant's text: the server must not reuse any of it
    # what the slot held before this request: the disk tier may archive it before it is lost
    previous: SlotContent = field(default_factory=lambda: SlotContent([], 0, None))
    # the prompt's ids are not known (`prompt` is empty): the slot will hold the tenant's text,
    # as many tokens as the server reports, none of them named
    opaque: bool = False
    # its tenant at or past its share while others were active: the prompt computed in chunks
    chunked: bool = False
    # sent without `id_slot` (`UpstreamSlots.clears_idle`): `slot` is the one the server is
    # predicted to take, and the answer's `id_slot` says which it took
    unpinned: bool = False
    # the LoRA scales its request runs under there (None: not known; upstreams/adapters.py),
    # and whether its body names them (else the server's global ones: it then keeps what the
    # slot holds, whatever it was computed under)
    adapters: Scales | None = ()
    names_scales: bool = False
