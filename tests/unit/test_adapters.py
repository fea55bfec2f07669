"""The LoRA scales a task runs under, read from its body as llama-server reads it."""

from __future__ import annotations

import math

from cacheproxy.upstreams.adapters import (
    UNREADABLE,
    as_float32,
    effective,
    loaded,
    requested,
)


def test_a_body_naming_no_scales_runs_under_the_global_ones() -> None:
    for document in ({}, {"lora": None}, {"lora": []}):
        assert requested(document) is None
        assert effective(requested(document), (1.0, 0.5)) == (1.0, 0.5)


def test_named_scales_are_read_as_the_server_reads_them() -> None:
    # a later entry for an id wins; ids not named run at 0; ids not loaded are ignored
    document = {"lora": [{"id": 1, "scale": 0.3}, {"id": 0, "scale": 2}, {"id": 1, "scale": 0.1}]}
    asked = requested(document)
    assert asked == ((0, 2.0), (1, as_float32(0.1)))
    assert effective(asked, (1.0, 1.0, 1.0)) == (2.0, as_float32(0.1), 0.0)
    assert effective(requested({"lora": [{"id": 5, "scale": 1.0}]}), (1.0,)) == (0.0,)
    # 0.1 as a double and as the C float the server keeps are one scale
    assert requested({"lora": [{"id": 0, "scale": 0.1}]}) == requested(
        {"lora": [{"id": 0, "scale": as_float32(0.1)}]}
    )


def test_a_body_the_server_would_read_otherwise_matches_no_slot() -> None:
    for lora in ("all", [1], [{"id": "0", "scale": 1}], [{"id": 0, "scale": "1"}], [{"id": True}]):
        assert requested({"lora": lora}) is UNREADABLE
        assert effective(UNREADABLE, (1.0,)) is None
    assert math.isnan(UNREADABLE[0][1])  # equal to nothing, itself included


def test_the_global_scales_come_from_the_adapter_list() -> None:
    report = [
        {"id": 1, "path": "b.gguf", "scale": 0.25},
        {"id": 0, "path": "a.gguf", "scale": 1.0},
    ]
    assert loaded(report) == ((1.0, 0.25), ("a.gguf", "b.gguf"))
    assert loaded([]) == ((), ())
    assert loaded({"error": {"code": 404}}) == ((), ())
    assert loaded([{"id": 0, "scale": None}]) == ((), ())
