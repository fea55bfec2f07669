"""What the save cost model (`policy.decide_save`) is told, by the tier's saves on eviction and
by archive-ahead alike: the measured rates of an attached upstream and the slots busy there now
(also published in /metrics), a slot's content as a save candidate, the model's settings, and
when to save anyway to measure the disk again; and what each save or restore the server ran
cost: its round trip, and the slots that waited for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cacheproxy.disk.attached import AttachedUpstream, reported_ms
from cacheproxy.disk.policy import DiskRates, Evicted, SaveCandidate, SaveModel
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.settings import MIB, DiskTierSettings
from cacheproxy.upstreams.rates import batch_wait_sample, round_trip_sample
from cacheproxy.upstreams.slot_table import SlotContent, Smoothed, UpstreamSlots

# saves that must have measured the disk before the cost model may drop the only copy of a
# slot: one write can be an outlier (the first into a new folder, one behind a flush of others)
MIN_SAVE_SAMPLES = 3


class SaveCosts:
    """The save cost model's inputs from what the disk tier measured, and its settings."""

    def __init__(self, settings: DiskTierSettings, metrics: ProxyMetrics) -> None:
        self.settings = settings
        self.metrics = metrics

    def remeasure_due(self, attached: AttachedUpstream) -> Callable[[str], bool]:
        """Whether a save the cost model declined (its answer the argument) is made anyway, to
        measure the disk again: its save rate, or its restore rate, has not been measured for
        `disk.remeasure_s` (saving stopped when the disk was slow; only a save can tell it is
        fast again, and only a saved archive can be restored to measure reads). At most one
        save per `remeasure_s` is spent so (`remeasured`; two saves choosing at once may both
        be). Pure once made: it is asked in the store's worker thread."""
        max_age_s = self.settings.remeasure_s
        if time.monotonic() - attached.remeasured_at < max_age_s:
            return lambda decision: False
        saves_stale = attached.save_bytes_per_ms.stale(max_age_s)
        restores_stale = attached.restore_bytes_per_ms.stale(max_age_s)

        def due(decision: str) -> bool:
            if decision not in ("not_worth", "restore_loses"):
                return False
            return saves_stale or (decision == "restore_loses" and restores_stale)

        return due

    def remeasured(self, attached: AttachedUpstream) -> None:
        """A save the model declined was made to measure the disk (`remeasure_due`)."""
        attached.remeasured_at = time.monotonic()
        self.metrics.child(self.metrics.archive_saves, "remeasure").inc()

    @property
    def save_model(self) -> SaveModel:
        return SaveModel(
            self.settings.min_tokens, self.settings.return_half_life_s, self.settings.always_save
        )

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
            self.metrics.child(self.metrics.disk_continue_chance, content.owner).set(
                content.continues
            )
        returns_with, continues = content.branch, content.continues
        if attached.state_after_kv:
            # restored only for a request that continues all of it: one that branches gets
            # nothing of it (`policy.restore_is_whole`)
            returns_with, continues = 0, content.continues_exactly
        return SaveCandidate(
            evicted=Evicted(content.n_tokens_at_least, kept, content.owner),
            bytes=int(content.n_tokens_at_least * attached.bytes_per_token.value),
            idle_s=idle_s,
            turns=content.turns,
            quota_headroom_bytes=quota_headroom_bytes,
            ahead=ahead,
            returns_with=returns_with,
            continues=continues,
        )

    def rates(
        self, table: UpstreamSlots, attached: AttachedUpstream, slot_id: int | None = None
    ) -> DiskRates:
        """The measured rates of `table`'s upstream and the slots busy there besides `slot_id`
        (the one saved or restored), also published in /metrics."""
        rates = self.measured(table, attached, slot_id)
        url = table.upstream.name  # a router's model instances apart
        metrics = self.metrics
        metrics.child(metrics.disk_save_mib_s, url).set(rates.save_bytes_per_ms * 1000 / MIB)
        metrics.child(metrics.disk_restore_mib_s, url).set(rates.restore_bytes_per_ms * 1000 / MIB)
        metrics.child(metrics.prefill_tokens_s, url).set(
            1000 / max(table.prefill_ms_per_token.value, 1e-9)
        )
        metrics.child(metrics.prefill_server_tokens_s, url).set(
            1000 / max(rates.prefill_ms_per_token, 1e-9)
        )
        metrics.child(metrics.disk_overhead_ms, url, "save").set(rates.save_overhead_ms)
        metrics.child(metrics.disk_overhead_ms, url, "restore").set(rates.restore_overhead_ms)
        metrics.child(metrics.disk_overhead_ms, url, "batch_wait").set(rates.batch_wait_ms)
        metrics.child(metrics.disk_busy_slots, url).set(rates.busy_slots)
        metrics.child(metrics.disk_busy_when_placed, url).set(rates.busy_at_return)
        metrics.child(metrics.disk_bytes_per_token, url).set(attached.bytes_per_token.value)
        return rates

    def measured(
        self, table: UpstreamSlots, attached: AttachedUpstream, slot_id: int | None = None
    ) -> DiskRates:
        """`rates`, not published."""
        # what a prompt token costs the server, as the router prices it (the per-request
        # figure starts from a guess and learns gradually: taking the lower of it and the
        # measured one priced the first prompts' tokens at a fraction of their cost, and the
        # first evictions were dropped)
        return DiskRates(
            prefill_ms_per_token=table.server_ms_per_token(),
            save_bytes_per_ms=attached.save_bytes_per_ms.value,
            restore_bytes_per_ms=attached.restore_bytes_per_ms.value,
            restore_overhead_ms=attached.restore_overhead_ms.value,
            save_overhead_ms=attached.save_overhead_ms.value,
            busy_slots=others_busy(table, slot_id),
            busy_at_return=attached.busy_when_placed.value,
            prefill_measured=table.prefill_throughput.ms_per_token() is not None,
            save_measured=attached.save_bytes_per_ms.samples >= MIN_SAVE_SAMPLES,
            # archives cut into blocks are put together for a restore; whole files are not
            assemble_bytes_per_ms=(
                attached.assemble_bytes_per_ms.value if self.settings.blocks else float("inf")
            ),
            whole_copies=self.settings.blocks and self.settings.whole_copies,
            batch_wait_ms=attached.batch_wait_ms.value,
        )

    def server_ran(
        self,
        table: UpstreamSlots,
        slot_id: int,
        action: str,
        answer: dict,
        elapsed_ms: float,
        busy_before: int,
        overhead: Smoothed,
        batch_wait: Smoothed,
    ) -> float:
        """llama-server ran a save or restore (`action`) of `slot_id`, answered with `answer`
        after `elapsed_ms`: the time it reports spent inside its main loop (returned, in ms),
        which every other slot busy then waited as well (counted in /metrics), and the round
        trip around it, a sample for `overhead` when no other slot shared the server
        (`busy_before`: the slots busy when it was asked); beside busy slots, what it waited
        for the batch under way, a sample for `batch_wait`."""
        server_ms = reported_ms(answer, f"{action}_ms")
        busy_now = others_busy(table, slot_id)
        busy = busy_before + busy_now
        if (trip := round_trip_sample(elapsed_ms, server_ms, busy)) is not None:
            overhead.add(trip)
        if (wait := batch_wait_sample(elapsed_ms, server_ms, busy, overhead.value)) is not None:
            batch_wait.add(wait)
        self.metrics.child(self.metrics.disk_round_trip_seconds, action).observe(elapsed_ms / 1000)
        self.metrics.child(self.metrics.disk_stall_seconds, action).inc(server_ms / 1000)
        self.metrics.child(self.metrics.disk_stall_slot_seconds, action).inc(
            busy_now * server_ms / 1000
        )
        return server_ms


def others_busy(table: UpstreamSlots, slot_id: int | None) -> int:
    """Slots of the upstream busy now besides `slot_id`: each waits for a save or restore the
    server runs now."""
    return sum(1 for slot in table.slots if slot.busy and slot.slot_id != slot_id)
