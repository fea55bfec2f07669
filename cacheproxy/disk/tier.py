"""The disk tier's I/O: archive a slot before it is overwritten, restore an archive when it pays.

llama-server writes and reads the files (`POST /slots/{id}?action=save|restore`) in its
`--slot-save-path`, which must be the archive store's folder (on several hosts, each host's
mount of one shared folder); the store decides names, quotas and matches in its index
(`cacheproxy.disk.store`, whose calls run in its own worker thread), and
`cacheproxy.disk.policy` decides what is worth it. Work happens on a slot the request has
leased, so no other request waits for it.

The tier degrades, never fails a request: an I/O or SQLite error (a read-only or full folder, a
deleted folder, an index locked past the busy timeout) turns it off, requests run without
archiving or restoring, and the next request after `disk.recheck_interval_s` checks the folder
and the index again and turns it back on when they work.

A conversation also moves between upstreams that share the archive folder and a fingerprint:
when a request is placed on one while another holds its conversation in an idle slot, the tier
saves that slot there and restores it here, when `policy.move_pays`.

It stays one module (about 1,000 lines): saving, restoring, moving, attaching and draining all go
through the same off-on-error switch and the same per-upstream attach state and measured rates,
and apart they would pass both around; the pure decisions (`policy`) and the fingerprint
(`fingerprint`) live apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp

from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.disk.archive_types import (
    Archive,
    ArchiveError,
    ArchiveRefused,
    Match,
    QuotaExceeded,
)
from cacheproxy.disk.blocks import MIN_ARCHIVE_TOKENS
from cacheproxy.disk.fingerprint import behaviour_hash, compatibility_fingerprint, fingerprint_facts
from cacheproxy.disk.policy import (
    SAVE,
    DiskRates,
    Evicted,
    MoveCosts,
    SaveCandidate,
    SaveModel,
    decide_save,
    move_pays,
    restore_pays,
    worth_saving,
)
from cacheproxy.disk.slot_file import SlotFileError, read_kv_layout
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.tracing import NO_TRACING, RequestTracer
from cacheproxy.settings import DiskTierSettings
from cacheproxy.tokens import common_prefix_length
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.rates import MeasuredRate, round_trip_sample
from cacheproxy.upstreams.slot_table import (
    Lease,
    ReuseBounds,
    SlotContent,
    SlotState,
    Smoothed,
    UpstreamSlots,
    branch_point,
)

log = logging.getLogger(__name__)
MIB = 1 << 20

# Starting guesses, replaced by measurements after the first restores (llama-server on one core
# reads a 2 MB slot file in about a millisecond; the HTTP round trip costs about as much).
INITIAL_RESTORE_BYTES_PER_MS = 500_000.0
INITIAL_SAVE_BYTES_PER_MS = 250_000.0
INITIAL_RESTORE_OVERHEAD_MS = 2.0
INITIAL_BYTES_PER_TOKEN = 1024.0
INITIAL_SAVE_OVERHEAD_MS = 2.0
# a probe save at attach this large gives the save rate its first sample
MIN_TIMED_PROBE_BYTES = 1 << 20
# saves that must have measured the disk before the cost model may drop the only copy of a
# slot: one write can be an outlier (the first into a new folder, one behind a flush of others)
MIN_SAVE_SAMPLES = 3

Quotas = Callable[[str], tuple[int | None, int | None]]  # tenant id -> (bytes, archives)
T = TypeVar("T")


class DiskUnavailable(Exception):
    """The archive folder or index failed; the tier has turned itself off for a while."""


@dataclass
class AttachedUpstream:
    """An upstream that saves into the archive folder, and what restores cost there."""

    fingerprint: str
    restore_bytes_per_ms: MeasuredRate = field(
        default_factory=lambda: MeasuredRate(INITIAL_RESTORE_BYTES_PER_MS)
    )
    save_bytes_per_ms: MeasuredRate = field(
        default_factory=lambda: MeasuredRate(INITIAL_SAVE_BYTES_PER_MS)
    )
    restore_overhead_ms: Smoothed = field(
        default_factory=lambda: Smoothed(INITIAL_RESTORE_OVERHEAD_MS)
    )
    bytes_per_token: Smoothed = field(default_factory=lambda: Smoothed(INITIAL_BYTES_PER_TOKEN))
    save_overhead_ms: Smoothed = field(default_factory=lambda: Smoothed(INITIAL_SAVE_OVERHEAD_MS))
    # other slots busy when a request is placed: they wait for its prefill or its restore
    busy_when_placed: Smoothed = field(default_factory=lambda: Smoothed(0.0))
    remeasured_at: float = float("-inf")  # the last save made only to measure the disk


@dataclass(frozen=True)
class ProbeSave:
    """What a probe save at attach tells about the server's states: their bytes per token, and
    how fast it writes them (a small state: a first sample, replaced as real saves come)."""

    bytes_per_token: float
    bytes_per_ms: float | None

    @classmethod
    def of(cls, answer: dict) -> ProbeSave | None:
        try:
            written, tokens = int(answer["n_written"]), int(answer["n_saved"])
        except (KeyError, TypeError, ValueError):
            return None
        if written <= 0 or tokens <= 0:
            return None
        server_ms = _server_ms(answer, "save_ms")
        # a small file's time is mostly opening and closing it: it does not time the disk
        timed = server_ms > 0 and written >= MIN_TIMED_PROBE_BYTES
        return cls(written / tokens, written / server_ms if timed else None)


@dataclass(frozen=True)
class MoveSources:
    """Where a conversation may be moved from: every upstream's slots, whose text a slot
    holds, and how a slot is kept from requests while it is saved (the scheduler's)."""

    tables: Sequence[UpstreamSlots]
    owner_of: Callable[[SlotState], str | None]
    lend: Callable[[SlotState], bool]
    give_back: Callable[[SlotState], None]


@dataclass(frozen=True)
class Prepared:
    """What the slot holds once the disk tier is done with it, as the request will find it."""

    predicted: ReuseBounds
    isolate: bool
    action: str  # "restore", "restore_failed" or "" (nothing restored)
    branch: int | None = None  # where the request branched off the archive restored, if it did

    @classmethod
    def as_leased(cls, lease: Lease) -> Prepared:
        """The slot as the scheduler leased it: the disk tier changed nothing."""
        return cls(lease.predicted, lease.isolate, "")


@dataclass
class DrainReport:
    """What a shutdown drain archived, and the slots worth keeping it left, each with why."""

    saved: int = 0
    left: list[str] = field(default_factory=list)
    # slots worth keeping not yet dealt with -> why, should the time run out now
    pending: dict[str, str] = field(default_factory=dict)


class DiskTier:
    def __init__(
        self,
        store: ArchiveStore,
        client: UpstreamClient,
        settings: DiskTierSettings,
        metrics: ProxyMetrics,
        quotas: Quotas,
        on_archived: Callable[[str, int], None] | None = None,
        tracer: RequestTracer = NO_TRACING,
    ) -> None:
        self.store = store
        self.tracer = tracer
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.quotas = quotas
        self.on_archived = on_archived  # (tenant id, bytes): the usage ledger counts them
        self.attached: dict[int, AttachedUpstream] = {}
        self._published: set[str] = set()  # tenants whose archive gauges are set
        self._off_until: float | None = None  # monotonic; None while the tier works
        self._off_reason = ""
        self._pending: set[int] = set()  # upstreams to attach once the tier works again
        self._recheck = asyncio.Lock()
        if store.recovery_pending:
            # nothing may be saved before the index and the folder agree again
            self._off_reason = "start-up recovery could not run"
            self._off_until = time.monotonic()

    # -- health: off on any I/O or SQLite error, back on once a check passes ------------------

    @property
    def available(self) -> bool:
        return self._off_until is None

    async def _io(self, call: Awaitable[T]) -> T:
        """Await a store call; an I/O or database error turns the tier off (DiskUnavailable)."""
        try:
            return await call
        except (OSError, *DATABASE_ERRORS) as exc:
            self._turn_off(exc)
            raise DiskUnavailable(str(exc)) from exc

    async def _quietly(self, work: Awaitable[object]) -> None:
        """Upkeep whose failure must not change what the request gets (the tier turns off)."""
        with contextlib.suppress(DiskUnavailable):
            await work

    def _turn_off(self, exc: BaseException) -> None:
        if self._off_until is None:
            log.warning(
                "disk tier off (archive folder %s, index %s): %r; requests run without archiving"
                " until a check every %.0f s passes",
                self.store.directory,
                self.store.database,
                exc,
                self.settings.recheck_interval_s,
            )
        self._off_reason = repr(exc)
        self._off_until = time.monotonic() + self.settings.recheck_interval_s

    async def ready(self) -> bool:
        """Whether the tier works now (checking the folder and index again when due)."""
        return await self._ready()

    async def usage_bytes(self) -> dict[str, int]:
        """Archive bytes by tenant."""
        usage = await self._io(self.store.usage_by_tenant())
        return {tenant_id: used for tenant_id, (used, _) in usage.items()}

    async def _ready(self) -> bool:
        """Whether the tier works now; when off and due, check the folder and index again."""
        if self._off_until is None:
            return True
        if time.monotonic() < self._off_until:
            return False
        async with self._recheck:
            if self._off_until is None:
                return True
            try:
                await self.store.check()
                # whatever happened meanwhile (a deleted folder): the index follows the folder
                report = await self.store.recover()
                self.store.recovery_pending = False
            except (OSError, *DATABASE_ERRORS) as exc:
                self._off_reason = repr(exc)
                self._off_until = time.monotonic() + self.settings.recheck_interval_s
                return False
            self._off_until = None
            log.warning("disk tier back on (%s)", report if report.changed else "nothing to mend")
        await self._quietly(self.publish_usage())
        return True

    # -- upstreams -----------------------------------------------------------------------------

    async def attach(self, table: UpstreamSlots, slot_id: int | None = None) -> bool:
        """Use the disk tier on `table`'s upstream if it saves into the archive folder.

        A probe save of `slot_id` (default: an empty slot, or the first) shows where the server
        writes; the probe's file also tells the KV layout. A short greedy completion on that
        slot tells the weights apart (`behaviour_hash`); the slot gets its content back from the
        probe file afterwards. All of it goes into the compatibility fingerprint. No request may
        be running on the slot. When the archive folder or index fails, the upstream is attached
        once the tier works again (`prepare`, on a slot the request leased).
        """
        self.attached.pop(table.index, None)
        self._pending.discard(table.index)
        if await self._ready():
            try:
                await self._io(self.store.check())
            except DiskUnavailable:
                pass
        if not self.available:
            self._pending.add(table.index)
            log.warning(
                "disk tier off for %s until %s works (%s)",
                table.upstream.base_url,
                self.store.directory,
                self._off_reason,
            )
            return False
        try:
            return await self._attach(table, slot_id)
        except DiskUnavailable:
            self._pending.add(table.index)
            return False

    async def _attach(self, table: UpstreamSlots, slot_id: int | None) -> bool:
        upstream = table.upstream
        try:
            props = await self.client.get_json(upstream, "/props")
            models = await self.client.get_json(upstream, "/v1/models")
            slots = await self.client.slots(upstream)
            probed = await self._probe(table, slots, slot_id)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("disk tier off for %s: %s", upstream.base_url, exc)
            return False
        if probed is None:
            # the folder as that server's host mounts it (the same path unless mapped)
            its_path = self.settings.save_path_of(upstream.base_url, self.store.directory)
            log.warning(
                "disk tier off for %s: it does not save into %s (start it with"
                " --slot-save-path %s%s)",
                upstream.base_url,
                self.store.directory,
                its_path,
                ""
                if its_path == self.store.directory
                else f", its mount of {self.store.directory}",
            )
            return False
        n_stream, behaviour, kv_layout, probe_save = probed
        facts = fingerprint_facts(props, models, slots, n_stream, behaviour, kv_layout)
        fingerprint = compatibility_fingerprint(facts)
        await self._io(self.store.note_fingerprint(fingerprint, facts))
        # archives indexed before the KV layout joined the fingerprint match again when their
        # files show this server's layout; the others stay unmatched until evicted
        legacy = compatibility_fingerprint({k: v for k, v in facts.items() if k != "kv_layout"})
        moved = await self._io(
            self.store.relabel(legacy, fingerprint, lambda path: _has_layout(path, kv_layout))
        )
        if moved:
            log.info("%d archive(s) of an older index matched to %s", moved, fingerprint)
        attached = AttachedUpstream(fingerprint)
        if probe_save is not None:
            # what this server's states take and how fast it writes them, from the first
            # decision on (guesses would be off by as much as KV caches and disks differ)
            attached.bytes_per_token = Smoothed(probe_save.bytes_per_token)
            if probe_save.bytes_per_ms is not None:
                attached.save_bytes_per_ms.add(probe_save.bytes_per_ms)
        self.attached[table.index] = attached
        self.metrics.disk_bytes_per_token.labels(upstream.base_url).set(
            attached.bytes_per_token.value
        )
        self.metrics.disk_save_mib_s.labels(upstream.base_url).set(
            attached.save_bytes_per_ms.value * 1000 / MIB
        )
        log.info("disk tier on for %s (%s)", upstream.base_url, fingerprint)
        return True

    async def _probe(
        self, table: UpstreamSlots, slots: list[dict], slot_id: int | None
    ) -> tuple[int, str, str, ProbeSave | None] | None:
        """Save a slot under a probe name and run the behavioural probe on it, then put its
        content back: (KV stream count, behaviour hash, KV layout, what the layout probe's save
        measured), or None if the file is not ours."""
        if not slots:
            return None
        if slot_id is None:
            empty = [entry["id"] for entry in slots if not entry.get("n_prompt_tokens")]
            slot_id = empty[0] if empty else slots[0]["id"]
        # not an archive name: a crash before the unlink leaves a file `recover` leaves alone
        name = f"probe_{secrets.token_hex(8)}.slot"
        try:
            try:
                saved = await self.client.post_json(
                    table.upstream, f"/slots/{slot_id}?action=save", {"filename": name}
                )
            except aiohttp.ClientResponseError as exc:
                if exc.status == 501:  # no --slot-save-path at all
                    return None
                if exc.status >= 500:  # it could not write: is our folder at fault?
                    await self._io(self.store.check())
                raise
            try:
                probe = await self.store.slot_file(name)
            except SlotFileError as exc:
                raise ValueError(f"its probe slot file is unreadable: {exc}") from exc
            if probe is None:
                return None
            n_stream = probe.n_stream
            layout_name = f"probe_{secrets.token_hex(8)}.slot"
            try:
                behaviour = await behaviour_hash(self.client, table.upstream, slot_id)
                # the slot now holds the probe's tokens: a save of it writes the KV layout
                layout, probe_save = await self._kv_layout(table, slot_id, layout_name)
            finally:
                await self.store.discard(layout_name)
                await self._put_back(table, slot_id, name, int(saved.get("n_saved") or 0))
            return n_stream, behaviour, layout, probe_save
        finally:
            await self.store.discard(name)

    async def _kv_layout(
        self, table: UpstreamSlots, slot_id: int, name: str
    ) -> tuple[str, ProbeSave | None]:
        """The KV layout (types and row sizes per layer) of `slot_id`, which must hold tokens,
        from a save of it: a restore into another layout fails. Also what that save measured
        (None: the answer did not say)."""
        answer = await self.client.post_json(
            table.upstream, f"/slots/{slot_id}?action=save", {"filename": name}
        )
        probe_save = ProbeSave.of(answer)
        try:
            layout = await self.store.kv_layout(name)
        except SlotFileError as exc:
            # a layout this parser does not know (M-RoPE cells): the same on every such server
            return f"unparsed: {exc}", probe_save
        return layout.as_fact(), probe_save

    async def _put_back(self, table: UpstreamSlots, slot_id: int, name: str, n_saved: int) -> None:
        """Give the slot back what it held before the probe (the probe file), or empty it."""
        try:
            if n_saved:
                await self.client.post_json(
                    table.upstream, f"/slots/{slot_id}?action=restore", {"filename": name}
                )
            else:
                await self.client.erase(table.upstream, slot_id)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "slot %d of %s lost its content to the probe: %r",
                slot_id,
                table.upstream.base_url,
                exc,
            )
            # a failed restore clears the slot; an erase may or may not have run
            table.lost(slot_id)

    def detach(self, table: UpstreamSlots) -> None:
        self.attached.pop(table.index, None)

    # -- around a request on a slot --------------------------------------------------------------

    async def prepare(
        self,
        lease: Lease,
        tenant: str,
        cache_prompt: bool,
        sources: MoveSources | None = None,
    ) -> Prepared:
        """Archive what the leased slot held if it is worth keeping; then restore the tenant's
        best archive into it if that beats what the slot would reuse, after saving the
        conversation from an idle slot of another upstream of `sources` if that pays (a move)."""
        unchanged = Prepared.as_leased(lease)
        if not await self._ready():
            return unchanged
        if lease.table.index in self._pending:
            version = lease.slot.version
            await self.attach(lease.table, lease.slot.slot_id)
            if lease.slot.version != version:  # the probe could not give the slot back
                return Prepared(ReuseBounds(0, 0), isolate=True, action="")
        attached = self.attached.get(lease.table.index)
        if attached is None:
            return unchanged
        kept = _kept_in_slot(lease)
        slot_id = lease.slot.slot_id
        attached.busy_when_placed.add(others_busy(lease.table, slot_id))
        try:
            with self.tracer.span("disk.save"):
                ram_keeps = _ram_cache_keeps(lease, self.settings.min_tokens)
                if ram_keeps and cache_prompt and not _ram_cache_holds(lease):
                    # a restore overwrites the slot without the server copying it to RAM first
                    # (server-context.cpp, SLOT_RESTORE): then only a copy there already counts
                    ram_keeps = not await self._will_restore(lease, attached, tenant)
                if ram_keeps:
                    await self._archive_beside_ram_cache(
                        lease.table, slot_id, lease.previous, kept, attached
                    )
                else:
                    await self._archive_if_worth(
                        lease.table, slot_id, lease.previous, kept, attached, evicted_by=tenant
                    )
        except DiskUnavailable:
            return unchanged  # a save that failed changed nothing in the slot
        if not cache_prompt:
            return unchanged
        if sources is not None:
            # a failed move changes nothing here: the request still gets the best archive
            await self._quietly(self._move_here(lease, attached, tenant, sources))
        try:
            with self.tracer.span("disk.restore") as stage:
                prepared = await self._restore_best(lease, attached, tenant) or unchanged
                stage.set(action=prepared.action or None)
                return prepared
        except DiskUnavailable:
            # raised only before the server reads a file: once it has, upkeep is best-effort
            return unchanged

    async def _archive_if_worth(
        self,
        table: UpstreamSlots,
        slot_id: int,
        content: SlotContent,
        kept: int,
        attached: AttachedUpstream,
        evicted_by: str | None = None,
    ) -> Archive | None:
        """Save what the slot holds if it is worth keeping and not archived already; `kept` is
        how much of it stays in the slot. `evicted_by`: the tenant whose request is about to
        overwrite it, and waits for the save: the cost model decides (a shutdown drain saves
        whatever is worth keeping)."""
        eviction = evicted_by is not None
        evicted = Evicted(content.n_tokens_at_least, kept, content.owner)
        if not worth_saving(evicted, self.settings.min_tokens):
            return None
        archived = await self.archived_prefix(content, attached)
        if content.held_whole_by(archived):
            self.metrics.archive_saves.labels("covered").inc()
            if eviction:
                self.metrics.evictions.labels("covered").inc()
            return None
        if eviction:
            candidate = dataclasses.replace(
                self.save_candidate(content, kept, attached, ahead=False),
                # a conversation is weighed whole at eviction; a branching text only up to its
                # branch point, of which an archive may hold all
                archived_tokens=0 if content.branch is None else archived,
                timed_by_other_tenant=evicted_by != content.owner,
            )
            rates = self.rates(table, attached, slot_id)
            decision = decide_save(candidate, rates, self.save_model)
            if decision != SAVE and not self.remeasure_save(decision, attached):
                self.metrics.saves_skipped.labels("eviction", decision).inc()
                self.metrics.evictions.labels("dropped").inc()
                return None
        archive = await self.save(table, slot_id, content, attached)
        if eviction:
            self.metrics.evictions.labels("dropped" if archive is None else "saved").inc()
        return archive

    async def _archive_beside_ram_cache(
        self,
        table: UpstreamSlots,
        slot_id: int,
        content: SlotContent,
        kept: int,
        attached: AttachedUpstream,
    ) -> None:
        """The server's RAM cache keeps what the slot held, so the request need not wait for a
        save to keep it; but that copy dies with a restart of the server (and under others'
        load), the disk's does not. Save it anyway when the part no archive holds yet, at
        `disk.ram_cache_loss_chance`, is worth the save to the cost model: a conversation's
        first eviction usually is, each later turn's few tokens seldom, so the saves of a
        growing conversation stay few."""
        evicted = Evicted(content.n_tokens_at_least, kept, content.owner)
        loss_chance = self.settings.ram_cache_loss_chance
        if (
            loss_chance > 0
            and content.owner is not None
            and worth_saving(evicted, self.settings.min_tokens)
        ):
            archived = await self.archived_prefix(content, attached)
            if content.held_whole_by(archived):
                self.metrics.archive_saves.labels("covered").inc()
                self.metrics.evictions.labels("covered").inc()
                return
            candidate = dataclasses.replace(
                self.save_candidate(content, kept, attached, ahead=False),
                archived_tokens=archived,
                loss_chance=loss_chance,
            )
            decision = decide_save(candidate, self.rates(table, attached, slot_id), self.save_model)
            if decision == SAVE:
                archive = await self.save(table, slot_id, content, attached)
                if archive is not None:
                    self.metrics.evictions.labels("saved").inc()
                    return
            else:
                self.metrics.saves_skipped.labels("ram_cache", decision).inc()
        self.metrics.archive_saves.labels("ram_cache").inc()
        self.metrics.evictions.labels("ram_cache").inc()

    async def _move_here(
        self, lease: Lease, attached: AttachedUpstream, tenant: str, sources: MoveSources
    ) -> None:
        """Save the tenant's conversation from the idle slot of another upstream (same
        fingerprint) that holds the most of this prompt, when that is more than this slot and
        every archive hold and `move_pays`; the restore that follows brings it here."""
        prompt = lease.prompt
        reusable = max(len(prompt) - 1, 0)
        live = 0 if lease.isolate else lease.predicted.low
        best: tuple[int, UpstreamSlots, SlotState, AttachedUpstream] | None = None
        for table in sources.tables:
            there = self.attached.get(table.index)
            if table is lease.table or not table.healthy or there is None:
                continue
            if there.fingerprint != attached.fingerprint:
                continue
            for slot in table.slots:
                if slot.busy or slot.unknown_tail != 0 or sources.owner_of(slot) != tenant:
                    continue
                shared = min(slot.shared_with(prompt), reusable)
                if best is None or shared > best[0]:
                    best = (shared, table, slot, there)
        if best is None or best[0] - live < MIN_ARCHIVE_TOKENS:
            return
        shared, table, slot, there = best
        match = await self._io(self.store.find(tenant, attached.fingerprint, prompt))
        if match is not None and min(match.n_common, reusable) >= shared:
            return  # an archive holds as much already: restoring it needs no save
        costs = MoveCosts(
            prefill_ms_per_token=lease.table.prefill_ms_per_token.value,
            save_bytes_per_ms=there.save_bytes_per_ms.value,
            save_overhead_ms=there.save_overhead_ms.value,
            restore_bytes_per_ms=attached.restore_bytes_per_ms.value,
            restore_overhead_ms=attached.restore_overhead_ms.value,
        )
        state_bytes = len(slot.known) * there.bytes_per_token.value
        if not move_pays(shared - live, state_bytes, costs):
            return
        log.info(
            "moving up to %d tokens of tenant %s from slot %d of %s to %s",
            len(slot.known),
            tenant,
            slot.slot_id,
            table.upstream.base_url,
            lease.table.upstream.base_url,
        )
        # kept from requests while it is saved; it keeps its content (what comes here is a
        # copy). The index lookup above awaited: a request may have used the slot meanwhile,
        # so what it holds, and whose it is, is checked again once nobody else can change it
        if not sources.lend(slot):
            return
        try:
            if (
                sources.owner_of(slot) != tenant
                or slot.unknown_tail != 0
                or min(slot.shared_with(prompt), reusable) < shared
            ):
                return
            content = SlotContent(list(slot.known), 0, tenant)
            await self.save(table, slot.slot_id, content, there)
        finally:
            sources.give_back(slot)

    def remeasure_save(self, decision: str, attached: AttachedUpstream) -> bool:
        """Save despite the cost model's no, to measure the disk again: its save rate, or its
        restore rate, has not been measured for `disk.remeasure_s` (saving stopped when the disk
        was slow; only a save can tell it is fast again, and only a saved archive can be
        restored to measure reads). At most one save per `remeasure_s` is spent so."""
        if decision not in ("not_worth", "restore_loses"):
            return False
        max_age_s = self.settings.remeasure_s
        stale = attached.save_bytes_per_ms.stale(max_age_s) or (
            decision == "restore_loses" and attached.restore_bytes_per_ms.stale(max_age_s)
        )
        if not stale or time.monotonic() - attached.remeasured_at < max_age_s:
            return False
        attached.remeasured_at = time.monotonic()
        self.metrics.archive_saves.labels("remeasure").inc()
        return True

    @property
    def save_model(self) -> SaveModel:
        return SaveModel(self.settings.min_tokens, self.settings.return_half_life_s)

    def save_candidate(
        self,
        content: SlotContent,
        kept: int,
        attached: AttachedUpstream,
        ahead: bool,
        quota_headroom_bytes: int | None = None,
    ) -> SaveCandidate:
        """What the cost model needs to know about saving `content`."""
        idle_s = time.monotonic() - content.last_used if content.last_used else 0.0
        if content.owner is not None:
            self.metrics.disk_continue_chance.labels(content.owner).set(content.continues)
        return SaveCandidate(
            evicted=Evicted(content.n_tokens_at_least, kept, content.owner),
            bytes=int(content.n_tokens_at_least * attached.bytes_per_token.value),
            idle_s=idle_s,
            turns=content.turns,
            quota_headroom_bytes=quota_headroom_bytes,
            ahead=ahead,
            returns_with=content.branch,
            continues=content.continues,
        )

    def rates(
        self, table: UpstreamSlots, attached: AttachedUpstream, slot_id: int | None = None
    ) -> DiskRates:
        """The measured rates of `table`'s upstream and the slots busy there besides `slot_id`
        (the one saved or restored), also published in /metrics."""
        # what a prompt token costs the server, as the router prices it (the per-request
        # figure starts from a guess and learns gradually: taking the lower of it and the
        # measured one priced the first prompts' tokens at a fraction of their cost, and the
        # first evictions were dropped)
        rates = DiskRates(
            prefill_ms_per_token=table.server_ms_per_token(),
            save_bytes_per_ms=attached.save_bytes_per_ms.value,
            restore_bytes_per_ms=attached.restore_bytes_per_ms.value,
            restore_overhead_ms=attached.restore_overhead_ms.value,
            save_overhead_ms=attached.save_overhead_ms.value,
            busy_slots=others_busy(table, slot_id),
            busy_at_return=attached.busy_when_placed.value,
            prefill_measured=table.prefill_throughput.ms_per_token() is not None,
            save_measured=attached.save_bytes_per_ms.samples >= MIN_SAVE_SAMPLES,
        )
        url = table.upstream.base_url
        metrics = self.metrics
        metrics.disk_save_mib_s.labels(url).set(rates.save_bytes_per_ms * 1000 / MIB)
        metrics.disk_restore_mib_s.labels(url).set(rates.restore_bytes_per_ms * 1000 / MIB)
        metrics.prefill_tokens_s.labels(url).set(1000 / max(table.prefill_ms_per_token.value, 1e-9))
        metrics.prefill_server_tokens_s.labels(url).set(
            1000 / max(rates.prefill_ms_per_token, 1e-9)
        )
        metrics.disk_overhead_ms.labels(url, "save").set(rates.save_overhead_ms)
        metrics.disk_overhead_ms.labels(url, "restore").set(rates.restore_overhead_ms)
        metrics.disk_busy_slots.labels(url).set(rates.busy_slots)
        metrics.disk_busy_when_placed.labels(url).set(rates.busy_at_return)
        metrics.disk_bytes_per_token.labels(url).set(attached.bytes_per_token.value)
        return rates

    async def archived_prefix(self, content: SlotContent, attached: AttachedUpstream) -> int:
        """How many of `content`'s first tokens an archive of its owner holds (0: none, or not
        exactly known)."""
        if content.unknown_tail != 0 or content.owner is None:
            return 0
        found = await self._io(self.store.find(content.owner, attached.fingerprint, content.known))
        return 0 if found is None else found.n_common

    async def save(
        self,
        table: UpstreamSlots,
        slot_id: int,
        content: SlotContent,
        attached: AttachedUpstream,
    ) -> Archive | None:
        """Save the slot into a new archive of `content.owner`, within its quota.

        Raises DiskUnavailable when the folder or the index failed (the slot is unchanged)."""
        owner = content.owner
        if owner is None:
            return None
        quota_bytes, quota_archives = self.quotas(owner)
        expected = max(int(content.n_tokens_at_least * attached.bytes_per_token.value), 1)
        started = time.perf_counter()
        try:
            reservation = await self._io(
                self.store.reserve(owner, expected, quota_bytes, quota_archives)
            )
        except ArchiveError as exc:  # larger than a quota allows, or than the free disk space
            log.info("not archiving slot %d of %s: %s", slot_id, table.upstream.base_url, exc)
            self.metrics.archive_saves.labels("over_quota").inc()
            return None
        try:
            await self._io(self.store.unlink(reservation.paths_to_unlink))
        except DiskUnavailable:
            await self._quietly(self._io(self.store.abort(reservation)))
            self.metrics.archive_saves.labels("failed").inc()
            raise
        try:
            posted = time.perf_counter()
            busy_before = others_busy(table, slot_id)
            answer = await self.client.post_json(
                table.upstream,
                f"/slots/{slot_id}?action=save",
                {"filename": reservation.file_name},
            )
            server_ms = _server_ms(answer, "save_ms")
            waiting = busy_before + others_busy(table, slot_id)
            elapsed_ms = (time.perf_counter() - posted) * 1000
            if (trip := round_trip_sample(elapsed_ms, server_ms, waiting)) is not None:
                attached.save_overhead_ms.add(trip)
            self._count_stall(table, slot_id, "save", server_ms)
            tokens = content.known if content.unknown_tail == 0 else None
            if tokens is not None and answer.get("n_saved") != len(tokens):
                tokens = None  # the slot held something else: trust the file
            committed = await self._io(
                self.store.commit(
                    reservation, tokens, int(answer["n_written"]), attached.fingerprint
                )
            )
        except ArchiveRefused as exc:  # too short, or media: commit released the reservation
            log.info("slot %d not archived: %s", slot_id, exc)
            self.metrics.archive_saves.labels("refused").inc()
            return None
        except QuotaExceeded as exc:  # over quota once its true size was known
            log.info("archive of slot %d dropped: %s", slot_id, exc)
            self.metrics.archive_saves.labels("over_quota").inc()
            return None
        except ArchiveError as exc:  # the file is not what the table said, or it came too late
            log.warning("archive of slot %d dropped: %s", slot_id, exc)
            self.metrics.archive_saves.labels("failed").inc()
            return None
        # the server's answer was unusable (no store error is among these)
        except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            log.warning("archiving slot %d of %s failed: %r", slot_id, table.upstream.base_url, exc)
            self.metrics.archive_saves.labels("failed").inc()
            await self._io(self.store.abort(reservation))
            if isinstance(exc, aiohttp.ClientResponseError) and exc.status >= 500:
                # llama-server could not write the file: if our folder is at fault, turn off
                await self._io(self.store.check())
            return None
        except DiskUnavailable:
            self.metrics.archive_saves.labels("failed").inc()
            await self._quietly(self._io(self.store.abort(reservation)))
            raise
        await self._quietly(self._io(self.store.unlink(committed.paths_to_unlink)))
        archive = committed.archive
        if archive.n_tokens:
            attached.bytes_per_token.add(archive.bytes / archive.n_tokens)
        with contextlib.suppress(KeyError, TypeError, ValueError):  # no timings: no sample
            attached.save_bytes_per_ms.add(
                archive.bytes / float(answer["timings"]["save_ms"]), self.settings.remeasure_s
            )
        self.metrics.archive_saves.labels("saved").inc()
        self.metrics.archive_saved_bytes.inc(archive.bytes)
        self.metrics.archive_save_seconds.observe(time.perf_counter() - started)
        if self.on_archived is not None:
            self.on_archived(owner, archive.bytes)
        await self._quietly(self.publish_usage())
        return archive

    async def _restore_best(
        self, lease: Lease, attached: AttachedUpstream, tenant: str
    ) -> Prepared | None:
        choice = await self._restore_choice(lease, attached, tenant, count=True)
        if choice is None:
            return None
        return await self._restore(lease, attached, *choice)

    async def _will_restore(self, lease: Lease, attached: AttachedUpstream, tenant: str) -> bool:
        """Whether `_restore_best` would restore an archive into the leased slot as things
        are now (asked before the save that comes first; counts nothing)."""
        return await self._restore_choice(lease, attached, tenant, count=False) is not None

    async def _restore_choice(
        self, lease: Lease, attached: AttachedUpstream, tenant: str, count: bool
    ) -> tuple[Match, int] | None:
        """The tenant's archive worth restoring into the leased slot, and how many prompt
        tokens the server may reuse; None: none is."""
        prompt = lease.prompt
        live = 0 if lease.isolate else lease.predicted.low
        reusable = max(len(prompt) - 1, 0)  # the server always decodes the last prompt token
        if reusable - live < MIN_ARCHIVE_TOKENS:
            return None
        match = await self._io(self.store.find(tenant, attached.fingerprint, prompt))
        if match is None:
            return None
        gain = min(match.n_common, reusable) - live
        if gain < MIN_ARCHIVE_TOKENS:
            return None  # the slot already holds about as much of the prompt
        costs = self.rates(lease.table, attached, lease.slot.slot_id).restore_costs()
        if not restore_pays(gain, match.archive.bytes, costs):
            if not attached.restore_bytes_per_ms.stale(self.settings.remeasure_s):
                if count:
                    self.metrics.archive_restores.labels("not_worth").inc()
                return None
            # the rate that said no is old: the disk may be fast again, and only a restore
            # can tell (at most one such request per `remeasure_s` pays the old rate)
            if count:
                self.metrics.archive_restores.labels("remeasure").inc()
        return match, reusable

    async def _restore(
        self, lease: Lease, attached: AttachedUpstream, match: Match, reusable: int
    ) -> Prepared:
        archive, slot = match.archive, lease.slot
        started = time.perf_counter()
        busy_before = others_busy(lease.table, slot.slot_id)
        if not await self._io(self.store.intact(archive, match.tokens)):
            # checked before the server reads it: the slot keeps what it holds
            log.warning("archive %s is damaged or replaced on disk: dropped", archive.id)
            await self._quietly(self._drop(archive))
            return Prepared(lease.predicted, lease.isolate, "restore_failed")
        try:
            answer = await self.client.post_json(
                lease.table.upstream,
                f"/slots/{slot.slot_id}?action=restore",
                {"filename": archive.file_name},
            )
            restored = answer.get("n_restored")
        except aiohttp.ClientResponseError as exc:
            if exc.status != 400:
                raise
            # llama-server cleared the slot: the archive is unusable, the request runs cold
            log.warning("archive %s could not be restored (%s): dropped", archive.id, exc.message)
            return await self._restore_failed(archive, lease, erase=False)
        if restored != archive.n_tokens:
            # the file held other tokens than its row says: nothing of it may be trusted
            log.warning(
                "archive %s held %s tokens, not %d: dropped", archive.id, restored, archive.n_tokens
            )
            return await self._restore_failed(archive, lease, erase=True)
        elapsed_ms = (time.perf_counter() - started) * 1000
        server_ms = _server_ms(answer, "restore_ms")
        self._count_stall(lease.table, slot.slot_id, "restore", server_ms)
        if server_ms > 0:
            attached.restore_bytes_per_ms.add(archive.bytes / server_ms, self.settings.remeasure_s)
        waiting = busy_before + others_busy(lease.table, slot.slot_id)
        if (trip := round_trip_sample(elapsed_ms, server_ms, waiting)) is not None:
            attached.restore_overhead_ms.add(trip)
        await self._quietly(self._io(self.store.touch(archive.id)))
        self.metrics.archive_restores.labels("restored").inc()
        self.metrics.archive_restored_bytes.inc(archive.bytes)
        self.metrics.archive_restore_seconds.observe(elapsed_ms / 1000)
        reuse = min(match.n_common, reusable)
        branch = branch_point(archive.n_tokens, reuse)
        return Prepared(ReuseBounds(reuse, reuse), isolate=False, action="restore", branch=branch)

    def _count_stall(
        self, table: UpstreamSlots, slot_id: int, action: str, server_ms: float
    ) -> None:
        """llama-server saved or restored inside its main loop for `server_ms`: every other
        slot busy then waited as long."""
        waiting = others_busy(table, slot_id)
        self.metrics.disk_stall_seconds.labels(action).inc(server_ms / 1000)
        self.metrics.disk_stall_slot_seconds.labels(action).inc(waiting * server_ms / 1000)

    async def _drop(self, archive: Archive) -> None:
        self.metrics.archive_restores.labels("failed").inc()
        await self._io(self.store.remove(archive.id))
        await self.publish_usage()

    async def _restore_failed(self, archive: Archive, lease: Lease, erase: bool) -> Prepared:
        await self._quietly(self._drop(archive))
        if erase:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await self.client.erase(lease.table.upstream, lease.slot.slot_id)
        return Prepared(ReuseBounds(0, 0), isolate=erase, action="restore_failed")

    # -- shutdown ------------------------------------------------------------------------------

    async def drain(
        self,
        tables: list[UpstreamSlots],
        owner_of: Callable[[SlotState], str | None],
        deadline: float | None = None,
    ) -> DrainReport:
        """Archive every idle slot worth keeping (at shutdown, when no request runs), until
        `deadline` (`time.monotonic()`; None: no limit). Upstreams are drained side by side, so a
        stuck one does not hold up the others; what could not be archived is in the report."""
        report = DrainReport()
        if not await self._ready():
            log.warning("drain: the disk tier is off (folder or index failing): no slot archived")
            return report
        drains = [
            asyncio.create_task(self._drain_upstream(table, owner_of, report), name="disk-drain")
            for table in tables
        ]
        if not drains:
            return report
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        _, late = await asyncio.wait(drains, timeout=timeout)
        for task in late:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
        for task in drains:
            if not task.cancelled() and task.exception() is not None:
                log.error("drain failed", exc_info=task.exception())
        # whatever was still to do when the time ran out, or when a drain failed
        for slot_name, reason in report.pending.items():
            report.left.append(f"{slot_name} ({reason})")
        report.pending.clear()
        return report

    async def _drain_upstream(
        self,
        table: UpstreamSlots,
        owner_of: Callable[[SlotState], str | None],
        report: DrainReport,
    ) -> None:
        attached = self.attached.get(table.index)
        if attached is None:
            return  # no disk tier on this upstream: nothing was ever to be archived
        worth: list[tuple[SlotState, SlotContent, str]] = []
        for slot in table.slots:
            content = SlotContent(slot.known, slot.unknown_tail, owner_of(slot))
            # nothing of it stays: the server may be stopped or replaced next
            if worth_saving(
                Evicted(content.n_tokens_at_least, 0, content.owner), self.settings.min_tokens
            ):
                name = (
                    f"slot {slot.slot_id} of {table.upstream.base_url}: tenant {content.owner},"
                    f" {content.n_tokens_at_least} tokens"
                )
                worth.append((slot, content, name))
        for slot, _, name in worth:
            report.pending[name] = "time ran out"
            if not table.healthy:
                report.pending[name] = "upstream not answering"
            elif slot.busy:
                report.pending[name] = "still busy"
        if not table.healthy:
            return
        for slot, content, name in worth:
            if slot.busy:
                continue
            report.pending[name] = "save under way when the time ran out"
            try:
                archive = await self._archive_if_worth(table, slot.slot_id, content, 0, attached)
            except DiskUnavailable:
                report.pending[name] = "disk tier off"
                return
            del report.pending[name]
            report.saved += archive is not None

    # -- figures -------------------------------------------------------------------------------

    async def publish_usage(self) -> None:
        """Set the per-tenant archive gauges (a save may have evicted anyone's archives)."""
        usage = await self._io(self.store.usage_by_tenant())
        for tenant_id in self._published - usage.keys():
            self.metrics.archive_bytes.labels(tenant_id).set(0)
            self.metrics.archive_count.labels(tenant_id).set(0)
        for tenant_id, (bytes_used, count) in usage.items():
            self.metrics.archive_bytes.labels(tenant_id).set(bytes_used)
            self.metrics.archive_count.labels(tenant_id).set(count)
        self._published = set(usage)


