"""The upstream monitor: reads every upstream's slots at start-up, then keeps the tables honest.

Health every few seconds, `GET /slots` now and then: an upstream that went away or restarted
gets its table rebuilt (and re-attached to the disk tier), and slots the table has wrong are
corrected. The executor asks it for an upstream when every one is down.

None of this keeps an idle server from sleeping (`--sleep-idle-seconds`). In the pinned tree,
every task posted to the server's queue resets its idle timer except a metrics task
(tools/server/server-queue.cpp:24-26 `task_resets_idle_timer`, 36-45), and every route but
`/health`, `/metrics`, `GET /props` and `/models` waits for a sleeping server to wake
(server-context.cpp:4582-4588 `server_res_generator`, `create_response(true)` at 5012, 5030,
5161, 5429). `GET /slots` posts a task and wakes it (5085-5097). So the health check is
`GET /props`, which also says `is_sleeping` (4990, 5163-5168), and `GET /slots` is read only
after the proxy has used the upstream since the last reading (or when asked to now). A sleeping
server has freed its context (server-context.cpp:1055-1070 `handle_sleeping_state`: destroy(),
then load_model() on waking), so its slots are empty in the table as soon as it is seen asleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import aiohttp

from cacheproxy.disk.tier import DiskTier
from cacheproxy.errors import ApiError
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.ops.supervise import repeat
from cacheproxy.plugins import load_plugin
from cacheproxy.prompt_cache import PromptCacheDeps
from cacheproxy.settings import RoutingSettings
from cacheproxy.slots.router_instances import RouterInstances, learn_model_names
from cacheproxy.slots.scheduler import SlotScheduler
from cacheproxy.slots.slot_learning import SlotLearning
from cacheproxy.slots.slot_reports import (
    idle_since,
    process_restarted,
    server_n_ctx,
    version_sum,
)
from cacheproxy.upstreams.client import (
    ProbeResult,
    UnsuitableUpstream,
    UpstreamClient,
    inspect_upstream,
    probe_upstream,
    ram_cache_state,
    read_adapters,
    read_n_vocab,
    take_findings,
)
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.ram_shadow import DEFAULT_BYTES_PER_TOKEN, MIB, RamCacheShadow
from cacheproxy.upstreams.slot_table import SlotState, UpstreamSlots

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0  # each call of the start-up probe (one-token completions) at most


class UpstreamMonitor:
    """Owns the upstreams' tables: their health, and their rebuilding after a restart."""

    def __init__(
        self,
        upstreams: list[Upstream],
        client: UpstreamClient,
        settings: RoutingSettings,
        scheduler: SlotScheduler,
        metrics: ProxyMetrics,
        disk: DiskTier | None = None,
        owner_of: Callable[[SlotState], str | None] = lambda slot: slot.tenant,
        on_new_process: Callable[[Upstream], None] = lambda upstream: None,
    ) -> None:
        self.upstreams = upstreams
        # told of each server process first seen at an upstream (at start, after a restart):
        # what was made of the one before (its tokens, its template) may not hold for it
        self.on_new_process = on_new_process
        # every call the monitor makes has a short bound of its own: a stopped (SIGSTOP) or
        # wedged server must be found down, not waited for for the session's hour
        self.client = client.with_timeout(settings.health_timeout_s)
        # the probe runs completions, which a loaded server may be slower to answer
        self.probe_client = client.with_timeout(max(settings.health_timeout_s, PROBE_TIMEOUT_S))
        self.settings = settings
        self.scheduler = scheduler
        self.metrics = metrics
        self.disk = disk
        # what the slots of a table built afresh hold, from their last holder's claims (set by
        # the cache layer where claims are kept)
        self.learning: SlotLearning | None = None
        self.tables: list[UpstreamSlots] = []
        self._task: asyncio.Task[None] | None = None
        self._checks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._check_now = asyncio.Event()
        # per upstream, the sum of its slots' versions when GET /slots was last read: the same
        # sum now means the proxy has not used its slots since, and nothing needs reading
        self._read_at: dict[int, int] = {}
        # per upstream, when the proxy last knew it was the same process (its slots read, or a
        # request of its own running there): `recheck_idle` reads it again after a quiet spell
        self._known_at: dict[int, float] = {}
        self._rechecks: dict[int, asyncio.Task[None]] = {}
        # router-mode upstreams: their model instances' tables, in `tables` beside the others
        self.routers = RouterInstances(
            self.client,
            client.with_timeout(settings.model_load_timeout_s),
            self.tables,
            self._build_instance,
            disk,
            owner_of,
        )

    # -- life cycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Read every upstream's slots; refuse (raise) a server the table cannot follow."""
        for upstream in self.upstreams:
            index = len(self.tables)  # a router's model instances take the places after it
            self.tables.append(UpstreamSlots(index, upstream, [], healthy=False))
            if not upstream.held:  # another proxy's: not even probed (the probe uses slots)
                continue
            if await self.routers.adopt(self.tables[index]):
                continue
            try:
                table = await self._inspect(index, upstream)
            except (aiohttp.ClientError, TimeoutError) as exc:  # UnsuitableUpstream goes on up
                log.warning(
                    "upstream %s is not answering (%s); routing around it", upstream.base_url, exc
                )
                table = UpstreamSlots(index, upstream, [], healthy=False)
                table.loading = isinstance(exc, aiohttp.ClientResponseError) and exc.status == 503
            self.tables[index] = table
            if table.healthy:
                await learn_model_names(self.client, table)
                self._known_at[index] = time.monotonic()
                await self._attach_disk(table)
                await self._learn(table)
                self._follow_ram_cache(table)
                self.on_new_process(upstream)
                log.info(
                    "upstream %s: %d slots, server RAM cache %s",
                    upstream.base_url,
                    len(table.slots),
                    table.ram_cache_state,
                )
        self.scheduler.tables = self.tables
        self._task = asyncio.create_task(self._watch_upstreams(), name="upstream-monitor")

    async def stop(self) -> None:
        for task in [self._task, *self._rechecks.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def follow_leases(self) -> None:
        """An upstream was taken or given up (cluster/keeper.py): one given up is down for this
        proxy at once (its table no longer tells what its slots hold), one taken is read anew
        by the next check, which this starts now."""
        self.routers.follow_leases()
        for table in self.tables:
            if not table.upstream.held:
                self._mark_down(table, "held by another proxy")
        self.wake()

    def wake(self) -> None:
        """Check every upstream now rather than at the next interval, `GET /slots` included."""
        self._check_now.set()

    async def require_an_upstream(self) -> None:
        """With every upstream down, look again now (one may be back); else answer 502 at once."""
        for table in self.tables:  # a plain loop: asked for every request
            if table.healthy or self.routers.may_load(table):  # a router's model, when asked
                return
        await self._check_all(reconcile=True)
        if not any(table.healthy for table in self.tables):
            raise self._none_serving(502)
        self.scheduler.upstream_changed()

    async def unavailable(self) -> ApiError | None:
        """Why no upstream can take a request now (None: one can; one held by another proxy
        of a cluster serves through it): llama-server's 503 while one loads its model, else a
        503 naming them. The upstreams in service are asked now (`GET /health`, side by side,
        each bounded by `routing.health_timeout_s`): one that died since the last check is
        not taken for serving. Where none answers, a check of all of them runs now, so that
        the monitor's tables follow at once, and an upstream back is found as soon."""
        if any(not table.upstream.held for table in self.tables):
            return None
        serving = [table.upstream for table in self.tables if table.healthy]
        # a router whose models a request may load serves when the router itself answers
        routers = {t.upstream.base_url for t in self.tables if self.routers.may_load(t)}
        serving += [Upstream(base_url) for base_url in routers]
        answers = await asyncio.gather(*(self._answers(upstream) for upstream in serving))
        if any(status == 200 for status in answers):
            return None
        self.wake()
        if 503 in answers:
            return ApiError(503, "Loading model")  # llama-server's own answer while loading
        return self._none_serving(503)

    async def _answers(self, upstream: Upstream) -> int | None:
        """The status of the upstream's `GET /health` (None: no answer)."""
        try:
            await self.client.get_json(upstream, "/health")
        except aiohttp.ClientResponseError as exc:
            return exc.status
        except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream, ValueError):
            return None
        return 200

    def _none_serving(self, status: int) -> ApiError:
        if any(table.loading for table in self.tables):
            return ApiError(503, "Loading model")  # llama-server's own answer while loading
        names = ", ".join(upstream.base_url for upstream in self.upstreams)
        return ApiError(status, f"no upstream is reachable: {names}")

    async def recheck_idle(self) -> None:
        """Before a request is placed: read the slots of every upstream the proxy has sent
        nothing for `routing.recheck_idle_s`. A server that restarted meanwhile, quicker than a
        health check, is found now (`process_restarted`), before a request is placed on slots
        or a RAM cache it lost (else the first answers show it, each one decoded in full). The
        requests that arrive during the check wait for that one check. A sleeping server is
        not woken (`_check_upstream_now` asks `GET /props` first), and a busy one not read:
        its running requests' answers tell."""
        quiet_s = self.settings.recheck_idle_s
        if quiet_s <= 0:
            return
        now = time.monotonic()
        checks = []
        for table in self.tables:
            running = self._rechecks.get(table.index)
            if running is not None and not running.done():
                checks.append(running)
                continue
            if not table.healthy or not table.upstream.held:
                continue
            last_used = idle_since(table)
            if last_used is None:
                continue  # busy: its answers tell
            if now - max(last_used, self._known_at.get(table.index, 0.0)) < quiet_s:
                continue
            self._known_at[table.index] = now  # one check per quiet spell, even a failed one
            check = asyncio.create_task(
                self._check_upstream(table, reconcile=True), name=f"recheck-idle-{table.index}"
            )
            check.add_done_callback(_log_failure)
            self._rechecks[table.index] = check
            checks.append(check)
        if checks:
            # a client that leaves does not cancel the check the others wait for; a wedged
            # upstream holds them no longer than a health check would (the check goes on, and
            # one that finds a restart takes the upstream out of service until it is rebuilt)
            await asyncio.wait(checks, timeout=self.settings.health_timeout_s)

    # -- keeping the tables right ------------------------------------------------------------

    async def _watch_upstreams(self) -> None:
        """Health every few seconds, `GET /slots` now and then: an upstream that went away or
        restarted gets its table rebuilt, and slots the table has wrong are corrected."""
        interval = self.settings.health_interval_s
        checks_per_reconcile = max(int(self.settings.reconcile_interval_s / interval), 1)
        ticks = itertools.count()

        async def one_round() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._check_now.wait(), timeout=interval)
            due = next(ticks) % checks_per_reconcile == 0
            asked = self._check_now.is_set()
            self._check_now.clear()
            await self._check_all(asked or due, only_if_used=not asked)
            self.scheduler.upstream_changed()

        await repeat("upstream monitor", one_round, pause_s=0, log=log, after_failure_s=interval)

    async def _check_all(self, reconcile: bool, only_if_used: bool = False) -> None:
        # a router's GET /models first: what it unloaded is not checked (nor loaded) below
        await self.routers.refresh_all()
        # side by side: one upstream that takes its whole timeout does not hold up the others
        results = await asyncio.gather(
            *(
                self._check_upstream(table, reconcile and not self._unused(table, only_if_used))
                for table in self.tables
                if self.routers.checked(table)
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _check_upstream(self, table: UpstreamSlots, reconcile: bool) -> None:
        # one check at a time per upstream: the monitor and a request finding every upstream
        # down must not both rebuild a table (two probes on the same slots confuse both)
        async with self._checks[table.index]:
            await self._check_upstream_now(table, reconcile)

    def _unused(self, table: UpstreamSlots, only_if_used: bool) -> bool:
        """Whether the proxy has not used the upstream's slots since GET /slots was last read
        (always False when `only_if_used` is not asked for)."""
        return only_if_used and self._read_at.get(table.index) == version_sum(table)

    async def _check_upstream_now(self, table: UpstreamSlots, reconcile: bool) -> None:
        if not table.upstream.held:
            self._mark_down(table, "held by another proxy")
            return
        versions = {slot.slot_id: slot.version for slot in table.slots}
        answered = table.tasks_answered  # before the report: every one of them ran before it
        tasked = set(table.tasked_slots)
        try:
            report = None
            if not table.healthy:
                report = await self.client.slots(table.upstream)
            elif await self._asleep(table):
                return  # its slots are empty, and reading them would wake it
            elif reconcile:
                report = await self.client.slots(table.upstream)
        except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream) as exc:
            table.loading = isinstance(exc, aiohttp.ClientResponseError) and exc.status == 503
            self._mark_down(table, exc)
            return
        if table.healthy and report is not None and len(report) != len(table.slots):
            # restarted between two checks with another -np: not the table's server any more
            self._mark_down(table, f"it now has {len(report)} slots, not {len(table.slots)}")
        if table.healthy and report is not None and process_restarted(report, answered, tasked):
            # between two health checks: its slots, and its RAM cache, are empty now
            if any(slot.busy for slot in table.slots):
                # requests already run on the new process: a rebuild would wait for them, and
                # every request meanwhile get 502; forget what the table held, in place (each
                # running task's answer records what its slot holds)
                log.warning(
                    "upstream %s restarted (its slots' task ids began again): table emptied",
                    table.upstream.base_url,
                )
                table.clear()
                table.new_process()
                self.on_new_process(table.upstream)
                await self._follow_new_process(table, report)
                return
            self._mark_down(table, "its slots' task ids began again: it restarted")
        if not table.healthy:
            if self.routers.is_instance(table):
                # one being unloaded since this check began: only its load builds it again
                return
            await self._rebuild(table)
            return
        if report is not None:
            corrected = table.reconcile(report, versions)
            if corrected:
                self.metrics.table_corrections.labels(table.upstream.name).inc(len(corrected))
                log.info(
                    "slots %s of %s corrected from GET /slots", corrected, table.upstream.base_url
                )
            self._read_at[table.index] = version_sum(table)
            self._known_at[table.index] = time.monotonic()
        if not table.ram_cache_known:
            await self._probe_again(table)

    async def _follow_new_process(self, table: UpstreamSlots, report: list[dict]) -> None:
        """A new process found under requests, its table kept in service: what was found of
        the old one is not taken for it. Its slots' contexts are read from `report` and its
        vocabulary asked again; its RAM cache (maybe on now, which tenants must not share) is
        unknown until `_probe_again` finds idle slots (tenants wait, as at start), as are its
        other probe findings; the disk tier attaches again (its model may be another, whose
        archives must not be restored into it); its `verbose` default is learnt again."""
        # before any wait: no request admitted meanwhile may be placed on what the old had
        table.set_ram_cache(ram_cache_state(self.settings.server_ram_cache, None, table.upstream))
        self._follow_ram_cache(table)
        if self.disk is not None:
            self.disk.attach_again(table)
        table.verbose_default = None
        contexts = {entry.get("id"): entry.get("n_ctx") for entry in report}
        for slot in table.slots:
            n_ctx = contexts.get(slot.slot_id)
            if isinstance(n_ctx, int) and n_ctx > 0:
                slot.n_ctx = n_ctx
        table.n_vocab = await read_n_vocab(self.client, table.upstream)
        await read_adapters(self.client, table)

    async def adapters_changed(self, upstream: Upstream) -> None:
        """A `POST /lora-adapters` went through to `upstream`: the global LoRA scales of its
        tables (a router's instances share its address) are read again, so that a request
        naming none runs under the new ones (what the slots hold keeps the scales it was
        computed under: upstreams/adapters.py)."""
        for table in self.tables:
            if table.upstream.transport_base == upstream.transport_base and not table.router:
                await read_adapters(self.client, table)

    async def _probe_again(self, table: UpstreamSlots) -> None:
        """The probe has not looked at this process (the start-up probe found no idle slot, or
        a restart was found under requests): try again on slots that are idle now, kept out of
        the scheduler's reach meanwhile."""
        taken = self.scheduler.take_for_probe(table, min(len(table.slots), 2))
        if taken is None:
            return
        found: ProbeResult | None = None
        try:
            found = await probe_upstream(
                self.probe_client, table.upstream, [slot.slot_id for slot in taken]
            )
        except (aiohttp.ClientError, TimeoutError):
            return  # it went away meanwhile: the next check tells
        except UnsuitableUpstream as exc:
            log.error("upstream %s is unusable: %s", table.upstream.base_url, exc)
            table.healthy = False
            table.clear()
            return
        finally:
            self.scheduler.return_from_probe(taken, None if found is None else found.erased)
        if found.left:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):  # the next check tells
                table.hold_probe_leftovers(found.left, await self.client.slots(table.upstream))
        if found.ram_cache is not None:
            take_findings(table, found, self.settings.server_ram_cache)
            self._follow_ram_cache(table)
            log.info(
                "upstream %s: server RAM cache %s", table.upstream.base_url, table.ram_cache_state
            )

    async def _asleep(self, table: UpstreamSlots) -> bool:
        """The health check (`GET /props`, which a sleeping server answers without waking):
        whether the server sleeps; if it does, its idle slots are empty in the table."""
        props = await self.client.get_json(table.upstream, "/props")
        if not (isinstance(props, dict) and props.get("is_sleeping") is True):
            return False
        emptied = table.emptied_by_sleep()
        # it wakes with its slots and RAM cache made anew (server-context.cpp:1371, 1492): a
        # woken slot shows no task id, which is no restart once the sleep has been seen
        table.new_process()
        if table.ram_shadow is not None:
            table.ram_shadow.reset()
        if emptied:
            log.info("upstream %s sleeps: slots %s are empty", table.upstream.base_url, emptied)
        self._read_at[table.index] = version_sum(table)  # nothing to read until it is used
        return True

    def _mark_down(self, table: UpstreamSlots, why: object) -> None:
        if table.healthy:
            log.warning("upstream %s is down (%s)", table.upstream.base_url, why)
            table.healthy = False
            table.clear()
            if self.disk is not None:
                self.disk.detach(table)  # attached again, fingerprint and all, when back

    async def _rebuild(self, table: UpstreamSlots) -> None:
        """The upstream is back (a restart, or its first appearance): start its table afresh."""
        if any(slot.busy for slot in table.slots):
            return  # requests sent before it went down still hold slots; wait for them
        if not self.routers.is_instance(table) and await self.routers.adopt(table):
            return  # a router (it did not answer at start): its models have tables now
        started = time.monotonic()
        try:
            fresh = await self._inspect(table.index, table.upstream)
        except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream) as exc:
            log.error("upstream %s is back but unusable: %s", table.upstream.base_url, exc)
            return
        if not table.upstream.held:
            return  # given up while it was read (cluster/keeper.py)
        table.slots, table.n_vocab = fresh.slots, fresh.n_vocab
        table.adapters, table.adapter_files = fresh.adapters, fresh.adapter_files
        table.new_process()
        table.ram_cache, table.ram_cache_known = fresh.ram_cache, fresh.ram_cache_known
        table.clears_idle, table.reuses_by_default = fresh.clears_idle, fresh.reuses_by_default
        table.verbose_default = None  # it may have come back with other flags
        await self._attach_disk(table)  # it may have come back with another model or layout
        await self._learn(table)
        self._follow_ram_cache(table)
        if not self.routers.is_instance(table):
            await learn_model_names(self.client, table)
        self._known_at[table.index] = time.monotonic()
        self.on_new_process(table.upstream)
        table.healthy = True  # only now may requests be placed on it
        log.info(
            "upstream %s is back: table rebuilt in %.0f ms, %d slots, server RAM cache %s",
            table.upstream.base_url,
            (time.monotonic() - started) * 1000,
            len(table.slots),
            table.ram_cache_state,
        )

    async def _build_instance(self, table: UpstreamSlots) -> None:
        """A model instance a router loaded: its table read afresh, one check at a time."""
        async with self._checks[table.index]:
            if not table.healthy:
                await self._rebuild(table)

    async def _inspect(self, index: int, upstream: Upstream) -> UpstreamSlots:
        """The upstream's table, read afresh and probed (without losing a slot to the probe
        where the learning can keep it)."""

        def inspect() -> Awaitable[UpstreamSlots]:
            return inspect_upstream(
                self.probe_client, index, upstream, self.settings.server_ram_cache
            )

        if self.learning is None:
            return await inspect()
        return await self.learning.inspect(upstream, inspect)

    async def _learn(self, table: UpstreamSlots) -> None:
        """Whose text each slot of a table built afresh holds, and what (slot_learning.py)."""
        if self.learning is not None:
            await self.learning.learn(table)

    def _follow_ram_cache(self, table: UpstreamSlots) -> None:
        """Shadow the upstream's RAM cache (on, or not known to be off) with its budget, from
        empty: the table is new, and so is what the proxy knows of the server's cache. The
        budget is `routing.server_ram_cache_mib` at first, then learnt from the answers
        (`routing.server_ram_cache_learn`), and a budget learnt stays the guess when the
        upstream comes back; a server that empties its idle slots into its cache has one
        whatever that setting says (it is then followed from the default)."""
        budget = self.settings.server_ram_cache_mib
        if budget == 0 and table.clears_idle:
            budget = RoutingSettings.model_fields["server_ram_cache_mib"].default
        if not table.ram_cache or budget == 0:
            table.ram_shadow = None
            return
        # the server's default token limit is its whole context (server-context.cpp:1492)
        deps = PromptCacheDeps(n_ctx=server_n_ctx(table))

        def sized(limit_bytes: int) -> object:
            return load_plugin("prompt_cache", "llama-server", {"limit_bytes": limit_bytes}, deps)

        disk, index = self.disk, table.index

        def bytes_per_token() -> float:  # the disk tier measures it on every save
            attached = disk.attached.get(index) if disk is not None else None
            return attached.bytes_per_token.value if attached else DEFAULT_BYTES_PER_TOKEN

        learn = sized if self.settings.server_ram_cache_learn else None
        limit = budget * MIB if budget > 0 else -1
        previous = table.ram_shadow
        if learn is not None and previous is not None:
            # the same upstream back (a restart): what it was learnt to keep is a better guess
            # than the setting (its cache is empty, and nothing of it is proven any more)
            limit = previous.budget_bytes
        table.ram_shadow = RamCacheShadow(sized(limit), bytes_per_token, learn)
        name = table.upstream.name  # the label the answers' updates use
        self.metrics.shadow_budget.labels(name).set(table.ram_shadow.budget_bytes)

    async def _attach_disk(self, table: UpstreamSlots) -> None:
        """Use the disk tier on the upstream if it can be; an archive folder that fails (read-
        only, full, gone) leaves the upstream served without it rather than unusable."""
        if self.disk is None:
            return
        try:
            await self.disk.attach(table)
        except OSError as exc:
            self.disk.detach(table)
            log.error(
                "disk tier off for %s: the archive folder failed: %s", table.upstream.base_url, exc
            )


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("checking an idle upstream failed: %r", exc)
