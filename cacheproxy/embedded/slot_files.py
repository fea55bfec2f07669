"""Slot save, restore and erase, in llama-server's slot-file format and with its answers.

A saved file is what llama-server with the same `-np` and per-slot KV would write for the same
tokens (disk/slot_file.py frames it, embedded/state_format.py converts the sequence state), so
files cross between the engine and a llama-server both ways, and between a copying and a
sharing engine. A restore that fails for any reason leaves the slot empty and answers 400, as
llama-server does. Run on the worker thread, for an idle slot (a busy one defers the command).
"""

from __future__ import annotations

import time
from typing import Any

from cacheproxy.disk.slot_file import SlotFileError, encode_slot_file, parse_slot_file
from cacheproxy.embedded.kv_ops import EngineKv
from cacheproxy.embedded.model import LlamaModel
from cacheproxy.embedded.state_format import StateFormatError, engine_to_server, server_to_engine
from cacheproxy.embedded.tasks import EngineError, EngineSlot, SlotCommand


def run_slot_command(
    command: SlotCommand, slot: EngineSlot, kv: EngineKv, model: LlamaModel
) -> None:
    """Carry out `command` on the idle `slot`; its answer or its error goes to its callbacks."""
    try:
        if command.action == "save":
            command.on_done(_save(command, slot, kv))
        elif command.action == "restore":
            command.on_done(_restore(command, slot, kv, model))
        else:
            n_erased = len(slot.tokens)
            kv.clear(slot)
            command.on_done({"id_slot": slot.id, "n_erased": n_erased})
    except EngineError as error:
        command.on_error(error)


def _save(command: SlotCommand, slot: EngineSlot, kv: EngineKv) -> dict[str, Any]:
    assert command.path is not None
    started = time.perf_counter()
    state = kv.read_state(slot)
    # a unified cache saves as llama-server with the same -np and per-slot KV would
    layout = (kv.n_slots, slot.id) if kv.shared is not None else None
    data = encode_slot_file(slot.tokens, engine_to_server(state, layout))
    try:
        command.path.write_bytes(data)
    except OSError as exc:
        raise EngineError(500, "Unable to save slot") from exc
    return {
        "id_slot": slot.id,
        "filename": command.filename,
        "n_saved": len(slot.tokens),
        "n_written": len(data),
        "timings": {"save_ms": 1e3 * (time.perf_counter() - started)},
    }


def _restore(
    command: SlotCommand, slot: EngineSlot, kv: EngineKv, model: LlamaModel
) -> dict[str, Any]:
    """On any failure the slot is cleared and the answer is 400, as in llama-server."""
    assert command.path is not None
    started = time.perf_counter()
    try:
        data = command.path.read_bytes()
        header = parse_slot_file(data)
        tokens = list(header.tokens)
        if len(tokens) > slot.n_ctx:
            raise SlotFileError("Restored prompt does not fit in the slot context")
        if not model.valid(tokens):
            raise SlotFileError("Invalid tokens in slot save file")
        state = server_to_engine(
            data[header.state_offset :], slot.id, unified=kv.shared is not None
        )
        if not kv.write_state(slot, state):
            raise SlotFileError("No available space in KV cache or invalid slot save file")
    except (OSError, SlotFileError, StateFormatError) as exc:
        kv.clear(slot)
        raise EngineError(400, f"Unable to restore slot: {exc}") from exc
    slot.tokens = tokens
    kv.reset_shared(slot)
    return {
        "id_slot": slot.id,
        "filename": command.filename,
        "n_restored": len(tokens),
        "n_read": len(data),
        "timings": {"restore_ms": 1e3 * (time.perf_counter() - started)},
    }
