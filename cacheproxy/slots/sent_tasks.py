"""A task sent whose answer did not come whole: what the proxy knows of it when it charges it
(cut_tasks.py reads its slot, server_picked.py finds the slot the server picked for it)."""

from __future__ import annotations

from dataclasses import dataclass

from cacheproxy.slots.chunked_prefill import Chunks
from cacheproxy.upstreams.slot_table import Lease, SlotContent, TaskOutcome


@dataclass(frozen=True)
class SentTask:
    """A request sent to a leased slot whose answer did not come whole: what is known of it."""

    prompt: list[int]  # its prompt's ids (empty when not known: an opaque prompt)
    reused: int  # what the server was expected to reuse of it
    held: SlotContent  # what the slot held when it went out
    isolate: bool  # that was another tenant's text, to be reused in no part
    opaque: bool
    generated_seen: int = 0  # tokens its stream carried before it was cut
    # the whole request was handed to the upstream connection: the server has it (unknown:
    # taken as had; see upstreams/relay.py `forward`)
    delivered: bool = True

    @classmethod
    def of(
        cls,
        lease: Lease,
        generated_seen: int,
        chunks: Chunks | None = None,
        prompt: list[int] | None = None,
        delivered: bool = True,
    ) -> SentTask:
        """The task sent on the leased slot: its prompt (`prompt`: a chunk's), after `chunks`
        computed part of it (the slot then holds their prefix, or what is not known if one
        failed), else over what the slot held when leased."""
        if chunks is None or chunks.count == 0:
            held, reused, isolate = lease.previous, lease.predicted.low, lease.isolate
        else:
            prefix = lease.prompt[: chunks.end]
            held = SlotContent(prefix, None if chunks.failed else 0, None)
            reused, isolate = chunks.end, False
        prompt = lease.prompt if prompt is None else prompt
        return cls(prompt, reused, held, isolate, lease.opaque, generated_seen, delivered)


def whole_prompt(sent: SentTask) -> TaskOutcome:
    """The cut task charged its whole prompt: the mirror's count, the reuse as predicted, the
    rest computed (with the tokens its stream carried)."""
    length = len(sent.prompt)
    return TaskOutcome(
        ok=False,
        cut=True,
        cache_n=sent.reused,
        prompt_n=max(length - sent.reused, 0),
        predicted_n=sent.generated_seen,
    )
