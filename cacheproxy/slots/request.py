"""A task request as the request path reads it: its body, who it acts for and what they may do."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import orjson

from cacheproxy.slots.admission import TenantLimits
from cacheproxy.slots.prompt_bounds import PromptLimits
from cacheproxy.slots.shapes import AgentApi
from cacheproxy.tenancy.auth import Caller
from cacheproxy.upstreams.adapters import Requested, requested
from cacheproxy.upstreams.slot_table import UpstreamSlots
from cacheproxy.upstreams.spliced_body import FileBody, SpilledJson

# the body fields that bound what a task generates: llama-server reads any of them
GENERATION_LIMITS = ("n_predict", "max_tokens", "max_completion_tokens")


@dataclass
class PlacedRequest:
    """A task request as the cache layer reads it."""

    path: str
    body: bytes | SpilledJson  # a big body stays in the file it was spilled to
    document: dict
    caller: Caller  # resolved once at the route: the stages read it, never the registry
    tenant: str  # the caller's tenant id, what the request path counts and places by
    session: str | None
    # the limits its prompts were checked against (unknown: none yet)
    checked_with: PromptLimits = field(default_factory=PromptLimits)
    received: float = field(default_factory=time.monotonic)
    api: AgentApi | None = None  # set once an agent API's body is converted to its chat request
    limits: TenantLimits = field(default_factory=TenantLimits)  # share, class, bounds
    # the tables it may be placed on, by the model it names (None: any; model_admission.py)
    tables: frozenset[int] | None = None
    # the model instances it keeps loaded until it ends
    admitted: tuple[UpstreamSlots, ...] = ()
    # what a body without `cache_prompt` asks: its servers' default (set at admission,
    # slots/guards.py)
    reuse_by_default: bool = True

    @property
    def stream(self) -> bool:
        return self.document.get("stream") is True

    @property
    def cache_prompt(self) -> bool:
        """Whether the server may reuse the slot's text: as the body says, or, where it says
        nothing (null is nothing to llama-server), as the servers do by default."""
        asked = self.document.get("cache_prompt")
        return self.reuse_by_default if asked is None else asked is not False

    @property
    def lora(self) -> Requested:
        """The LoRA scales its body names (None: the server's global ones)."""
        return requested(self.document) if "lora" in self.document else None

    def relies_on_no_reuse_default(self) -> bool:
        """Its body does not say `cache_prompt`, and was taken to ask for no reuse: the
        servers' default, as the probe found it."""
        return not self.reuse_by_default and self.document.get("cache_prompt") is None

    def upstream_body(self, document: dict) -> bytes | FileBody:
        """The body that makes the server read `document`, one this request's `document`
        became (pinned, split, isolated): serialised, or, for a body in its spill file, the
        file with what changed appended (upstreams/spliced_body.py). Documents are compared
        by their values' identity: the request path builds new ones, never edits one."""
        if isinstance(self.body, SpilledJson) and self.api is None:
            return self.body.with_document(document)
        # a converted agent body is whole here (slots/read_fields.py keeps all of it)
        return orjson.dumps(document)

    @property
    def generates_at_most(self) -> int | None:
        """The most tokens its task may generate, by the body's limit (`n_predict` or an alias:
        server-schema.cpp); None when it sets none, or sets one the server reads as none (-1)
        or may read otherwise: the server's own default is not known here."""
        limits = [self.document[name] for name in GENERATION_LIMITS if name in self.document]
        if not limits or not all(type(limit) is int and limit >= 0 for limit in limits):
            return None
        return max(limits)  # which of several aliases the server reads is not relied on

    def single_task(self) -> bool:
        """One prompt, one completion: it runs on exactly the slot it is pinned to."""
        count = self.document.get("n_cmpl", self.document.get("n", 1))
        return count in (None, 1)
