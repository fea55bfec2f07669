"""A request waiting for a slot, as the scheduler keeps it, and the whole-upstream lease it may
be handed (a one-slot `Lease` is the slot table's, upstreams/slot_table.py).

The waiter carries the request's terms (read by the views for the routing policy, slot_views.py,
and by the fair queue) and the future its lease comes through. Plain data: the scheduler alone
creates and changes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from cacheproxy.slots.fair_queue import EQUAL_SHARE, Share
from cacheproxy.slots.routing import Restorable
from cacheproxy.upstreams.adapters import Requested
from cacheproxy.upstreams.slot_table import Lease, UpstreamSlots

# by upstream index, the archive the disk tier would restore for the waiter's prompt
FindRestorable = Callable[[], Awaitable[Mapping[int, Restorable]]]

# why a request waits for a slot: every slot it may take is busy; it waits for a busy slot
# whose reuse is worth the wait (the routing policy's choice); for the slot its client named;
# for a slot being saved in the background; for a whole upstream; or its tenant is at its share
WAIT_REASONS = ("slots_busy", "busy_slot_chosen", "named_slot", "saving", "whole_upstream", "share")


@dataclass(eq=False)
class Waiter:
    prompt: list[int]
    tenant: str
    session: str | None
    cache_prompt: bool
    exclusive: bool  # it wants a whole upstream (an `UpstreamLease`)
    arrived: float
    public_prefix_length: int = 0  # the prompt starts with an admin's public prefix this long
    opaque: bool = False  # the prompt's ids are not known
    patient: bool = True  # False: never wait for a busy slot (its siblings may hold it)
    share: Share = EQUAL_SHARE  # frozen: one default serves every waiter, none is built
    slot_id: int | None = None  # the slot the client named (`id_slot`), when it may choose
    # slots it takes at once, its lease a list (a split request's tasks of one prompt, which
    # run side by side); None: one slot, its lease alone
    count: int | None = None
    future: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    wait_deadline: float | None = None  # set while waiting for one busy slot
    # why it is waiting, as last planned (one of `WAIT_REASONS`; None: served as it arrived):
    # its wait is counted under it
    waiting_for: str | None = None
    # the upstreams it may be placed on, by their table index (None: any); model_admission.py
    tables: frozenset[int] | None = None
    # the disk tier's lookup of the tenant's archive for its prompt, asked once it would wait
    # for a busy slot (None: no disk tier, or asked already), and its answer
    find_restorable: FindRestorable | None = None
    restorable: Mapping[int, Restorable] = field(default_factory=dict)
    # the most tokens its task may generate (None: no bound known): what it leaves on its slot
    generates_at_most: int | None = None
    # the LoRA scales its body names (None: the server's global ones; upstreams/adapters.py)
    lora: Requested = None

    @property
    def slots_wanted(self) -> int:
        return 1 if self.count is None else self.count

    def may_wait(self, now: float) -> bool:
        return self.patient and (self.wait_deadline is None or now < self.wait_deadline)


@dataclass(frozen=True)
class UpstreamLease:
    """Every slot of one upstream, held by a request whose slot use cannot be pinned."""

    table: UpstreamSlots
    queued_s: float
    tenant: str
    # every slot holds this tenant's text or nothing: the server may reuse whatever it picks
    clean: bool
    # the slots holding anyone else's text, and what they hold (the disk tier may archive it)
    foreign: tuple[Lease, ...] = ()
