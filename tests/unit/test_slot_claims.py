"""Slot claims: the store (SQLite or PostgreSQL), the hints of a slot's ids, the keeper's order of
writes (a disowning before another tenant's text may be sent, never overtaken by a claim), and a
proxy started again in front of a fake llama-server that kept running."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.cluster.leases import LeaseStore
from cacheproxy.cluster.slot_claims import SlotClaim, SlotClaimStore
from cacheproxy.disk.blocks import BLOCK_TOKENS
from cacheproxy.errors import ApiError
from cacheproxy.http.app_keys import CACHE
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.slots import claims_keeper, slot_records
from cacheproxy.slots.claims_keeper import SlotClaims, claim_of
from cacheproxy.slots.slot_hints import decode_hint, encode_hint, hint_of, named_by, named_prefix
from cacheproxy.slots.slot_learning import SlotLearning
from cacheproxy.slots.slot_views import reuse_on
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.upstreams.client import idle_slots
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import (
    NO_REUSE,
    Lease,
    ReuseBounds,
    SlotState,
    UpstreamSlots,
)
from tests.support import databases
from tests.support.completions import bearer, complete
from tests.support.fake_llama_server import fake_llama_server
from tests.support.fake_stack import proxy_before
from tests.support.metrics import sample

URL = "http://upstream:8080"


def ids(seed: int, length: int = 600) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


def table_of(*slots: SlotState) -> UpstreamSlots:
    upstream = Upstream(URL)
    upstream.held = True
    return UpstreamSlots(0, upstream, list(slots))


def slot_holding(slot_id: int, tokens: list[int], tenant: str | None) -> SlotState:
    slot = SlotState(slot_id, 4096)
    slot.hold(tokens)
    slot.tenant = tenant
    return slot


def lease_on(table: UpstreamSlots, slot: SlotState) -> Lease:
    return Lease(table, slot, [], ReuseBounds(0, 0), 0.0, isolate=False)


# -- the store ---------------------------------------------------------------------------------


def test_claims_are_read_back_and_disowned(database_url: str | None, tmp_path: Path) -> None:
    store = SlotClaimStore(databases.target(database_url, tmp_path / "c.db"), "proxy-a", False)
    try:
        hint = encode_hint(hint_of(ids(1, 130)))
        store.claim(URL, [SlotClaim(0, "t_a", 130, hint), SlotClaim(1, None)], 1.0)
        read = store.read(URL)
        assert (read[0].tenant, read[0].hint_tokens, read[0].hint) == ("t_a", 130, hint)
        assert read[1].tenant is None and read[1].hint_tokens == 0
        assert store.read("http://another:8080") == {}
        store.disown(URL, [0], 2.0)
        again = store.read(URL)
        assert again[0].tenant is None and again[0].hint == b""
        assert again[0].generation == read[0].generation + 1  # every write bumps it
    finally:
        store.close()


def test_a_disowning_reaches_the_disk_and_an_unsynced_claim_need_not(tmp_path: Path) -> None:
    store = SlotClaimStore(tmp_path / "c.db", "proxy-a", False)
    levels: list[int] = []  # SQLite's synchronous level as each write ran: 2 FULL, 1 NORMAL
    execute, executemany = store._db.execute, store._db.executemany

    def spied_execute(sql: str, params: Sequence[object] = ()) -> object:
        if sql.startswith("INSERT"):
            levels.append(execute("PRAGMA synchronous").fetchone()[0])
        return execute(sql, params)

    def spied_executemany(sql: str, rows: list) -> None:
        levels.append(execute("PRAGMA synchronous").fetchone()[0])
        executemany(sql, rows)

    store._db.execute = spied_execute  # type: ignore[method-assign]
    store._db.executemany = spied_executemany  # type: ignore[method-assign]
    try:
        store.claim(URL, [SlotClaim(0, "t_a")], 1.0, synced=False)
        store.disown(URL, [0], 2.0)
        store.claim(URL, [SlotClaim(0, "t_b")], 3.0)
        store.claim(URL, [SlotClaim(0, "t_b"), SlotClaim(1, "t_b")], 4.0, synced=False)
        assert levels == [1, 2, 2, 1]
        assert store.read(URL)[0].tenant == store.read(URL)[1].tenant == "t_b"
    finally:
        store.close()


def test_in_a_cluster_only_the_live_lease_holder_writes_a_claim(
    database_url: str | None, tmp_path: Path
) -> None:
    where = databases.target(database_url, tmp_path / "c.db")
    leases = LeaseStore(where)
    holder = SlotClaimStore(where, "proxy-a", leased=True)
    other = SlotClaimStore(where, "proxy-b", leased=True)
    try:
        now = time.time()
        with leases.transaction():
            assert leases.claim(URL, "proxy-a", "http://a", now, now + 30)
        assert holder.claim(URL, [SlotClaim(0, "t_a")], now)
        assert not other.claim(URL, [SlotClaim(0, "t_b")], now)  # not its lease: nothing written
        assert holder.read(URL)[0].tenant == "t_a"
        other.disown(URL, [0], now)  # a disowning claims nothing: always written
        assert holder.read(URL)[0].tenant is None
        # once the lease has lapsed, its former holder writes no claim either
        assert not holder.claim(URL, [SlotClaim(0, "t_a")], now + 60)
    finally:
        for store in (leases, holder, other):
            store.close()


# -- hints ---------------------------------------------------------------------------------------


def test_a_hint_names_a_prompt_that_starts_with_its_tokens_and_no_other() -> None:
    held = ids(1, 3 * BLOCK_TOKENS + 10)
    hint = hint_of(held)
    assert decode_hint(hint.n_tokens, encode_hint(hint)) == hint
    assert decode_hint(0, b"") is None and decode_hint(200, b"short") is None
    # the whole text, continued: all of it named
    assert named_prefix(hint, [*held, 1, 2, 3]) == len(held)
    # the same text but its last tokens (a re-templated answer): its whole blocks
    assert named_prefix(hint, [*held[:-5], 7, 7, 7, 7, 7, 9]) == 3 * BLOCK_TOKENS
    assert named_prefix(hint, [*held[: 2 * BLOCK_TOKENS + 3], 9]) == 2 * BLOCK_TOKENS
    assert named_prefix(hint, ids(2, 400)) == 0  # another text
    assert named_prefix(hint, held[:10]) == 0  # shorter than a block


def test_a_hinted_slot_is_named_only_by_a_prompt_of_its_own_tenant() -> None:
    held = ids(1, 300)
    hinted = SlotState(0, 4096)
    hinted.forget(len(held))
    hinted.tenant, hinted.hint = "t_a", hint_of(held)
    nobodys = SlotState(1, 4096)
    nobodys.forget(len(held))
    nobodys.hint = hint_of(held)
    table = table_of(hinted, nobodys)
    prompt = [*held, *ids(3, 40)]
    assert named_by([table], prompt, "t_b", "default") == []
    assert named_by([table], prompt, "t_a", "default") == [(hinted, len(held))]
    # with no tenants, a slot of unknown origin is the single user's
    assert named_by([table], prompt, "default", "default") == [(nobodys, len(held))]
    # the row a claim writes for a hinted slot keeps the hint
    assert claim_of(hinted) == SlotClaim(0, "t_a", len(held), encode_hint(hint_of(held)))


def test_a_prompt_sharing_only_a_hinted_slots_first_blocks_leaves_the_rest_to_name() -> None:
    system = ids(5, 2 * BLOCK_TOKENS)  # a system prompt the tenant's conversations share
    theirs, other = [*system, *ids(6, 300)], [*system, *ids(7, 300)]
    slot = SlotState(0, 4096)
    slot.forget(len(theirs))
    slot.tenant, slot.hint = "t_a", hint_of(theirs)
    table = table_of(slot)
    [(named, count)] = named_by([table], [*other, 1], "t_a", "default")
    slot_records.named(named, [*other, 1], count)
    assert (slot.known, slot.unknown_tail) == (system, len(theirs) - len(system))
    assert slot.hint == hint_of(theirs)  # the conversation it holds may still come
    assert named_by([table], [*other, 2], "t_a", "default") == []  # nothing more to name
    [(named, count)] = named_by([table], [*theirs, 1], "t_a", "default")
    slot_records.named(named, [*theirs, 1], count)
    assert (slot.known, slot.unknown_tail, slot.hint) == (theirs, 0, None)


def test_the_probe_writes_into_the_emptiest_idle_slot() -> None:
    report = [
        {"id": 0, "n_prompt_tokens": 900},
        {"id": 1, "n_prompt_tokens": 0},
        {"id": 2, "n_prompt_tokens": 300, "is_processing": True},
        {"id": 3, "n_prompt_tokens": 40},
    ]
    assert idle_slots(report) == [1, 3, 0]


# -- the keeper's order of writes ----------------------------------------------------------------


class GatedStore:
    """A claim store in memory whose claims wait for `gate`, recording the order of writes."""

    def __init__(self) -> None:
        self.rows: dict[int, str | None] = {}
        self.writes: list[tuple[str, int, str | None]] = []
        self.synced: list[bool] = []  # per claim write, whether it had to reach the disk
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None

    async def aclaim(
        self, upstream: str, claims: list[SlotClaim], now: float, synced: bool = True
    ) -> bool:
        await self.gate.wait()
        self.synced.append(synced)
        for claim in claims:
            self.rows[claim.slot_id] = claim.tenant
            self.writes.append(("claim", claim.slot_id, claim.tenant))
        return True

    async def adisown(self, upstream: str, slot_ids: list[int], now: float) -> None:
        if self.fail is not None:
            raise self.fail
        for slot_id in slot_ids:
            self.rows[slot_id] = None
            self.writes.append(("disown", slot_id, None))

    async def aread(self, upstream: str) -> dict[int, SlotClaim]:
        return {slot_id: SlotClaim(slot_id, tenant) for slot_id, tenant in self.rows.items()}


async def test_another_tenants_slot_is_disowned_before_use_and_a_claim_never_lands_after() -> None:
    slot = slot_holding(0, ids(1, 200), "t_a")
    table = table_of(slot)
    store = GatedStore()
    claims = SlotClaims(store, [table], ProxyMetrics())  # type: ignore[arg-type]
    await claims.flush()
    assert store.rows == {0: "t_a"}
    # the tenant's own next turn writes nothing
    await claims.before_use(lease_on(table, slot), "t_a", None)  # type: ignore[arg-type]
    assert store.writes == [("claim", 0, "t_a")]
    # a claim under way (its write held up) when another tenant's request takes the slot: the
    # disowning waits for it, and lands last
    slot.hold(ids(2, 300))
    store.gate.clear()
    flushing = asyncio.create_task(claims.flush())
    await asyncio.sleep(0)
    slot.busy = True  # the scheduler gives it to t_b
    using = asyncio.create_task(claims.before_use(lease_on(table, slot), "t_b", None))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert not using.done()
    store.gate.set()
    await asyncio.gather(flushing, using)
    assert store.writes[-2:] == [("claim", 0, "t_a"), ("disown", 0, None)]
    assert store.rows == {0: None}


async def test_only_a_claim_taking_a_slot_from_a_tenant_must_reach_the_disk() -> None:
    slot = slot_holding(0, ids(1, 200), "t_a")
    table = table_of(slot)
    store = GatedStore()
    claims = SlotClaims(store, [table], ProxyMetrics())  # type: ignore[arg-type]
    await claims.flush()  # whose the slot was in the database is not known: synced
    slot.hold(ids(1, 300))  # the tenant's own next turn: its loss leaves t_a's row
    await claims.flush()
    slot.hold([])  # emptied: its loss would leave t_a's row over a slot that may take t_b's text
    await claims.flush()
    slot.hold(ids(2, 300))
    slot.tenant = "t_b"  # nobody's to t_b: its loss leaves the row nobody's
    await claims.flush()
    written = [("claim", 0, "t_a"), ("claim", 0, "t_a"), ("claim", 0, None), ("claim", 0, "t_b")]
    assert store.writes == written
    assert store.synced == [True, False, True, False]


async def settled() -> None:
    """Every task this loop has ready has run to its next wait."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_next_request_of_the_same_tenant_leaves_its_hint_to_the_round_another_is_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(claims_keeper, "FLUSH_S", 3600.0)  # no round but those a request wakes
    slot = slot_holding(0, ids(1, 200), "t_a")
    table = table_of(slot)
    store = GatedStore()
    claims = SlotClaims(store, [table], ProxyMetrics())  # type: ignore[arg-type]
    await claims.flush()
    claims.start()
    try:
        # t_a's next turn on its slot: its first event and its end change no owner, nothing is
        # written for it until a round comes (here: the last, as the proxy stops)
        lease = lease_on(table, slot)
        slot.busy = True
        claims.prefill_ended(lease)
        slot.busy = False
        slot.hold(ids(1, 260))
        claims.changed(lease)
        await settled()
        assert store.writes == [("claim", 0, "t_a")]
        # t_b takes the slot: disowned before, claimed at its first event, written at its end
        await claims.before_use(lease, "t_b", None)  # type: ignore[arg-type]
        slot.busy, slot.tenant = True, "t_b"
        slot.hold(ids(2, 300))
        lease = Lease(table, slot, ids(2, 300), ReuseBounds(0, 0), 0.0, isolate=True)
        claims.prefill_ended(lease)
        await settled()
        assert store.writes[-2:] == [("disown", 0, None), ("claim", 0, "t_b")]
        slot.busy = False
        slot.hold(ids(2, 330))
        claims.changed(lease)  # the database says t_b already: left to the round
        await settled()
        assert len(store.writes) == 3
    finally:
        await claims.stop()
    assert store.writes[-1] == ("claim", 0, "t_b") and len(store.writes) == 4
    assert store.rows == {0: "t_b"}


