"""A task request as the request path reads it: its body, its tenant and what the tenant may do."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cacheproxy.slots.admission import TenantLimits
from cacheproxy.slots.prompt_bounds import PromptLimits
from cacheproxy.slots.shapes import AgentApi


@dataclass
class PlacedRequest:
    """A task request as the cache layer reads it."""

    path: str
    body: bytes
    document: dict
    tenant: str
    session: str | None
    hide_cache_signals: bool = False
    may_use_public_prefixes: bool = True
    forward_client_key: bool = True  # False once tenants exist: their keys are the proxy's
    checked_with: PromptLimits | None = None  # the limits its prompts were checked against
    received: float = field(default_factory=time.monotonic)
    api: AgentApi | None = None  # set once an agent API's body is converted to its chat request
    limits: TenantLimits = field(default_factory=TenantLimits)  # share, class, bounds

    @property
    def stream(self) -> bool:
        return self.document.get("stream") is True

    @property
    def cache_prompt(self) -> bool:
        return self.document.get("cache_prompt") is not False

    def single_task(self) -> bool:
        """One prompt, one completion: it runs on exactly the slot it is pinned to."""
        count = self.document.get("n_cmpl", self.document.get("n", 1))
        return count in (None, 1)
