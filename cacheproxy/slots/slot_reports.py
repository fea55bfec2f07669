"""What a table and the server's `GET /slots` tell the upstream monitor: how much context the
server has, since when it is idle, whether its slots changed, whether its process restarted."""

from __future__ import annotations

from collections.abc import Collection

from cacheproxy.upstreams.slot_table import UpstreamSlots


def server_n_ctx(table: UpstreamSlots) -> int:
    """The server's whole context: the slots' sum, or, with a unified KV cache (each slot may
    use all of it: the slots report the same `n_ctx`), one slot's."""
    sizes = [slot.n_ctx for slot in table.slots]
    return max(sizes, default=0) if table.clears_idle else sum(sizes)


def idle_since(table: UpstreamSlots) -> float | None:
    """When the last request on `table` ended (0: none yet); None while a slot is busy. A
    plain loop: asked for every upstream at every request."""
    last_used = 0.0
    for slot in table.slots:
        if slot.busy:
            return None
        if slot.last_used > last_used:
            last_used = slot.last_used
    return last_used


def version_sum(table: UpstreamSlots) -> int:
    return sum(slot.version for slot in table.slots)


def process_restarted(report: list[dict], answered: int, tasked: Collection[int] = ()) -> bool:
    """Whether `GET /slots` comes from a process that ran fewer tasks than the proxy saw answered
    since it built the table: a server numbers every task it runs, and a slot shows the id of its
    last one, so the highest shown is at least `answered - 1` in the same process (other clients
    only raise it). Or from one that never ran a task on a slot of `tasked`, where the proxy
    saw one answered: llama-server shows `id_task` for every slot that ran a task, ever after
    (server-context.cpp:734-736, `task_prev`), and only a new process, or one woken from sleep
    (its slots made anew, its RAM cache too: 1371, 1492), shows none. A restart quicker than a
    health check shows only so. A server that shows no task ids on slots the proxy did not use
    (none ran yet), or numbers none (the embedded engine shows -1), tells nothing."""
    if any(entry.get("id") in tasked and "id_task" not in entry for entry in report):
        return True
    shown = [
        entry["id_task"]
        for entry in report
        if isinstance(entry.get("id_task"), int) and entry["id_task"] >= 0
    ]
    return bool(shown) and max(shown) < answered - 1
