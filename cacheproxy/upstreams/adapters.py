"""LoRA adapters: which ones a task runs under, as llama-server works it out (pure).

A server started with `--lora` computes every task's KV cache under a set of adapter scales:
the body's `lora` (`[{"id", "scale"}]`, adapters not named at 0), or, without one (or with an
empty list), the server's global scales (`GET /lora-adapters`, changed by `POST
/lora-adapters`). The same tokens computed under other scales are another KV state. llama-server
itself follows this only in part (tools/server/server-context.cpp `launch_slot_with_task`):

- a task naming other scales than its slot's last task clears the slot (`lora_should_clear_cache`,
  activated LoRAs aside);
- a task that names none takes the global scales and keeps what the slot holds, whatever it was
  computed under;
- a slot restored from a file keeps its last task's scales (the file holds no adapters).

So the proxy keeps, for each slot, the scales its text was computed under (`SlotState.adapters`)
and lets a request reuse a slot, restore an archive or line up behind a running request only
under the same scales; archives are filed under the adapters' files and their scales
(`disk.attached.filed_under`).
A server with no adapters loaded has no scales (`()`), and nothing of this applies there.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

# The scales a task runs under, one per adapter the server loaded, in its order; () on a
# server that loaded none
Scales = tuple[float, ...]
# What a body's `lora` names: (id, scale) pairs by id; None: no `lora`, the server's global scales
Requested = tuple[tuple[int, float], ...] | None
# A body's `lora` the proxy cannot read as llama-server does: never matches any slot's scales
UNREADABLE: Requested = ((-1, float("nan")),)


def as_float32(value: float) -> float:
    """`value` as the server keeps it (a C float): 0.1 named twice is one scale."""
    return struct.unpack("f", struct.pack("f", value))[0]


def requested(document: dict[str, Any]) -> Requested:
    """What the forwarded body's `lora` asks, read as `parse_lora_request` reads it
    (server-common.cpp: an entry's id defaults to -1 and its scale to 0; a later entry for an
    id wins); None when it asks nothing (absent, null or empty: the global scales)."""
    lora = document.get("lora")
    if lora is None or lora == []:
        return None
    if not isinstance(lora, list):
        return UNREADABLE  # refused by the server: what the slot then holds is not known here
    scales: dict[int, float] = {}
    for entry in lora:
        if not isinstance(entry, dict):
            return UNREADABLE
        adapter_id, scale = entry.get("id", -1), entry.get("scale", 0.0)
        if type(adapter_id) is not int or type(scale) not in (int, float):
            return UNREADABLE  # a type the server's json_value turns into its default
        try:
            scales[adapter_id] = as_float32(scale)
        except OverflowError:
            return UNREADABLE
    return tuple(sorted(scales.items()))


def effective(asked: Requested, global_scales: Scales) -> Scales | None:
    """The scales a task asking `asked` runs under on a server whose global scales are
    `global_scales` (`construct_lora_list`: ids it did not load are ignored); None when the
    body cannot be read as the server reads it."""
    if asked is None:
        return global_scales
    if asked is UNREADABLE:
        return None
    named = dict(asked)
    return tuple(named.get(index, 0.0) for index in range(len(global_scales)))


def loaded(report: object) -> tuple[Scales, tuple[str, ...]]:
    """The global scales `GET /lora-adapters` reports (`[{"id", "path", "scale"}, ...]`), and
    the adapters' files, in their order; () and () for a server that loaded none, or answered
    otherwise."""
    if not isinstance(report, list):
        return (), ()
    entries = sorted((entry for entry in report if isinstance(entry, dict)), key=_adapter_id)
    scales = [entry.get("scale") for entry in entries]
    if len(entries) != len(report) or not all(type(s) in (int, float) for s in scales):
        return (), ()
    files = tuple(str(entry.get("path", "")) for entry in entries)
    return tuple(as_float32(scale) for scale in scales), files  # type: ignore[arg-type]


def _adapter_id(entry: dict) -> int:
    adapter_id = entry.get("id")
    return adapter_id if type(adapter_id) is int else -1


def naming(scales: Sequence[float]) -> list[dict[str, Any]]:
    """A body's `lora` that runs a task under `scales`."""
    return [{"id": index, "scale": scale} for index, scale in enumerate(scales)]


def scales_key(files: Sequence[str], scales: Sequence[float]) -> str:
    """How an archive's adapters (the files the server loaded) and scales are written beside
    its model's fingerprint: the same scales of other adapters are another state."""
    named = hashlib.blake2b("\n".join(files).encode(), digest_size=8).hexdigest()
    return f"{named}:" + ",".join(repr(scale) for scale in scales)
