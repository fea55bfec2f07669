"""Whose waiting request goes next: weighted fair queuing over per-tenant queues (pure).

Each tenant waiting has its own queue, and the tenants are served by start-time fair queuing
(Goyal et al., SFQ): a tenant's next request carries a virtual start time, the earliest goes
first, and serving one request of a tenant moves that tenant's virtual time on by
`1 / (weight * class factor)`. A tenant that floods the queue pushes only its own virtual time
ahead; a tenant that comes back after a pause starts at the current virtual time, so its first
request goes next, whatever the flooder has queued. The cost of a request is one slot grant: how
long it will hold the slot is not known before it ends.

Priority classes: within its own queue a tenant's interactive requests go before its batch ones
(strict: a batch job never delays the same tenant's interactive traffic), and a batch request
costs its tenant more of its share (`batch_factor` < 1), so a tenant whose queue holds only
batch work gives way to other tenants' interactive work more often. Because the class changes
what a request costs, the admin caps the class each tenant may ask for (`max_priority`).

The queue only orders: `order()` lists every waiter, best first. The scheduler walks it and
serves those it can (the routing policy still picks the slot); one it cannot serve now is passed
over, so it never blocks the tenants after it. `served()` charges the tenant whichever of its
requests was served. With `fair=False` the order is arrival order: one global FIFO.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch")  # the highest first

T = TypeVar("T")


def capped_priority(asked: Priority, ceiling: Priority) -> Priority:
    """The class a request runs in: what it asked for, but no higher than its tenant may use."""
    return max(asked, ceiling, key=PRIORITIES.index)


@dataclass(frozen=True)
class Share:
    """What a waiting request brings to the fair queue (and to the slot share) from its tenant
    and its header."""

    weight: float = 1.0
    priority: Priority = "interactive"
    max_concurrent: int | None = None  # the tenant's cap: its share of the slots is no larger


EQUAL_SHARE = Share()  # the default: weight 1, interactive, no cap


@dataclass
class _Entry(Generic[T]):
    item: T
    tenant: str
    share: Share
    seq: int  # arrival order: ties, and the global FIFO
    grants: int = 1  # slots it takes at once (a split request's tasks): each a grant


@dataclass
class _Flow(Generic[T]):
    """One tenant's waiting requests, by class, and its virtual start time."""

    start: float
    by_class: dict[Priority, list[_Entry[T]]] = field(
        default_factory=lambda: {priority: [] for priority in PRIORITIES}
    )
    size: int = 0  # requests waiting, all classes (asked at every push and grant)

    def add(self, entry: _Entry[T]) -> None:
        self.by_class[entry.share.priority].append(entry)
        self.size += 1

    def take(self, entry: _Entry[T]) -> None:
        self.by_class[entry.share.priority].remove(entry)
        self.size -= 1

    def entries(self) -> list[_Entry[T]]:
        """Every waiting request, the tenant's highest class first."""
        return [entry for priority in PRIORITIES for entry in self.by_class[priority]]


class FairQueue(Generic[T]):
    def __init__(self, fair: bool = True, batch_factor: float = 0.5) -> None:
        if not 0 < batch_factor <= 1:
            raise ValueError(f"batch_factor must be in (0, 1], got {batch_factor}")
        self.fair = fair
        self.batch_factor = batch_factor
        self._virtual_time = 0.0
        self._flows: dict[str, _Flow[T]] = {}
        # the virtual time at which a tenant whose queue emptied may start again (one that left
        # early must not come back with credit: it starts no earlier than where it stopped)
        self._finish: dict[str, float] = {}
        self._entries: dict[int, _Entry[T]] = {}  # by id(item)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: T) -> bool:
        return id(item) in self._entries

    def __iter__(self) -> Iterator[T]:
        return (entry.item for entry in list(self._entries.values()))

    def tenants(self) -> set[str]:
        """The tenants with a request waiting."""
        return set(self._flows)

    def waiting(self, tenant: str) -> int:
        flow = self._flows.get(tenant)
        return flow.size if flow is not None else 0

    def push(self, item: T, tenant: str, share: Share, grants: int = 1) -> None:
        """`item` waits; once served it costs its tenant `grants` grants (the slots it takes)."""
        entry = _Entry(item, tenant, share, next(self._seq), grants)
        flow = self._flows.get(tenant)
        if flow is None:
            start = max(self._virtual_time, self._finish.pop(tenant, self._virtual_time))
            flow = self._flows[tenant] = _Flow(start)
        flow.add(entry)
        self._entries[id(item)] = entry

    def remove(self, item: T) -> None:
        """`item` leaves without being served (its client left): nothing is charged."""
        entry = self._entries.pop(id(item))
        flow = self._flows[entry.tenant]
        flow.take(entry)
        if not flow.size:
            self._retire(entry.tenant, flow)

    def served(self, item: T) -> None:
        """`item` got its slots: its tenant is charged a grant for each, at its weight and
        class."""
        entry = self._entries.pop(id(item))
        flow = self._flows[entry.tenant]
        flow.take(entry)
        self._virtual_time = max(self._virtual_time, flow.start)
        flow.start += self._cost(entry)
        if not flow.size:
            self._retire(entry.tenant, flow)

    def order(self) -> list[T]:
        """Every waiter, the one to serve first first."""
        if not self.fair:
            return [entry.item for entry in sorted(self._entries.values(), key=lambda e: e.seq)]
        if len(self._flows) == 1:
            # one tenant waiting: its own order (every cost is above 0, so its tags rise)
            (flow,) = self._flows.values()
            return [entry.item for entry in flow.entries()]
        tagged: list[tuple[float, int, T]] = []
        for flow in self._flows.values():
            tag = flow.start
            for entry in flow.entries():
                tagged.append((tag, entry.seq, entry.item))
                tag += self._cost(entry)
        tagged.sort(key=lambda t: (t[0], t[1]))
        return [item for _, _, item in tagged]

    def newest_of_longest(self) -> tuple[str, T] | None:
        """The tenant with the most requests waiting and its last one in its own order (the one
        it would be served last): what gives way when the whole queue is full."""
        if not self._flows:
            return None
        tenant, flow = max(self._flows.items(), key=lambda pair: pair[1].size)
        return tenant, flow.entries()[-1].item

    def _cost(self, entry: _Entry[T]) -> float:
        share = entry.share
        factor = self.batch_factor if share.priority == "batch" else 1.0
        return entry.grants / (share.weight * factor)

    def _retire(self, tenant: str, flow: _Flow[T]) -> None:
        del self._flows[tenant]
        if flow.start > self._virtual_time:
            self._finish[tenant] = flow.start
        # a finish time the virtual time has passed says nothing more: forget it
        for other in [t for t, f in self._finish.items() if f <= self._virtual_time]:
            del self._finish[other]
