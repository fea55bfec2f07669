"""Usage figures as the ledger keeps them: what one task adds, and sums by hour, day, month or
tenant. Pure: no I/O, no clock (the ledger's store and the meter do those).

Per tenant and UTC hour: requests (client requests on the task routes, whatever their answer),
prompt tokens (what the server reported: reused + computed), computed (decoded) prompt tokens,
reused prompt tokens by where they came from (the slot itself, an archive restored from disk,
another tenant's public prefix), generated tokens, restores, bytes archived and errors (requests
answered with a 4xx or 5xx status, the proxy's own refusals included).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal

# the ledger's columns, in the order exports show them
FIGURES = (
    "requests",
    "prompt_tokens",
    "computed_tokens",
    "reused_slot_tokens",
    "reused_disk_tokens",
    "reused_public_tokens",
    "generated_tokens",
    "restores",
    "archived_bytes",
    "errors",
)
GroupBy = Literal["hour", "day", "month", "tenant"]
GROUPINGS: tuple[GroupBy, ...] = ("hour", "day", "month", "tenant")
HOUR_S = 3600


def hour_of(now: float) -> int:
    """The start of the UTC hour `now` falls in, in Unix seconds."""
    return int(now // HOUR_S * HOUR_S)


def task_figures(
    *,
    prompt_tokens: int,
    computed_tokens: int | None,
    reused_tokens: int | None,
    generated_tokens: int | None,
    tenant: str,
    previous_owner: str | None,
    disk_action: str,
) -> dict[str, int]:
    """What one finished task adds to its tenant's hour (the figures it adds nothing to are
    left out).

    The reused tokens are the server's `cache_n`; where they came from is told by what the
    slot held before: an archive the disk tier restored into it, another tenant's text (then
    only a public prefix may have been reused), or the tenant's own (or unknown) text."""
    reused = reused_tokens or 0
    # a plain dict: a Counter costs several calls to build, once a task
    figures = {
        "prompt_tokens": prompt_tokens,
        "computed_tokens": computed_tokens
        if computed_tokens is not None
        else prompt_tokens - reused,
        "generated_tokens": generated_tokens or 0,
    }
    if disk_action == "restore":
        figures["restores"] = 1
        figures["reused_disk_tokens"] = reused
    elif previous_owner is not None and previous_owner != tenant:
        figures["reused_public_tokens"] = reused
    else:
        figures["reused_slot_tokens"] = reused
    return figures


def period_of(hour: int, group_by: GroupBy) -> str:
    moment = datetime.fromtimestamp(hour, UTC)
    if group_by == "hour":
        return moment.strftime("%Y-%m-%dT%H:00:00Z")
    if group_by == "day":
        return moment.strftime("%Y-%m-%d")
    if group_by == "month":
        return moment.strftime("%Y-%m")
    return ""


def with_totals(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row with `reused_tokens`, the sum of the three reuse figures."""
    reused = sum(int(row.get(name, 0)) for name in FIGURES if name.startswith("reused_"))
    return {**row, "reused_tokens": reused}


def aggregate(
    rows: Iterable[Mapping[str, Any]], group_by: GroupBy, by_model: bool = False
) -> list[dict[str, Any]]:
    """Ledger rows (tenant_id, [model,] hour, FIGURES...) summed per tenant (and model, with
    `by_model`) and period (`tenant`: over the whole range), ordered by period then tenant."""
    sums: dict[tuple[str, str, str], Counter[str]] = {}
    for row in rows:
        model = str(row["model"]) if by_model else ""
        key = (period_of(int(row["hour"]), group_by), str(row["tenant_id"]), model)
        counter = sums.setdefault(key, Counter())
        for name in FIGURES:
            counter[name] += int(row.get(name) or 0)
    result = []
    for (period, tenant_id, model), counter in sorted(sums.items()):
        row: dict[str, Any] = {"tenant_id": tenant_id, **({"model": model} if by_model else {})}
        if group_by != "tenant":
            row[group_by] = period
        row.update({name: counter[name] for name in FIGURES})
        result.append(with_totals(row))
    return result


def budget_tokens(figures: Mapping[str, int]) -> int:
    """What a budget counts: prompt tokens (reused ones included) plus generated tokens."""
    return int(figures.get("prompt_tokens", 0)) + int(figures.get("generated_tokens", 0))


def parse_time(text: str) -> int:
    """A bound of a usage query: Unix seconds, or an ISO 8601 date or time (UTC unless it
    says otherwise). Raises ValueError naming what it cannot read."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"not a time: {text[:40]!r} (give Unix seconds or an ISO 8601 date or time)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp())