async def test_a_claim_the_database_holds_already_is_not_written_again() -> None:
    slot = slot_holding(0, ids(1, 200), "t_a")
    table = table_of(slot)
    store = GatedStore()
    claims = SlotClaims(store, [table], ProxyMetrics())  # type: ignore[arg-type]
    await claims.flush()
    slot.hold(ids(1, 200))  # the same request again: the slot holds the same text, its own
    await claims.flush()
    assert store.writes == [("claim", 0, "t_a")]
    slot.hold(ids(1, 201))  # more of it: written
    await claims.flush()
    slot.hold(ids(1, 200))  # back to what was written before the last: written again
    await claims.flush()
    assert store.writes == [("claim", 0, "t_a")] * 3
    await claims.before_use(lease_on(table, slot), "t_b", None)  # type: ignore[arg-type]
    slot.tenant = "t_a"  # disowned, then t_a's again with the same text: claimed again
    await claims.flush()
    assert store.writes[-2:] == [("disown", 0, None), ("claim", 0, "t_a")]


async def test_a_slot_taken_from_another_tenant_is_claimed_once_its_prompt_is_computed() -> None:
    slot = slot_holding(0, ids(1, 200), "t_a")
    table = table_of(slot)
    store = GatedStore()
    claims = SlotClaims(store, [table], ProxyMetrics())  # type: ignore[arg-type]
    await claims.flush()
    prompt = ids(2, 300)
    lease = Lease(table, slot, prompt, ReuseBounds(0, 0), 0.0, isolate=True)
    await claims.before_use(lease, "t_b", None)  # type: ignore[arg-type]
    slot.busy, slot.tenant = True, "t_b"
    slot.hold(list(prompt), None)  # as the scheduler grants it
    await claims.flush()
    assert store.rows == {0: None}  # sent, not yet computed: it may still hold t_a's text
    claims.prefill_ended(lease)
    await claims.flush()
    assert store.rows == {0: "t_b"}  # its first event came: t_b's prompt, whatever cuts it
    # a first event of a request whose slot changed since is not written
    claims.prefill_ended(lease)
    slot.hold([])
    store.rows[0] = None
    await claims.flush()
    assert store.rows == {0: None}


