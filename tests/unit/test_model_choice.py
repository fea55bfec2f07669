"""Which upstreams a request naming a model may be placed on, and the merged model list."""

from __future__ import annotations

import asyncio

import pytest

from cacheproxy.errors import ApiError
from cacheproxy.http.model_routes import merged_models
from cacheproxy.slots.model_choice import named_model, serving_tables
from cacheproxy.slots.router_instances import InstanceGate, router_models
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import UpstreamSlots


def plain(index: int, *names: str) -> UpstreamSlots:
    table = UpstreamSlots(index, Upstream(f"http://plain-{index}"), [])
    table.model_names, table.model_id = frozenset(names), names[0] if names else None
    return table


def instance(index: int, model: str, *aliases: str) -> UpstreamSlots:
    upstream = Upstream("http://router")
    upstream.model = model
    table = UpstreamSlots(index, upstream, [])
    table.model_names, table.model_id = frozenset({model, *aliases}), model
    return table


def indices(tables: list[UpstreamSlots]) -> list[int]:
    return [table.index for table in tables]


def refusal(call: object) -> tuple[int, str, str]:
    with pytest.raises(ApiError) as refused:
        call()  # type: ignore[operator]
    return refused.value.status, refused.value.error_type, refused.value.message


MIXED = [instance(0, "alpha", "a"), instance(1, "beta"), plain(2, "gamma")]


def test_a_named_model_goes_only_where_it_is_served_by_name_or_alias() -> None:
    assert indices(serving_tables(MIXED, "alpha")) == [0]
    assert indices(serving_tables(MIXED, "a")) == [0]
    assert indices(serving_tables(MIXED, "beta")) == [1]
    assert indices(serving_tables(MIXED, "gamma")) == [2]


def test_no_model_goes_to_the_plain_servers_and_only_routers_refuse_it() -> None:
    assert indices(serving_tables(MIXED, None)) == [2]
    assert refusal(lambda: serving_tables(MIXED[:2], None)) == (
        400,
        "invalid_request_error",
        "model name is missing from the request",
    )


def test_a_model_nobody_serves_gets_the_routers_answer() -> None:
    assert refusal(lambda: serving_tables(MIXED, "delta")) == (
        400,
        "invalid_request_error",
        "model 'delta' not found",
    )
    # several plain servers of different models: the same
    assert refusal(lambda: serving_tables([plain(0, "x"), plain(1, "y")], "z"))[0] == 400


def test_with_one_model_everywhere_the_name_is_not_looked_at() -> None:
    same = [plain(0, "/models/a.gguf"), plain(1, "/models/a.gguf"), plain(2)]
    assert indices(serving_tables(same, "gpt-4o")) == [0, 1, 2]
    assert indices(serving_tables(same, None)) == [0, 1, 2]
    # the same file kept in another folder on another host: still one model
    moved = [plain(0, "/srv/models/a.gguf"), plain(1, "/data/a.gguf")]
    assert indices(serving_tables(moved, "gpt-4o")) == [0, 1]
    # two files: two models, and a name neither serves is refused
    assert (
        refusal(lambda: serving_tables([plain(0, "/m/a.gguf"), plain(1, "/m/b.gguf")], "c"))[0]
        == 400
    )


def test_an_allow_list_limits_the_tables_and_refuses_the_rest() -> None:
    allowed = frozenset({"alpha", "gamma"})
    assert indices(serving_tables(MIXED, "a", allowed)) == [0]
    assert indices(serving_tables(MIXED, None, allowed)) == [2]
    assert refusal(lambda: serving_tables(MIXED, "beta", allowed)) == (
        403,
        "permission_error",
        "model 'beta' is not available to this API key",
    )
    # a model nobody serves is still the router's 400, allowed or not
    assert refusal(lambda: serving_tables(MIXED, "delta", allowed))[0] == 400


def test_the_model_a_body_names() -> None:
    assert named_model({"model": "alpha"}) == "alpha"
    assert named_model({"model": ""}) is None
    assert named_model({"model": 3}) is None
    assert named_model({}) is None


def test_a_routers_model_list_is_read_with_each_status() -> None:
    answer = {
        "data": [
            {"id": "alpha", "aliases": ["a"], "status": {"value": "loaded"}},
            {"id": "beta", "status": {"value": "unloaded", "failed": True}},
            {"id": "gamma"},
            {"no": "id"},
        ]
    }
    models = {model.name: model for model in router_models(answer)}
    assert sorted(models) == ["alpha", "beta", "gamma"]
    assert models["alpha"].names == {"alpha", "a"} and models["alpha"].running
    assert not models["beta"].running
    assert models["gamma"].status == "unloaded"
    assert router_models({"error": "x"}) == []


async def test_an_unload_waits_for_the_requests_admitted_and_keeps_new_ones_out() -> None:
    gate = InstanceGate()
    assert gate.enter()
    gate.closing = True
    assert not gate.enter()  # a switch is pending: new requests wait for it
    busy = [True]
    drained = asyncio.ensure_future(gate.drained(lambda: busy[0]))
    await asyncio.sleep(0.1)
    assert not drained.done()
    gate.leave()
    await asyncio.sleep(0.1)
    assert not drained.done()  # a slot is still held (a background save)
    busy[0] = False
    await asyncio.wait_for(drained, 5)


def test_the_merged_list_names_each_model_once_with_its_status_as_a_tenant_may_see_it() -> None:
    router = {
        "data": [
            {"id": "alpha", "status": {"value": "loaded"}},
            {"id": "beta", "aliases": ["b"], "status": {"value": "unloaded"}},
        ]
    }
    plain_answer = {
        "models": [{"name": "gamma", "model": "gamma"}],
        "data": [{"id": "gamma", "aliases": ["gamma"]}],
    }
    again = {"data": [{"id": "alpha", "status": {"value": "loading"}}]}
    merged = merged_models([router, plain_answer, again], None)
    assert [(m["id"], m["status"]["value"]) for m in merged["data"]] == [
        ("alpha", "loaded"),
        ("beta", "unloaded"),
        ("gamma", "loaded"),
    ]
    assert merged["models"] == [{"name": "gamma", "model": "gamma"}]
    limited = merged_models([router, plain_answer], frozenset({"b", "gamma"}))
    assert [m["id"] for m in limited["data"]] == ["beta", "gamma"]
    assert [m["id"] for m in merged_models([router], frozenset({"gamma"}))["data"]] == []
