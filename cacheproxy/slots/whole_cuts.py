"""What a request on a whole upstream computed when it was cut (its client left, or the answer
broke off): read from the server's slots, since its answer never said.

The request holds every slot of its upstream, so the proxy runs nothing else there: a slot
`GET /slots` shows with another task or another length after than before (`written_slots`) is
the request's, once the server let go of it (`is_processing` false), and its `n_prompt_tokens`
is what the request left there: the prompt tokens it reused and computed, then what it
generated (a cut stream's prompt was computed whole; a client gone before the first token is
charged the part the server computed). The proxy never had the prompt's ids (it could not
mirror them), so the slot's count is the charge: what the server reused of it is the slot's
`n_prompt_tokens_cache` as read while the task ran (0 once the slot is released: stats reset,
server-context.cpp `reset`), and the rest computed. Generated tokens the stream carried are
charged as such, the others the server kept with the prompt. Where no report can tell (the
server could not be read), the request is charged what its answer showed.
"""

from __future__ import annotations

from cacheproxy.upstreams.slot_table import TaskOutcome
from cacheproxy.upstreams.slots_report import written_slots


def reuse_while_running(report: list[dict], seen: dict[int, int]) -> None:
    """Note in `seen` what each slot processing in `report` reused of its task's prompt."""
    for entry in report:
        cached = entry.get("n_prompt_tokens_cache")
        if entry.get("is_processing") and isinstance(cached, int) and cached > 0:
            seen[entry["id"]] = cached


def whole_upstream_cut(
    before: list[dict] | None,
    after: list[dict] | None,
    reused: dict[int, int],
    shown: TaskOutcome,
) -> TaskOutcome:
    """The cut request's outcome from the reports before it and once the server let go of its
    slots (`after`; None: not read), what the slots reused while it ran (`reused`), and what
    its answer showed (`shown`: the tokens its stream carried)."""
    if before is None or after is None:
        return shown
    held = reuse = 0
    for slot_id, tokens in written_slots(before, after).items():
        if tokens is None or tokens is False:
            continue
        held += tokens
        reuse += min(reused.get(slot_id, 0), tokens)
    generated = min(shown.predicted_n or 0, max(held - reuse, 0))
    return TaskOutcome(
        ok=False,
        cut=True,
        cache_n=reuse,
        prompt_n=max(held - reuse - generated, 0),
        predicted_n=generated or None,
    )