async def test_a_disowning_that_cannot_be_written_gives_the_lease_back_and_refuses() -> None:
    slot = slot_holding(0, ids(1, 200), "t_a")
    table = table_of(slot)
    store = GatedStore()
    claims = SlotClaims(store, [table], ProxyMetrics())  # type: ignore[arg-type]
    await claims.flush()
    store.fail = sqlite3.OperationalError("database is locked")
    given_back = []

    class Scheduler:
        def release(self, lease: Lease, outcome: object) -> None:
            given_back.append(lease)

    lease = lease_on(table, slot)
    with pytest.raises(ApiError) as refused:
        await claims.before_use(lease, "t_b", Scheduler())  # type: ignore[arg-type]
    assert refused.value.status == 503 and given_back == [lease]
    assert store.rows == {0: "t_a"}


# -- claims learnt, and claims gone stale ---------------------------------------------------------


class RowsStore:
    """A claim store in memory holding `rows` as they were written."""

    def __init__(self, rows: dict[int, SlotClaim]) -> None:
        self.rows = rows
        self.disowned: list[int] = []

    async def aread(self, upstream: str) -> dict[int, SlotClaim]:
        return dict(self.rows)

    async def adisown(self, upstream: str, slot_ids: list[int], now: float) -> None:
        self.disowned.extend(slot_ids)


