"""Router-mode llama-servers: a table per model instance, each model loaded when asked for.

A llama-server started with no model (`--models-dir DIR`, `--models-preset FILE`) is a router
(tools/server/server.cpp:150-153); in the pinned tree:

- `GET /props` answers `"role": "router"` and `max_instances` (`--models-max`, default 4) for
  the router itself (server-models.cpp:1991-2014); `GET /models` lists every model with its
  `status.value`: unloaded, loading, loaded or sleeping (2085-2141; server-models.h:20-38).
- It starts one child llama-server per model on demand, with the router's own arguments (-np,
  --ctx-size, --cache-ram, --slot-save-path, --metrics...: server-models.cpp:594-611, 741-746;
  seen in a run as each model's `status.args`), and routes a POST by its body's "model", a GET
  by `?model=` (2016-2062). Without a model it answers 400 "model name is missing from the
  request", `GET /slots` included, which is why a router looked dead to the proxy before.
- Asked for a model it has not loaded, it loads it (`autoload`, unless `--no-models-autoload`
  or `?autoload=false`), first stopping the least recently used idle instance once
  `--models-max` run (`server_lru_sched`, 359-429: never one with a request in flight).
  A stopped instance's slots are gone with its process; a new one numbers its tasks afresh.

So the router's own table has no slots (`UpstreamSlots.router`), and every model it lists gets
a table of its own, on an `Upstream` naming the model: the proxy's calls reach that instance and
never load it (`Upstream.own_url`). `GET /models` each health round tells every instance's
state: one the router unloaded (`--models-max`, an explicit unload, a failed load) has lost its
slots, and its table is emptied before anything is placed there again; one loaded by someone
else is read (probed) when a request for its model comes, not before (`checked`); a sleeping
one is the monitor's, as a plain server's sleep is.

A request for a model whose instance is not loaded loads it (`load`). At the router's limit, the
instance the proxy used least recently is unloaded first, by the proxy: the requests admitted to
it leave (`InstanceGate`; new ones wait, so a switch is never starved), its idle slots worth
keeping are archived by the disk tier, and only then is it unloaded, so the table knows before
it places anything there again. The model asked for is loaded, its table built (probe,
fingerprint, RAM-cache shadow) and its archives come back through the disk tier as its requests
arrive: each model has its own compatibility fingerprint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import quote

import aiohttp
import orjson

from cacheproxy.disk.tier import DiskTier
from cacheproxy.errors import ApiError
from cacheproxy.upstreams.client import UnsuitableUpstream, UpstreamClient
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import SlotState, UpstreamSlots

log = logging.getLogger(__name__)

RUNNING = frozenset({"loading", "loaded", "sleeping"})  # server-models.h `is_running`
POLL_S = 0.05  # how often a switch looks whether requests left, or the router unloaded
UNLOAD_ARCHIVE_S = 60.0  # the longest an unload waits for its slots to be archived
UNLOAD_WAIT_S = 30.0  # the router force-kills an instance 10 s after asking it to stop


@dataclass(frozen=True)
class RouterModel:
    """One entry of a router's `GET /models`."""

    name: str
    aliases: frozenset[str]
    status: str

    @property
    def names(self) -> frozenset[str]:
        return frozenset({self.name, *self.aliases})

    @property
    def running(self) -> bool:
        return self.status in RUNNING


def router_models(answer: object) -> list[RouterModel]:
    """The models a router's `GET /models` lists (pure)."""
    entries = answer.get("data") if isinstance(answer, dict) else None
    found = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        status = entry.get("status")
        value = status.get("value") if isinstance(status, dict) else None
        aliases = entry.get("aliases") if isinstance(entry.get("aliases"), list) else []
        found.append(
            RouterModel(
                entry["id"],
                frozenset(alias for alias in aliases if isinstance(alias, str)),
                value if isinstance(value, str) else "unloaded",
            )
        )
    return found


