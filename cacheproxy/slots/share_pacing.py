"""The slot share's records of the leases, and the chunks it holds back.

The rules are pure and elsewhere: whether a tenant may take an idle slot (slot_share.py),
whether its prompt is computed in chunks and whether its next chunk waits (chunked_prefill.py),
who is active and when that changes (share_window.py). This keeps what they read:

- the holders: each leased slot with its tenant and the time its prompt is expected to be
  computed (from the upstream's measured rate; the first streamed event, when it comes);
- each tenant's last activity (a request arrived or ended) and the share it came with;
- the chunks paused for another tenant's prompt, woken when a slot is given back or a prompt
  ends sooner than expected.

The scheduler tells it what happens to its leases (`arrived`, `leased`, `given_back`,
`prefill_ended`) and asks it before a grant (`within_share`, `in_chunks`) and after a dispatch
that held a tenant back (`expiry`). It reads the scheduler's queue for who is waiting. Under the
global FIFO (no fair share) nobody is held to a share and no prompt is chunked.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

from cacheproxy.slots.chunked_prefill import in_chunks, yields_to
from cacheproxy.slots.fair_queue import FairQueue, Share
from cacheproxy.slots.share_window import (
    Holders,
    LastActive,
    active_tenants,
    others_prefill_left,
    share_expiry,
)
from cacheproxy.slots.slot_share import TenantSlots, may_take
from cacheproxy.slots.slot_views import any_idle_slot
from cacheproxy.slots.waiter import Waiter
from cacheproxy.upstreams.slot_table import SlotState, UpstreamSlots


class SharePacing:
    def __init__(
        self,
        queue: FairQueue,
        clock: Callable[[], float],
        window_s: float,
        chunked_prefill: bool,
    ) -> None:
        self._queue = queue  # the scheduler's: who waits, and whether shares apply at all
        self.clock = clock
        self.window_s = window_s
        self.chunked_prefill = chunked_prefill  # see `Lease.chunked`
        self.holders: Holders = {}
        self._last_active: LastActive = {}
        self._chunk_pauses: list[asyncio.Future[None]] = []  # woken when a slot is given back

    # -- what happens to the leases ------------------------------------------------------

    def arrived(self, tenant: str, at: float, share: Share) -> None:
        self._last_active[tenant] = (at, share)

    def leased(self, slot: SlotState, tenant: str, prefill_until: float) -> None:
        self.holders[id(slot)] = (tenant, prefill_until)

    def given_back(self, slot: SlotState, now: float) -> float:
        """`slot` is no longer leased: its holder was active until now. Returns when its prompt
        was computed, as far as known (inf: not known)."""
        tenant, prefill_end = self.holders.pop(id(slot), (None, math.inf))
        if tenant is not None and tenant in self._last_active:
            self._last_active[tenant] = (now, self._last_active[tenant][1])
        if self._chunk_pauses:
            self._wake_chunk_pauses()  # a prompt the chunks paused for may be done
        return prefill_end

    def prefill_ended(self, slot: SlotState) -> bool:
        """The first token of the request on `slot` came: its prompt is computed, whatever the
        estimate said. True when that is sooner than expected: a tenant held to one prompt at a
        time may start its next, and the chunks paused for this one go on."""
        held = self.holders.get(id(slot))
        now = self.clock()
        if held is None:
            return False
        # kept even when the estimate passed earlier: the time after the prompt is measured
        # from here (`SlotScheduler.release`)
        self.holders[id(slot)] = (held[0], now)
        if held[1] <= now:
            return False
        self._wake_chunk_pauses()
        return True

    async def chunk_turn(
        self, slot: SlotState, remaining: int, rate_s: float, tables: Sequence[UpstreamSlots]
    ) -> None:
        """Wait, before the next chunk of the prompt leased `slot` computes, while another
        tenant within its share has a prompt being computed; then mark the `remaining` tokens
        (at `rate_s` each) as being computed, so the tenant starts no other prompt meanwhile."""
        tenant = self.holders.get(id(slot), (slot.tenant or "", 0.0))[0]
        while True:
            now = self.clock()
            pause = self._chunk_pause(tenant, now, tables)
            # still this tenant's one prompt in its prefill while it pauses
            self.holders[id(slot)] = (tenant, now + pause + remaining * rate_s)
            if pause <= 0:
                return
            # until the prompt is expected to be computed, or sooner if its request ends
            woken = asyncio.get_running_loop().create_future()
            self._chunk_pauses.append(woken)
            try:
                await asyncio.wait_for(woken, pause)
            except TimeoutError:
                pass
            finally:
                if woken in self._chunk_pauses:
                    self._chunk_pauses.remove(woken)

    # -- what the scheduler asks ---------------------------------------------------------

    def within_share(
        self, tenant: str, now: float, tables: Sequence[UpstreamSlots], count: int = 1
    ) -> bool:
        """Whether a request of `tenant` may take `count` idle slots at once (slot_share.py);
        always under the global FIFO, which knows no shares."""
        if not self._queue.fair:
            return True
        last_active = self._last_active
        if count == 1 and len(last_active) == 1 and tenant in last_active and any_idle_slot(tables):
            # the tenant alone in the window (it is in it: it waits): every idle slot is its
            # to take (`may_take`), and nothing in the window is old enough to forget but it
            return True
        healthy = [slot for table in tables if table.healthy for slot in table.slots]
        idle = sum(not slot.busy for slot in healthy)
        return may_take(tenant, self._active_tenants(now), idle, len(healthy), count)

    def alone(self, tenant: str, now: float) -> bool:
        """Whether `tenant` is the only tenant active for the slot share (waiting, holding a
        slot, or active within the window): no other's request wants the next slot freed."""
        if self._last_active.keys() <= {tenant}:
            return True  # the common case, without the window's reckoning
        return self._active_tenants(now).keys() <= {tenant}

    def in_chunks(self, waiter: Waiter, now: float, tables: Sequence[UpstreamSlots]) -> bool:
        """Whether the waiter's prompt, about to take a slot, is to be computed in chunks
        (chunked_prefill.py): its ids are known and may be reused, and its tenant holds its
        share while others are active."""
        if (
            not self.chunked_prefill
            or not self._queue.fair
            or len(self._last_active) <= 1  # alone: never (and nothing to compute)
            or waiter.opaque
            or not waiter.cache_prompt
            or not waiter.patient
        ):
            return False
        return in_chunks(waiter.tenant, self._active_tenants(now), _healthy_slots(tables))

    def expiry(self, now: float) -> float | None:
        """When a tenant held back may take more (share_window.py): the time to plan again."""
        return share_expiry(
            self.holders, self._last_active, self._queue.tenants(), now, self.window_s
        )

    # -------------------------------------------------------------------------------------

    def _active_tenants(self, now: float) -> dict[str, TenantSlots]:
        """The tenants active for the slot share, and what they hold (share_window.py)."""
        active, quiet = active_tenants(
            self.holders, self._last_active, self._queue.tenants(), now, self.window_s
        )
        for tenant in quiet:
            del self._last_active[tenant]  # gone quiet: forget it
        return active

    def _chunk_pause(self, tenant: str, now: float, tables: Sequence[UpstreamSlots]) -> float:
        """Seconds until the first prompt of another tenant within its share is expected to
        be computed, when one is being computed (0: none)."""
        if not self._queue.fair:
            return 0.0
        if not yields_to(tenant, self._active_tenants(now), _healthy_slots(tables)):
            return 0.0
        return others_prefill_left(tenant, self.holders, now)

    def _wake_chunk_pauses(self) -> None:
        for woken in self._chunk_pauses:
            if not woken.done():
                woken.set_result(None)
        self._chunk_pauses.clear()


def _healthy_slots(tables: Sequence[UpstreamSlots]) -> int:
    return sum(len(table.slots) for table in tables if table.healthy)