class SlotsReport:
    """An upstream client whose `GET /slots` answers `report`."""

    def __init__(self, report: list[dict]) -> None:
        self.report = report

    async def slots(self, upstream: Upstream) -> list[dict]:
        return self.report


def hinted_claim(slot_id: int, tenant: str, tokens: list[int]) -> SlotClaim:
    return SlotClaim(slot_id, tenant, len(tokens), encode_hint(hint_of(tokens)))


async def test_a_claim_names_its_tenant_and_a_hint_no_longer_than_what_the_server_shows() -> None:
    held = ids(1, 300)
    table = table_of(*(SlotState(slot_id, 4096) for slot_id in range(4)))
    rows = {
        0: hinted_claim(0, "t_a", held),  # as written: the server shows as many tokens
        1: hinted_claim(1, "t_a", held),  # a request ran after the write: fewer tokens now
        3: SlotClaim(3, None),  # disowned, and the write of its new tenant lost
    }
    report = [
        {"id": 0, "n_prompt_tokens": 300},
        {"id": 1, "n_prompt_tokens": 120},
        {"id": 2, "n_prompt_tokens": 200},  # no row: never recorded
        {"id": 3, "n_prompt_tokens": 250},
    ]
    claims = SlotClaims(RowsStore(rows), [table], ProxyMetrics())  # type: ignore[arg-type]
    await SlotLearning(claims, SlotsReport(report), None).learn(table)  # type: ignore[arg-type]
    slots = table.slots
    assert [slot.tenant for slot in slots] == ["t_a", "t_a", None, None]
    assert [slot.n_tokens for slot in slots] == [300, 120, 200, 250]
    assert slots[0].hint == hint_of(held)
    assert slots[1].hint is None  # stale: still t_a's text, its ids unknown
    # the tenant's prompt names its slot as written, and nothing of the stale one
    prompt = [*held, *ids(3, 40)]
    assert named_by([table], prompt, "t_a", "default") == [(slots[0], len(held))]
    assert named_by([table], prompt, "t_b", "default") == []
    # the keeper takes the database's word: t_b's request on a slot learnt as t_a's disowns it
    # first; one on a slot nobody claims writes nothing
    for slot in (slots[2], slots[0]):
        await claims.before_use(lease_on(table, slot), "t_b", None)  # type: ignore[arg-type]
    assert claims.store.disowned == [0]  # type: ignore[attr-defined]


