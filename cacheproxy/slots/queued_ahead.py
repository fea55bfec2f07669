"""The busy slots that requests queued ahead wait for, within one pass over the queue (pure).

A request planned to wait for a busy slot takes it when it frees, so a request after it that
would wait for the same slot waits for both. Without that, every queued request would wait for
the busy slot that holds the most of a shared prefix while the idle ones stayed idle, and each
would be planned again at every release. Each wait is kept with how long its request is
expected to hold the slot: the prompt it leaves to compute there, at the server's measured rate,
then the time requests hold a slot after their prompt. A request of another tenant sees the
upstream's mean request time instead: what another tenant sent never shows in a decision.
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheproxy.slots.routing import SlotCandidate, WaitForSlot
from cacheproxy.slots.slot_views import SlotKey
from cacheproxy.upstreams.slot_table import UpstreamSlots


class QueuedAhead:
    def __init__(self) -> None:
        self._holds: dict[SlotKey, list[tuple[str, float]]] = {}

    def waits(
        self,
        plan: WaitForSlot,
        tenant: str,
        n_prompt_tokens: int,
        views: Sequence[SlotCandidate],
        tables: Sequence[UpstreamSlots],
    ) -> None:
        """A request of `tenant` was planned to wait for `plan`'s slot (seen as `views`)."""
        key = (plan.upstream, plan.slot_id)
        reuse = next((view.reuse for view in views if (view.upstream, view.slot_id) == key), 0)
        table = tables[plan.upstream]
        prompt_s = max(n_prompt_tokens - reuse, 0) * table.server_ms_per_token() / 1000
        self._holds.setdefault(key, []).append((tenant, prompt_s + table.after_prefill_s.value))

    def seconds(self, tenant: str, tables: Sequence[UpstreamSlots]) -> dict[SlotKey, float]:
        """How long the requests queued ahead hold each slot they wait for, as a request of
        `tenant` may know it."""
        return {
            key: sum(
                hold if holder == tenant else tables[key[0]].request_s.value
                for holder, hold in holds
            )
            for key, holds in self._holds.items()
        }
