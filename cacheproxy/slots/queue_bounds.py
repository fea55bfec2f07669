"""How many requests may wait for a slot, and when a refused one should come back (pure).

A tenant may keep only so many requests waiting: its own bound (`TenantQueueFull`, 429), never
anyone else's. All tenants together may keep `max_queue` waiting (`Overloaded`, 503), unless,
under the fair queue, a tenant with more waiting gives way: the newest request of the longest
queue is refused instead (429), so one tenant filling the whole queue cannot turn others away.
A refusal says when to come back (Retry-After): about when as many requests as wait before it
have been served, one request's time at least.

Data in (the queue, read, never changed; the tables' measured request times), decision out.
Cost: two counts per request admitted; the longest queue is looked for only when the whole
queue is full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from cacheproxy.slots.fair_queue import FairQueue
from cacheproxy.upstreams.slot_table import UpstreamSlots

T = TypeVar("T")


class Overloaded(Exception):
    """The queue is full: the client should come back later (503 with Retry-After)."""


class TenantQueueFull(Exception):
    """The tenant has as many requests waiting as it may: it should come back later (429 with
    Retry-After); other tenants are not affected."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_s(tables: Sequence[UpstreamSlots], waiting: int) -> int:
    """Seconds until about `waiting` more requests have been served, one request's time at
    least: each slot frees every expected request time (1 s before any was measured)."""
    slots = sum(len(table.slots) for table in tables if table.healthy) or 1
    times = [t.request_s.value for t in tables if t.healthy and t.request_s.value]
    request_s = max(times, default=1.0)
    return max(1, math.ceil(request_s), math.ceil(waiting * request_s / slots))


def make_room(
    queue: FairQueue[T],
    tenant: str,
    bound: int | None,
    max_queue: int,
    tables: Sequence[UpstreamSlots],
    lined_up: tuple[int, int] = (0, 0),
) -> tuple[T, TenantQueueFull] | None:
    """Room for one more request of `tenant`: None when there is room, the request that gives
    way for it with its refusal when one must; raises the newcomer's refusal when it may not
    wait: its own bound first (429), then the total (503). `lined_up`: the tenant's requests
    and all requests waiting at the server rather than in `queue` (slots/line_up.py), which
    count towards both bounds (only one in the queue can give way)."""
    waiting = queue.waiting(tenant) + lined_up[0]
    if bound is not None and waiting >= bound:
        raise TenantQueueFull(
            f"this tenant already has {waiting} requests waiting for a slot (its limit)",
            retry_after_s(tables, waiting),
        )
    if len(queue) + lined_up[1] < max_queue:
        return None
    longest = queue.newest_of_longest() if queue.fair else None
    if longest is None or queue.waiting(longest[0]) <= waiting + 1:
        raise Overloaded(f"{len(queue) + lined_up[1]} requests are already waiting for a slot")
    other, pushed_out = longest
    others_waiting = queue.waiting(other) - 1  # once its newest has given way
    return pushed_out, TenantQueueFull(
        f"this tenant has {others_waiting + 1} requests waiting, the most of any while"
        " the queue is full: its newest gave way to another tenant's",
        retry_after_s(tables, others_waiting),
    )