class Asking:
    """A waiting request of `tenant` whose prompt starts with a public prefix."""

    def __init__(self, prompt: list[int], tenant: str, public_prefix_length: int) -> None:
        self.prompt = prompt
        self.tenant = tenant
        self.session = None
        self.cache_prompt = True
        self.opaque = False
        self.public_prefix_length = public_prefix_length


def test_a_slot_whose_ids_a_hint_named_shares_no_public_prefix_until_a_request_runs_there() -> None:
    public = ids(4, BLOCK_TOKENS)
    theirs = [*public, *ids(5, 200)]
    slot = SlotState(0, 4096)
    slot.forget(len(theirs))
    slot.tenant, slot.hint = "t_a", hint_of(theirs)
    # t_a's prompt names it; but a request may have run there after the hint was written
    slot_records.named(slot, [*theirs, 1], len(theirs))
    assert (slot.known, slot.unknown_tail, slot.hinted) == (theirs, 0, True)
    other = Asking([*public, *ids(6, 100)], "t_b", len(public))
    shared = slot.shared_with(other.prompt)
    assert reuse_on(slot, other, shared, own=False) == NO_REUSE
    own = Asking([*theirs, 2], "t_a", 0)  # its own tenant: predicted, measured by its request
    assert reuse_on(slot, own, len(theirs), own=True) == ReuseBounds(len(theirs), len(theirs))
    slot.hold(list(theirs))  # what a request run there left: known for sure
    assert not slot.hinted
    assert reuse_on(slot, other, shared, own=False) == ReuseBounds(len(public), len(public))


