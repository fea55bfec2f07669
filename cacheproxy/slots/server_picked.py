"""Which slot a cut task ran on when the server picked it itself, and what it computed there.

On llama-server's default topology (4 slots on a unified KV cache, idle slots emptied into its
RAM cache at every task launch) tasks go without `id_slot` (`Lease.unpinned`): the lease is on
the slot the server is predicted to take, and only a whole answer names the one it took. A cut
task has no whole answer, so its slot is told from `GET /slots`, from what the server shows of
its own tasks: every slot shows the id of the last task it ran (`id_task`, kept once the task
ends and when the slot is emptied: server-context.cpp `to_json`, `reset`, `prompt_clear`), and
whether it runs one now (`is_processing`).

- The task is identified while it runs: its lease is the only one the table holds on its
  upstream, and the server shows exactly one slot processing. Every task the proxy sends holds
  a lease until the server is done with it, so that one is the cut task's (the read comes as
  the client leaves, and the server sees a closed connection no sooner than a second later).
  Only a task given up at its deadline while the server still ran it, or another client of the
  server, could pass for it.
- Its count is read once the server let go of it: the slot shows the same task, and every
  other slot the task it showed then. Any task launched meanwhile would show as a new task id
  on some slot, and a launch empties the idle slots (`cache_idle_slots`, where the cut task's
  count would be lost); none did, so the slot's `n_prompt_tokens` is what the task left there:
  what it reused, then computed (and generated past the prompt).
- Where the task cannot be told (other tasks ran beside it, it had ended or not yet started at
  the first read, another task launched before its count was read, the server could not be
  read), it is charged its whole prompt less the predicted reuse, when the server had the whole
  request (`SentTask.delivered`), else nothing. That bound may charge a rare honest early
  cancel a prompt the server stopped computing part-way; a charge of nothing would let a tenant
  send long prompts and leave before their first token, never charged, its budget never
  reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from cacheproxy.slots.sent_tasks import SentTask, whole_prompt
from cacheproxy.upstreams.slot_table import TaskOutcome


@dataclass(frozen=True)
class PickedSlot:
    """The slot the server runs a cut task on, and what every slot showed when it was found."""

    slot_id: int
    task_id: int
    tasks: dict[int, object]  # slot id -> the task id it showed (None: none yet)


class Seen(Enum):
    RUNNING = "running"  # the task still runs there
    SETTLED = "settled"  # it ended, and the slot holds what it left
    LOST = "lost"  # another task launched since: what it left cannot be told


def identify(report: list[dict], alone: bool) -> PickedSlot | None:
    """The slot running the cut task, from the server's report read as the client left:
    the one slot processing, where the task's lease is the only one on the upstream (`alone`);
    None when it cannot be told."""
    if not alone:
        return None
    running = [entry for entry in report if entry.get("is_processing")]
    if len(running) != 1:
        return None
    slot_id, task_id = running[0].get("id"), running[0].get("id_task")
    if not _is_count(slot_id) or not _is_count(task_id):
        return None
    tasks = {entry.get("id"): entry.get("id_task") for entry in report}
    return PickedSlot(slot_id, task_id, tasks)  # type: ignore[arg-type]


def seen_in(picked: PickedSlot, report: list[dict]) -> tuple[Seen, dict | None]:
    """What a later report shows of the picked task: still running, ended with its slot as it
    left it (that slot's entry), or lost."""
    entries = {entry.get("id"): entry for entry in report}
    entry = entries.get(picked.slot_id)
    if entry is None or entry.get("id_task") != picked.task_id:
        return Seen.LOST, None
    if entry.get("is_processing"):
        return Seen.RUNNING, None
    shown = {slot_id: other.get("id_task") for slot_id, other in entries.items()}
    if shown != picked.tasks:
        return Seen.LOST, None
    return Seen.SETTLED, entry


def picked_outcome(sent: SentTask, picked: PickedSlot, entry: dict) -> TaskOutcome:
    """The cut task's outcome from its slot's entry once it ended (`seen_in`): the prompt's
    first n tokens, the reuse as predicted (at most n), the rest computed; n past the prompt
    is tokens generated. Its slot named, so that the table follows the server's pick."""
    held = entry.get("n_prompt_tokens")
    if not _is_count(held):
        return unplaced_outcome(sent)
    seen = sent.generated_seen
    if sent.opaque:  # the prompt's ids and reuse unknown: the slot's tokens, as computed
        return TaskOutcome(
            ok=True, cut=True, cache_n=0, prompt_n=max(held - seen, 0), tokens_cached=held,
            predicted_n=seen, slot_id=picked.slot_id,
        )  # fmt: skip
    length = len(sent.prompt)
    kept = min(held, length)
    reused = min(sent.reused, kept)
    return TaskOutcome(
        ok=True,
        cut=True,
        cache_n=reused,
        prompt_n=kept - reused,
        tokens_cached=held,
        predicted_n=max(seen, held - length),
        slot_id=picked.slot_id,
    )


def unplaced_outcome(sent: SentTask) -> TaskOutcome:
    """A cut task whose slot cannot be told: its whole prompt, less the predicted reuse, when
    the server had the whole request (or a generated token came: it computed the prompt);
    else nothing (an opaque prompt's length is not known: what was streamed)."""
    if sent.delivered or sent.generated_seen:
        return whole_prompt(sent)
    return TaskOutcome(ok=False, cut=True, cache_n=0, prompt_n=0)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
