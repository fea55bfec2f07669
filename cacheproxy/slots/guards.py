"""What the upstreams allow as a task request is admitted, read from their slot tables (pure):
the prompts they accept, and whether they may serve tenants at all."""

from __future__ import annotations

from collections.abc import Sequence

from cacheproxy.errors import ApiError
from cacheproxy.slots.prompt_bounds import PromptLimits
from cacheproxy.upstreams.slot_table import UpstreamSlots


def prompt_limits(tables: Sequence[UpstreamSlots], last: PromptLimits) -> PromptLimits:
    """What every healthy upstream accepts: ids below the smallest vocabulary, prompts shorter
    than the largest slot context; unknown (None) before any upstream answered. `last` (the
    previous answer, a frozen object) is returned when nothing changed."""
    # plain loops: asked twice a request (generators cost more than the work)
    n_vocab: int | None = None
    n_ctx: int | None = None
    for table in tables:
        if not table.healthy or not table.slots:
            continue
        if table.n_vocab and (n_vocab is None or table.n_vocab < n_vocab):
            n_vocab = table.n_vocab
        for slot in table.slots:
            if n_ctx is None or slot.n_ctx > n_ctx:
                n_ctx = slot.n_ctx
    if last.n_vocab == n_vocab and last.n_ctx == n_ctx:
        return last
    return PromptLimits(n_vocab, n_ctx)


def reuse_by_default(
    tables: Sequence[UpstreamSlots], indices: frozenset[int] | None = None
) -> bool:
    """Whether a task that does not say `cache_prompt`, to be placed on the upstreams
    `indices` (None: any), is taken to reuse its slot's text: yes unless every healthy one was
    found not to (`--no-cache-prompt`, a router's model preset); with servers that differ,
    reuse is assumed (a prediction there may miss). Isolation never rests on this: a task on
    another tenant's text goes with `cache_prompt: false` (or its slot erased) either way, and
    a server taken for one that does not reuse, but that does, only reuses the tenant's own
    text."""
    # a plain loop, ended by the first that reuses: asked once a request
    serving = False
    for table in tables:
        if table.healthy and (indices is None or table.index in indices):
            if table.reuses_by_default:
                return True
            serving = True
    return not serving


def require_isolating_upstreams(tables: Sequence[UpstreamSlots]) -> None:
    """With tenants, a server RAM cache (shared by all slots, hence all tenants) could hand one
    tenant's state to another: refuse to serve (503) rather than risk it, also while the probe
    could not yet tell whether there is one."""
    for table in tables:
        if table.healthy and table.ram_cache:
            break
    else:
        return  # the common case, without building the list below
    shared = [t for t in tables if t.healthy and t.ram_cache]
    names = ", ".join(f"{t.upstream.base_url} (RAM cache {t.ram_cache_state})" for t in shared)
    raise ApiError(
        503,
        f"upstream {names}: a server RAM prompt cache is shared by all tenants, and an unknown"
        " one is treated as shared (the probe needs an idle slot and is retried). Run"
        " llama-server with --cache-ram 0 to serve tenants (one cacheproxy starts: the setting"
        " managed.cache_ram_mib = 0; the embedded engine: embedded.prompt_cache_options ="
        " {limit_bytes = 0}; and, if the probe cannot run, declare that with the setting"
        ' routing.server_ram_cache = "off")',
    )