# -- a proxy started again in front of a server that kept running ----------------------------------


async def test_a_proxy_started_again_knows_whose_text_its_slots_hold_and_reuses_them(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "slots"
    folder.mkdir()
    with TenantRegistry(tmp_path / "state" / "cacheproxy.db") as registry:
        tenants = {name: registry.create(name) for name in ("acme", "globex")}
    keys = {name: bearer(key) for name, (_, key) in tenants.items()}
    disk = {"ahead_mib_s": 0.0, "drain_on_shutdown": False}  # nothing archived
    prompts = {"acme": ids(1), "globex": ids(2)}
    async with (
        aiohttp.ClientSession() as client,
        fake_llama_server(n_slots=2, slot_save_path=folder) as fake,
    ):
        async with proxy_before(fake, tmp_path, disk=disk) as (url, _):
            answers = {
                name: await complete(client, url, prompts[name], keys[name]) for name in keys
            }
        started = len(fake.received)
        async with proxy_before(fake, tmp_path, disk=disk) as (url, app):
            restart = [(r.path, r.query.get("action")) for r in fake.received[started:]]
            slots = app[CACHE].tables[0].slots
            learnt = {slot.tenant: slot.slot_id for slot in slots}
            hinted = [slot.slot_id for slot in slots if slot.hint is not None]
            named = [slot.slot_id for slot in slots if slot.known]
            turns = {name: [*prompts[name], *answers[name]["tokens"], *ids(9, 40)] for name in keys}
            mine = {name: await complete(client, url, turns[name], keys[name]) for name in keys}
            matched = sample(app, "cacheproxy_predictions_total", result="match")
            restored = sample(app, "cacheproxy_archive_restores_total", outcome="restored")
    # each slot is its claim's tenant's; the one the probe took was saved first, restored after
    # and its ids read from the file; the other's ids are a hint until a prompt names them
    assert set(learnt) == {tenant.id for tenant, _ in tenants.values()}
    assert len(hinted) == 1 and len(named) == 1 and hinted != named
    probe_at = restart.index(("/completion", None))
    assert (f"/slots/{named[0]}", "save") in restart[:probe_at]
    assert (f"/slots/{named[0]}", "restore") in restart[probe_at:]
    for name in keys:
        assert mine[name]["timings"]["cache_n"] == answers[name]["tokens_cached"], name
    assert matched == 2 and restored == 0  # reused from the slots, as predicted
    assert sample(app, "cacheproxy_slots_learnt_total", result="claimed") == 2
