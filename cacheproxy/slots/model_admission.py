"""A task request's model at admission: the upstreams that may serve it (model_choice.py, its
tenant's allow list included), a router's instance of it loaded when none is
(router_instances.py), and the request counted on that instance until it ends, so that no
unload takes the instance from under it."""

from __future__ import annotations

from dataclasses import replace

from cacheproxy.errors import ApiError
from cacheproxy.slots.model_choice import named_model, serving_tables
from cacheproxy.slots.request import PlacedRequest
from cacheproxy.slots.router_instances import RouterInstances
from cacheproxy.upstreams.slot_table import UpstreamSlots


class ModelAdmission:
    def __init__(self, tables: list[UpstreamSlots], routers: RouterInstances) -> None:
        self.tables = tables  # the monitor's list
        self.routers = routers

    def placeable(self) -> list[UpstreamSlots]:
        """Every table a request may be placed on (a router's own table never is)."""
        return [table for table in self.tables if not table.router]

    async def admit(self, placed: PlacedRequest) -> PlacedRequest:
        """`placed` with the tables it may be placed on (None: any), a model instance loaded
        for it if it needs one; refused as llama-server's router refuses a model it cannot
        serve (400), or 403 for a model outside the tenant's allow list."""
        candidates = self.placeable()
        model = named_model(placed.document)
        chosen = serving_tables(candidates, model, placed.caller.allowed_models)
        usable = await self.routers.admit(chosen)
        if not usable:
            if any(table.loading for table in chosen):
                raise ApiError(503, "Loading model")  # llama-server's own answer while loading
            names = ", ".join(sorted({table.upstream.name for table in chosen}))
            raise ApiError(502, f"no upstream serving the model is reachable: {names}")
        admitted = tuple(table for table in usable if self.routers.is_instance(table))
        if len(usable) == len(candidates):  # any table: the scheduler need not look
            return replace(placed, admitted=admitted) if admitted else placed
        return replace(placed, tables=frozenset(t.index for t in usable), admitted=admitted)

    def leave(self, placed: PlacedRequest) -> None:
        """The request ended: it no longer keeps its model instance loaded."""
        if placed.admitted:
            self.routers.leave(list(placed.admitted))

    def allowed(self, placed: PlacedRequest) -> list[UpstreamSlots]:
        """The tables `placed` may be placed on."""
        if placed.tables is None:
            return self.placeable()
        return [table for table in self.tables if table.index in placed.tables]
