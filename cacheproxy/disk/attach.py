"""Attaching an upstream to the disk tier: does it save into the archive folder, and into which
archives may its slots be restored (the compatibility fingerprint)?

A probe save of a slot shows where the server writes; the probe's file also tells the KV layout.
A short greedy completion on that slot tells the weights apart (`fingerprint.behaviour_hash`);
the slot gets its content back from the probe file afterwards. All of it goes into the
compatibility fingerprint, which the index records; archives of an older index whose files show
this server's layout are matched to it again. No request may be running on the slot.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from cacheproxy.disk.attached import AttachedUpstream, StoreCall, reported_ms
from cacheproxy.disk.fingerprint import behaviour_hash, compatibility_fingerprint, fingerprint_facts
from cacheproxy.disk.slot_file import SlotFileError, read_kv_layout
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.settings import MIB, DiskTierSettings
from cacheproxy.upstreams.client import UpstreamClient
from cacheproxy.upstreams.slot_table import Smoothed, UpstreamSlots

log = logging.getLogger(__name__)

# a probe save at attach this large gives the save rate its first sample
MIN_TIMED_PROBE_BYTES = 1 << 20


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
        save_ms = reported_ms(answer, "save_ms")
        # a small file's time is mostly opening and closing it: it does not time the disk
        timed = save_ms > 0 and written >= MIN_TIMED_PROBE_BYTES
        return cls(written / tokens, written / save_ms if timed else None)


class Attacher:
    """Probes upstreams and fingerprints them for the disk tier. The index's calls go through
    the tier's off-on switch (`guarded`); reading and removing the probe files do not, as a
    probe that fails only leaves that upstream without the disk tier."""

    def __init__(
        self,
        store: ArchiveStore,
        client: UpstreamClient,
        settings: DiskTierSettings,
        metrics: ProxyMetrics,
        guarded: StoreCall,
    ) -> None:
        self.store = store
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.guarded = guarded

    async def attach(self, table: UpstreamSlots, slot_id: int | None) -> AttachedUpstream | None:
        """What the disk tier knows of `table`'s upstream from the start, probing `slot_id`
        (default: an empty slot, or the first); None if it cannot be used (it does not save into
        the archive folder, or does not answer). Raises DiskUnavailable when the folder or the
        index failed."""
        upstream = table.upstream
        try:
            props = await self.client.get_json(upstream, "/props")
            models = await self.client.models(upstream)
            slots = await self.client.slots(upstream)
            probed = await self._probe(table, slots, slot_id)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("disk tier off for %s: %s", upstream.base_url, exc)
            return None
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
            return None
        n_stream, behaviour, (kv_layout, state_after_kv), probe_save = probed
        facts = fingerprint_facts(props, models, slots, n_stream, behaviour, kv_layout)
        fingerprint = compatibility_fingerprint(facts)
        await self.guarded(self.store.note_fingerprint(fingerprint, facts))
        # archives indexed before the KV layout joined the fingerprint match again when their
        # files show this server's layout; the others stay unmatched until evicted
        legacy = compatibility_fingerprint({k: v for k, v in facts.items() if k != "kv_layout"})
        moved = await self.guarded(
            self.store.relabel(legacy, fingerprint, lambda path: _has_layout(path, kv_layout))
        )
        if moved:
            log.info("%d archive(s) of an older index matched to %s", moved, fingerprint)
        attached = AttachedUpstream(fingerprint, state_after_kv=state_after_kv)
        if probe_save is not None:
            # what this server's states take and how fast it writes them, from the first
            # decision on (guesses would be off by as much as KV caches and disks differ)
            attached.bytes_per_token = Smoothed(probe_save.bytes_per_token)
            if probe_save.bytes_per_ms is not None:
                attached.save_bytes_per_ms.add(probe_save.bytes_per_ms)
        self.metrics.child(self.metrics.disk_bytes_per_token, upstream.name).set(
            attached.bytes_per_token.value
        )
        self.metrics.child(self.metrics.disk_save_mib_s, upstream.name).set(
            attached.save_bytes_per_ms.value * 1000 / MIB
        )
        log.info("disk tier on for %s (%s)", upstream.base_url, fingerprint)
        return attached

    async def _probe(
        self, table: UpstreamSlots, slots: list[dict], slot_id: int | None
    ) -> tuple[int, str, tuple[str, bool], ProbeSave | None] | None:
        """Save a slot under a probe name and run the behavioural probe on it, then put its
        content back: (KV stream count, behaviour hash, KV layout and whether the state goes on
        after it, what the layout probe's save measured), or None if the file is not ours."""
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
                    await self.guarded(self.store.check())
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
    ) -> tuple[tuple[str, bool], ProbeSave | None]:
        """The KV layout (types and row sizes per layer) of `slot_id`, which must hold tokens,
        from a save of it: a restore into another layout fails; and whether the state goes on
        after the KV cache (a sliding window's cells, a recurrent state: `SlotKvLayout`). Also
        what that save measured (None: the answer did not say)."""
        answer = await self.client.post_json(
            table.upstream, f"/slots/{slot_id}?action=save", {"filename": name}
        )
        probe_save = ProbeSave.of(answer)
        try:
            layout = await self.store.kv_layout(name)
        except SlotFileError as exc:
            # a layout this parser does not know (M-RoPE cells): the same on every such server
            return (f"unparsed: {exc}", False), probe_save
        return (layout.as_fact(), layout.state_after_kv), probe_save

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


def _has_layout(path: Path, kv_layout: str) -> bool:
    try:
        return read_kv_layout(path).as_fact() == kv_layout
    except (OSError, SlotFileError):
        return False  # a missing or damaged file: `recover` and restores deal with it
