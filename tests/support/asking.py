"""A request waiting for a slot, as the slot views read it (`slot_views.Asking`)."""

from __future__ import annotations

from dataclasses import dataclass

from cacheproxy.upstreams.adapters import Requested


@dataclass
class Asking:
    prompt: list[int]
    tenant: str = "default"
    session: str | None = None
    cache_prompt: bool = True
    opaque: bool = False
    public_prefix_length: int = 0
    slot_id: int | None = None
    lora: Requested = None
