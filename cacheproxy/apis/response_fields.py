"""A body's `response_fields`, as llama-server reads it and projects an answer by it.

llama-server keeps only the named fields of a native final answer, and of the native answer an
OpenAI answer carries in `__verbose` (tools/server/server-task.cpp
`server_task_result_cmpl_final::to_json_non_oaicompat`). The proxy needs the whole answer (what
the task cost, what the slot holds), so it asks for it whole and makes the projection itself
(`cacheproxy.apis.observe`).
"""

from __future__ import annotations

from typing import Any


def fields_asked(response_fields: object) -> tuple[str, ...] | None:
    """The fields a body's `response_fields` keeps of a native final answer (and of an OpenAI
    answer's `__verbose`): a non-empty list of strings; llama-server ignores anything else
    (`json_value` falls back to no projection, tools/server/server-schema.cpp)."""
    if not isinstance(response_fields, list) or not response_fields:
        return None
    if not all(isinstance(field, str) for field in response_fields):
        return None
    return tuple(response_fields)


def projected(document: dict, fields: tuple[str, ...]) -> dict:
    """`document` as llama-server projects it by `response_fields`
    (tools/server/server-common.cpp `json_get_nested_values`): each field a path of keys
    separated by `/`, kept under the path itself where the whole path exists; its JSON object
    keeps keys in order (nlohmann's default object is an ordered map)."""
    kept: dict[str, Any] = {}
    for path in fields:
        current: Any = document
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            kept[path] = current
    return {path: kept[path] for path in sorted(kept)}