async def learn_model_names(client: UpstreamClient, table: UpstreamSlots) -> None:
    """A plain server's model names: the ids and aliases its `GET /v1/models` lists (its
    `--alias`, else its model file's path: server.cpp:188-191); left as they were when it does
    not say."""
    try:
        answer = await client.models(table.upstream)
    except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream, ValueError):
        return
    names: list[str] = []
    for entry in answer.get("data") or [] if isinstance(answer, dict) else []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            names.append(entry["id"])
            names += [a for a in entry.get("aliases") or [] if isinstance(a, str)]
    if names:
        table.model_names, table.model_id = frozenset(names), names[0]


class InstanceGate:
    """The requests admitted to one model instance, and whether an unload waits for them to
    leave (new ones are then kept out, so the unload is not starved)."""

    def __init__(self) -> None:
        self.users = 0
        self.closing = False

    def enter(self) -> bool:
        if self.closing:
            return False
        self.users += 1
        return True

    def leave(self) -> None:
        self.users -= 1

    async def drained(self, busy: Callable[[], bool]) -> None:
        """Wait until no admitted request is left and nothing holds a slot (`busy`): looked at
        every `POLL_S` (a slot is given back by the scheduler, which tells nobody; an unload
        is rare and slow next to that)."""
        while self.users > 0 or busy():  # noqa: ASYNC110 - see above
            await asyncio.sleep(POLL_S)


@dataclass(eq=False)
class Router:
    """A router-mode upstream: its own table, its limit, a table per model it lists."""

    table: UpstreamSlots
    max_instances: int  # <= 0: no limit
    autoload: bool  # it loads a model a request names (else: 400 "model is not loaded")
    instances: dict[str, UpstreamSlots] = field(default_factory=dict)
    switching: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load at a time
    answering: bool = True


def _last_used(table: UpstreamSlots) -> float:
    return max((slot.last_used for slot in table.slots), default=0.0)


def _any_busy(slots: list[SlotState]) -> bool:
    return any(slot.busy for slot in slots)