def others_busy(table: UpstreamSlots, slot_id: int | None) -> int:
    """Slots of the upstream busy now besides `slot_id`: each waits for a save or restore the
    server runs now."""
    return sum(1 for slot in table.slots if slot.busy and slot.slot_id != slot_id)


def _kept_in_slot(lease: Lease) -> int:
    """How much of what the slot held before this request stays in it: the prefix it shares
    with the prompt. Reuse the server's RAM cache brings in replaces the slot's content rather
    than keeping it, so the predicted reuse counts only as far as that prefix goes (an opaque
    prompt's ids are unknown: its prediction is all there is)."""
    if lease.isolate:
        return 0
    if lease.opaque:
        return lease.predicted.low
    return min(lease.predicted.low, common_prefix_length(lease.previous.known, lease.prompt))


def _ram_cache_holds(lease: Lease) -> bool:
    """The server's RAM cache holds all of what the slot held already (its shadow says so)."""
    shadow = lease.table.ram_shadow
    return shadow is not None and shadow.keeps(lease.previous.known)


def _ram_cache_keeps(lease: Lease, min_tokens: int) -> bool:
    """The server's own RAM cache will hold all of what the slot held (its shadow says so):
    saving it to disk too would cost the request a save of a state the server keeps itself."""
    shadow, previous, slot = lease.table.ram_shadow, lease.previous, lease.slot
    if shadow is None or previous.unknown_tail != 0 or len(previous.known) < min_tokens:
        return False
    return shadow.will_keep(lease.table.shadow_slots(), slot.slot_id, previous.known, lease.prompt)


def _server_ms(answer: dict, timing: str) -> float:
    """A time llama-server reports in an answer's `timings` (0 when it reports none)."""
    try:
        return max(float((answer.get("timings") or {}).get(timing) or 0.0), 0.0)
    except (TypeError, ValueError):
        return 0.0


def _has_layout(path: Path, kv_layout: str) -> bool:
    try:
        return read_kv_layout(path).as_fact() == kv_layout
    except (OSError, SlotFileError):
        return False  # a missing or damaged file: `recover` and restores deal with it
