"""The routing-policy interface: which upstream and slot serve a request, or whether it waits.

A policy is pure: it sees numbers the scheduler has already computed from the slot table (how many
prompt tokens each slot lets the server skip, how many it would overwrite, who is busy, how fast
each upstream prefills) and returns a decision. It does no I/O and keeps no clock of its own.

What a policy sees is made afresh for every placement, a candidate per slot: plain dataclasses,
not frozen ones, whose every field would be set through `object.__setattr__` (twice the cost, and
a placement for every request). A policy reads them; what it might change is thrown away.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cacheproxy.disk.policy import Restorable


@dataclass
class SlotCandidate:
    upstream: int  # index into the upstream views
    slot_id: int
    busy: bool
    empty: bool
    reuse: int  # prompt tokens the server will not decode again here (a lower bound)
    lost: int  # tokens the slot holds past the shared prefix, overwritten by this request
    last_used: float  # monotonic seconds; 0 for never
    busy_for_s: float  # how long the running request has held it; 0 when idle
    session: str | None = None  # the affinity key of the conversation it last served
    # Only for a busy slot holding the requester's own text (never another tenant's: a wait
    # for it must not depend on that tenant's prompt), else None and 0:
    # seconds until its running request is expected to end, from what that request is doing
    # (its prompt's expected end, then the upstream's measured time after a prompt)
    remaining_s: float | None = None
    # seconds until its running request's prompt is expected to be computed (0: it is)
    prefill_left_s: float = 0.0
    # busy, and requests queued ahead of this one wait for it: they take it first, holding it
    # this many seconds in all (slots/queued_ahead.py); a wait here lasts theirs too
    queued_ahead_s: float = 0.0
    # the disk tier archives the `lost` tokens as they are overwritten: a restore brings them
    # back (so a wait only to keep them buys nothing)
    archived: bool = False


@dataclass
class UpstreamView:
    index: int
    in_flight: int
    # what a prompt token costs the server: measured across its batches (see
    # `PrefillThroughput`), or per request from `timings` until a prompt has measured that
    prefill_ms_per_token: float
    expected_request_s: float  # how long a request holds a slot, smoothed
    ram_cache: bool  # the server keeps its own RAM prompt cache
    healthy: bool = True


@dataclass
class RouteRequest:
    n_prompt_tokens: int
    session: str | None = None
    may_wait: bool = True  # False once a bounded wait for a busy slot has run out
    # by upstream index, the archive the disk tier would restore into the slot chosen there
    # (looked up only once the request would wait: none is known before)
    restorable: Mapping[int, Restorable] = field(default_factory=dict)


@dataclass(frozen=True)
class UseSlot:
    upstream: int
    slot_id: int


@dataclass(frozen=True)
class WaitForSlot:
    """Wait (at most `max_wait_s`) for a busy slot whose reuse is worth more than the wait."""

    upstream: int
    slot_id: int
    max_wait_s: float


@dataclass(frozen=True)
class QueueUntilFree:
    """No slot can take the request now; plan again when one is released."""


RoutePlan = UseSlot | WaitForSlot | QueueUntilFree


class RoutingPolicy(Protocol):
    def plan(
        self,
        request: RouteRequest,
        slots: Sequence[SlotCandidate],
        upstreams: Sequence[UpstreamView],
    ) -> RoutePlan: ...