class RouterInstances:
    """The router-mode upstreams and their model instances' tables, kept in the monitor's
    table list (`tables`, appended to as models appear)."""

    def __init__(
        self,
        client: UpstreamClient,
        load_client: UpstreamClient,
        tables: list[UpstreamSlots],
        rebuild: Callable[[UpstreamSlots], Awaitable[None]],
        disk: DiskTier | None,
        owner_of: Callable[[SlotState], str | None],
    ) -> None:
        self.client = client  # bounded by the health timeout
        self.load_client = load_client  # bounded by routing.model_load_timeout_s
        self.tables = tables
        self.rebuild = rebuild  # the monitor's: a table read afresh (probe, disk tier, shadow)
        self.disk = disk
        self.owner_of = owner_of
        self.routers: list[Router] = []
        self.gates: dict[int, InstanceGate] = {}
        self._by_table: dict[int, Router] = {}  # instance table index -> its router

    # -- finding routers and their models --------------------------------------------------------

    async def adopt(self, table: UpstreamSlots) -> bool:
        """Whether `table`'s upstream is a router; if so `table` becomes the router's, and
        every model it lists gets a table. False when it is not, or does not answer."""
        try:
            props = await self.client.get_json(table.upstream, "/props")
        except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream, ValueError):
            return False
        if not isinstance(props, dict) or props.get("role") != "router":
            return False
        limit = props.get("max_instances")
        autoload = props.get("models_autoload") is not False
        router = Router(table, limit if isinstance(limit, int) else 0, autoload)
        table.router, table.healthy, table.slots = True, False, []
        self.routers.append(router)
        await self.refresh(router)
        log.info(
            "upstream %s is a router: models %s, at most %s loaded",
            table.upstream.base_url,
            ", ".join(sorted(router.instances)) or "none",
            router.max_instances if router.max_instances > 0 else "any number",
        )
        return True

    def checked(self, table: UpstreamSlots) -> bool:
        """Whether the monitor checks `table`: not a router's own, and not a model instance
        whose table is not built (unloaded, or loaded by someone else: it is read, probe and
        all, when a request for its model comes, never behind the router's back, since every
        POST the proxy sent would make it the router's most recently used)."""
        if table.router:
            return False
        return table.healthy or not self.is_instance(table)

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(router) for router in self.routers))

    async def refresh(self, router: Router) -> None:
        """Read the router's `GET /models`: new models get tables, instances it unloaded
        are emptied, those it runs are checked by the monitor."""
        upstream = router.table.upstream
        try:
            answer = await self.client.get_json(upstream, "/models")
        except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream, ValueError) as exc:
            if router.answering:
                log.warning("router %s is not answering (%r)", upstream.base_url, exc)
            router.answering = False
            for table in router.instances.values():
                if table.healthy or table.unloaded:
                    self._lost(table)
                table.unloaded = False  # not known: nothing can be loaded there now
            return
        router.answering = True
        listed = set()
        for model in router_models(answer):
            listed.add(model.name)
            table = router.instances.get(model.name) or self._add(router, model.name)
            table.model_names = model.names
            table.upstream.held = upstream.held
            if model.running:
                table.unloaded = False
                table.loading = model.status == "loading"
            else:
                self._unloaded(table)
        for name, table in router.instances.items():
            if name not in listed:  # gone from its source: never placed on again
                table.model_names = frozenset()
                self._unloaded(table)

    def _add(self, router: Router, name: str) -> UpstreamSlots:
        upstream = Upstream(router.table.upstream.base_url, held=router.table.upstream.held)
        upstream.model = name
        table = UpstreamSlots(len(self.tables), upstream, [], healthy=False)
        table.model_id, table.unloaded = name, True
        self.tables.append(table)
        router.instances[name] = table
        self.gates[table.index] = InstanceGate()
        self._by_table[table.index] = router
        return table

    def _unloaded(self, table: UpstreamSlots) -> None:
        """The router does not run the instance: whatever its slots held is gone."""
        if table.unloaded:
            return
        if table.healthy:
            log.info("model instance %s was unloaded: its slots are gone", table.upstream.name)
        self._lost(table)
        table.unloaded, table.loading = True, False

    def _lost(self, table: UpstreamSlots) -> None:
        table.healthy = False
        table.clear()
        table.new_process()  # a new instance numbers its tasks from the start
        if self.disk is not None:
            self.disk.detach(table)  # attached again, fingerprint and all, when loaded

    def follow_leases(self) -> None:
        """Model instances are held (cluster/keeper.py) as their router is."""
        for router in self.routers:
            for table in router.instances.values():
                table.upstream.held = router.table.upstream.held

    # -- admitting requests, loading models --------------------------------------------------

    def is_instance(self, table: UpstreamSlots) -> bool:
        return table.index in self._by_table

    async def admit(self, chosen: list[UpstreamSlots]) -> list[UpstreamSlots]:
        """The tables of `chosen` a request may be placed on now; it is counted on the model
        instances among them until `leave`. When none is loaded, one is loaded first (empty:
        none can be, every router serving them is down)."""
        while True:
            usable = []
            for table in chosen:
                gate = self.gates.get(table.index)
                if table.healthy and (gate is None or gate.enter()):
                    usable.append(table)
            if usable:
                return usable
            loadable = [t for t in chosen if self.may_load(t)]
            if not loadable:
                return []
            if await self.load(loadable[0]):
                return [loadable[0]]

    def leave(self, tables: list[UpstreamSlots]) -> None:
        for table in tables:
            gate = self.gates.get(table.index)
            if gate is not None:
                gate.leave()

    def _in_use(self, table: UpstreamSlots) -> bool:
        return self.gates[table.index].users > 0 or _any_busy(table.slots)

    def may_load(self, table: UpstreamSlots) -> bool:
        """Whether `table` is a model instance a request may have loaded (or read, when the
        router runs it already): its router answers and lists the model."""
        return self.is_instance(table) and self._loadable(table)

    def _loadable(self, table: UpstreamSlots) -> bool:
        return self._by_table[table.index].answering and bool(table.model_names)

    async def load(self, table: UpstreamSlots) -> bool:
        """Load the model of instance `table` (at the router's limit, unloading the instance
        used least recently first) and build its table; True once the caller is admitted to
        it. Raises the router's refusal when it cannot load it."""
        router = self._by_table[table.index]
        gate = self.gates[table.index]
        async with router.switching:
            if table.healthy:
                return gate.enter()  # loaded by the request before in line
            await self.refresh(router)
            if table.unloaded:
                if not router.autoload:  # --no-models-autoload: the router's own answer
                    raise ApiError(400, "model is not loaded")
                running = [t for t in router.instances.values() if not t.unloaded]
                if 0 < router.max_instances <= len(running):
                    victim = min(running, key=lambda t: (self._in_use(t), _last_used(t)))
                    await self._unload(router, victim)
            await self._load_now(router, table)
            return gate.enter()

    async def _unload(self, router: Router, victim: UpstreamSlots) -> None:
        """Unload `victim` for another model: once its requests left, its slots archived."""
        gate = self.gates[victim.index]
        gate.closing = True
        try:
            await gate.drained(lambda: _any_busy(victim.slots))
            if self.disk is not None and victim.healthy:
                report = await self.disk.drain(
                    [victim], self.owner_of, time.monotonic() + UNLOAD_ARCHIVE_S
                )
                if report.saved or report.left:
                    log.info(
                        "model instance %s: %d slot(s) archived before its unload%s",
                        victim.upstream.name,
                        report.saved,
                        f"; not archived: {'; '.join(report.left)}" if report.left else "",
                    )
            victim.healthy = False  # nothing more is placed, or saved, there
            await gate.drained(lambda: _any_busy(victim.slots))  # a background save under way
            unload = {"model": victim.upstream.model}
            try:
                await self.client.post_json(router.table.upstream, "/models/unload", unload)
            except aiohttp.ClientResponseError as exc:
                if exc.status != 400:  # 400: it is not running (any more)
                    raise
            await self._until_stopped(router, victim)
            self._unloaded(victim)
            log.info("model instance %s unloaded for another model", victim.upstream.name)
        finally:
            gate.closing = False

    async def _until_stopped(self, router: Router, victim: UpstreamSlots) -> None:
        """Wait until the router lists `victim` as not running (its process exits)."""
        deadline = time.monotonic() + UNLOAD_WAIT_S
        while time.monotonic() < deadline:
            answer = await self.client.get_json(router.table.upstream, "/models")
            status = {model.name: model for model in router_models(answer)}
            model = status.get(victim.upstream.model or "")
            if model is None or not model.running:
                return
            await asyncio.sleep(POLL_S)

    async def _load_now(self, router: Router, table: UpstreamSlots) -> None:
        """Have the router load the instance's model (`GET /slots?model=&autoload=true`
        returns once it is loaded: `ensure_model_ready`, server-models.cpp:1485-1602, and it
        queues behind the router's limit) and build its table."""
        name = table.upstream.model or ""
        base = router.table.upstream.transport_base
        url = f"{base}/slots?model={quote(name, safe='')}&autoload=true"
        client = self.load_client
        table.loading = True
        started = time.monotonic()
        try:
            async with client.session.get(url, headers=client.headers, **client.bound) as answer:
                body = await answer.read()
                if answer.status != 200:
                    raise ApiError(answer.status, _message(body, f"model '{name}' did not load"))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(502, f"router {router.table.upstream.base_url}: {exc!r}") from exc
        finally:
            table.loading = False
        table.unloaded = False
        await self.rebuild(table)
        if not table.healthy:
            raise ApiError(502, f"model instance {table.upstream.name} loaded but not usable")
        log.info(
            "model instance %s loaded in %.2f s", table.upstream.name, time.monotonic() - started
        )


def _message(body: bytes, default: str) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return default
