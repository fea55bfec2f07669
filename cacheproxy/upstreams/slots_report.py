"""What `GET /slots` before and after a request tells of the slots it ran on."""

from __future__ import annotations


def written_slots(before: list[dict] | None, after: list[dict] | None) -> dict[int, int | None]:
    """Slot id -> what `GET /slots` tells about it across a request: False (the server ran
    nothing there), the tokens it holds now (it ran a task there), None (cannot be told)."""
    if before is None or after is None:
        return {}
    previous = {entry["id"]: entry for entry in before}
    found: dict[int, int | None] = {}
    for entry in after:
        old = previous.get(entry["id"])
        if old is None or entry.get("is_processing"):
            continue  # still running (the client left a task the server has not yet dropped)
        same = old.get("id_task") == entry.get("id_task") and old.get(
            "n_prompt_tokens"
        ) == entry.get("n_prompt_tokens")
        found[entry["id"]] = False if same else entry.get("n_prompt_tokens", 0)
    return found
