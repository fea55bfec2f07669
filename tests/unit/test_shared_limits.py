"""Limits shared by the proxies of a cluster: the pools' arithmetic (pure), the store on one
real database opened by two proxies' connections (a SQLite file, or PostgreSQL under
`--database postgresql`), and two proxies' allowances and concurrency counts on it, with a
clock the tests move."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from cacheproxy.cluster.handoff import handoff_proof, proof_holds
from cacheproxy.settings import UsageSettings
from cacheproxy.tenancy.limits import Limits, day_start
from cacheproxy.tenancy.metering import Meter, running_meter
from cacheproxy.tenancy.pool_policy import Pool, PoolExchange, exchange, grant
from cacheproxy.tenancy.pool_store import (
    CONCURRENCY,
    ConcurrencyAsk,
    PoolStore,
    SharedLimitsUnavailable,
)
from cacheproxy.tenancy.shared_concurrency import SharedConcurrency
from cacheproxy.tenancy.shared_limits import SharedLimits
from cacheproxy.tenancy.shared_meter import LimitSharing, running_shared_meter
from tests.support import databases
from tests.support.waiting import wait_for

NOW = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
DAY = day_start(NOW)
RPM = "requests_per_minute"


def item(name: str = RPM, limit: int | None = 4, **fields: float | bool) -> PoolExchange:
    values: dict = {
        "tenant": "t",
        "name": name,
        "limit": limit,
        "period": DAY if name == "tokens_per_day" else 0.0,
        "seed": 0.0,
        "settle": 0.0,
        "keep": 0.0,
        "need": 0.0,
        "partial": True,
        "extra": 0.0,
    }
    values.update(fields)
    return PoolExchange(**values)


# -- the pools' arithmetic ---------------------------------------------------------------------


def test_a_grant_is_the_need_whole_or_nothing_and_a_quarter_of_the_rest_at_most() -> None:
    assert grant(10, 3, False, 0) == 3
    assert grant(2, 3, False, 5) == 0  # all of it or nothing
    assert grant(2.7, 3, True, 0) == 2  # any whole part of it
    assert grant(0.9, 1, True, 5) == 0  # a part of one token is none
    assert grant(100, 1, True, 50) == 1 + 24  # beyond the need: a quarter of what is left
    assert grant(9, 1, False, 50) == 1 + 2
    assert grant(4, 0, True, 3) == 1  # a round's prefetch, with nothing needed
    assert grant(3, 0, True, 3) == 0


def test_a_rate_pool_starts_full_refills_around_what_proxies_hold_and_is_never_exceeded() -> None:
    pool, granted = exchange(None, item(need=1, partial=False), NOW, others=0)
    assert granted == 1 and pool == Pool(4, 3, NOW)
    # another proxy holds 1, this one keeps 1: the bucket refills to 2 at most
    later, granted = exchange(Pool(4, 0, NOW), item(keep=1), NOW + 600, others=1)
    assert later is not None and later.level == 2 and granted == 0
    # what is given back beyond the room is gone, as a full bucket's overflow
    back, _ = exchange(Pool(4, 3, NOW), item(settle=3), NOW, others=0)
    assert back is not None and back.level == 4
    # a debt (generated tokens charged at the end) takes the level below zero
    owed, granted = exchange(Pool(4, 1, NOW), item(settle=-5, need=1), NOW, others=0)
    assert owed is not None and owed.level == -4 and granted == 0
    # 15 s refill one request of a 4-a-minute rate
    refilled, granted = exchange(owed, item(need=1, partial=False), NOW + 75, others=0)
    assert refilled is not None and granted == 1 and refilled.level == pytest.approx(0)
    # a lowered limit caps the level
    lowered, _ = exchange(Pool(4, 4, NOW), item(limit=2), NOW, others=0)
    assert lowered is not None and lowered.level == 2


def test_a_budget_pool_counts_the_ledger_of_its_period_once_and_a_new_day_starts_afresh() -> None:
    name = "tokens_per_day"
    # made in the middle of a day: the ledger's tokens of the day are used already; what this
    # proxy spent before the pool existed is in them, not counted twice
    pool, granted = exchange(None, item(name, 300, seed=120, settle=-20, need=1), NOW, others=0)
    assert pool == Pool(300, 180 - granted, DAY) and granted == 1
    # settled later: counted
    pool, _ = exchange(pool, item(name, 300, settle=-50), NOW, others=0)
    assert pool is not None and pool.level == 129
    # a raised budget: what was used stays used
    raised, _ = exchange(pool, item(name, 400), NOW, others=0)
    assert raised is not None and raised.level == 229
    # the next day: the budget again, less its own seed
    tomorrow = DAY + 86400
    fresh, _ = exchange(pool, item(name, 300, period=tomorrow, seed=5), tomorrow + 10, others=0)
    assert fresh == Pool(300, 295, tomorrow)
    # a proxy whose clock is still on the day before gets nothing, settles nothing
    behind, granted = exchange(fresh, item(name, 300, settle=-40, need=1), tomorrow, others=0)
    assert behind == fresh and granted == 0


def test_a_limit_taken_away_deletes_its_pool() -> None:
    assert exchange(Pool(4, 1, NOW), item(limit=None, settle=2), NOW, others=0) == (None, 0.0)


# -- two proxies on one database -------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@contextmanager
def two_stores(tmp_path: Path, database_url: str | None) -> Iterator[tuple[PoolStore, PoolStore]]:
    target = databases.target(database_url, tmp_path / "cacheproxy.db")
    first, second = PoolStore(target), PoolStore(target)
    try:
        yield first, second
    finally:
        first.close()
        second.close()


@asynccontextmanager
async def two_proxies(
    tmp_path: Path, database_url: str | None, limits: Limits, clock: Clock
) -> AsyncIterator[tuple[SharedLimits, SharedLimits]]:
    with two_stores(tmp_path, database_url) as (first, second):
        yield tuple(  # type: ignore[misc]
            SharedLimits(store, name, 1.0, 3.0, lambda _: limits, lambda *_: 0, clock=clock)
            for store, name in ((first, "a"), (second, "b"))
        )


def counting_exchanges(proxy: SharedLimits) -> list[int]:
    """How many transactions the proxy runs from now on (in a list the count changes in)."""
    count = [0]
    exchange_of = proxy.store.aexchange

    async def counted(*args: object) -> object:
        count[0] += 1
        return await exchange_of(*args)  # type: ignore[arg-type]

    proxy.store.aexchange = counted  # type: ignore[method-assign]
    return count


async def served(proxy: SharedLimits, limits: Limits) -> bool:
    if proxy.admit("t", limits):
        return True
    return await proxy.admit_topped_up("t", limits) is None


async def test_a_rate_holds_across_two_proxies_and_what_one_holds_unspent_goes_back(
    tmp_path: Path, database_url: str | None
) -> None:
    limits, clock = Limits(requests_per_minute=4), Clock()
    async with two_proxies(tmp_path, database_url, limits, clock) as (a, b):
        answers = [await served(proxy, limits) for proxy in (a, b) * 4]
        assert answers.count(True) == 4
        refusal = await b.admit_topped_up("t", limits)
        assert refusal is not None and refusal.limit == RPM
        assert refusal.retry_after_s == pytest.approx(15, abs=0.1)  # one comes back in 15 s
        # 30 s on, two came back; a round each later, and b spends them without a transaction
        clock.now += 30
        assert [await served(a, limits), await served(a, limits)] == [True, True]
        assert not await served(b, limits)


async def test_a_busy_proxy_asks_the_pool_once_a_round_not_once_a_request(
    tmp_path: Path, database_url: str | None
) -> None:
    limits, clock = Limits(requests_per_minute=600), Clock()
    async with two_proxies(tmp_path, database_url, limits, clock) as (a, b):
        for _ in range(20):  # a first period: the allowance is asked for as it runs short
            assert await served(a, limits)
        await a.round()  # keeps what it spent in the period, takes it again
        exchanges = counting_exchanges(a)
        for _ in range(20):
            assert await served(a, limits)
        assert exchanges == [0]
        # what a keeps is not the other proxy's: b still gets the rest
        held = a.allowances[("t", RPM)].held
        assert held == 0 and a.store.holdings("t", RPM, clock.now) == {"a": 20}
        for _ in range(10):
            assert await served(b, limits)
        await a.round()  # it spent 20 again: it holds 20 again
        assert a.store.holdings("t", RPM, clock.now)["a"] == 20
        await a.round()  # a round in which it spent nothing gives all it holds back
        assert "a" not in a.store.holdings("t", RPM, clock.now)


async def test_a_pool_seen_empty_refuses_from_memory_until_a_round_sees_it_again(
    tmp_path: Path, database_url: str | None
) -> None:
    limits, clock = Limits(tokens_per_day=100), Clock()
    async with two_proxies(tmp_path, database_url, limits, clock) as (a, b):
        assert await served(a, limits)
        a.charge("t", limits, "tokens_per_day", 120)  # its answer took more than the budget
        await a.round()
        assert not await served(b, limits)  # b asks once, and sees it spent
        exchanges = counting_exchanges(b)
        refusal = await b.admit_topped_up("t", limits)
        assert refusal is not None and refusal.limit == "budget_tokens_per_day"
        assert exchanges == [0]  # a refusal costs no transaction
        assert "120 of 100" in refusal.message
        # the next UTC day, the budget is there again
        clock.now = DAY + 86400 + 1
        assert await served(b, limits)


async def test_a_refusal_while_another_proxy_holds_part_of_the_limit_says_retry_soon(
    tmp_path: Path, database_url: str | None
) -> None:
    limits, clock = Limits(tokens_per_day=100), Clock()
    async with two_proxies(tmp_path, database_url, limits, clock) as (a, b):
        for _ in range(4):  # a spends 80 in a period: its rounds keep up to that much
            assert await served(a, limits)
            a.charge("t", limits, "tokens_per_day", 20)
        await a.round()
        held = a.allowances[("t", "tokens_per_day")].held
        assert 0 < held <= 20  # a quarter of what is left, at most
        b.charge("t", limits, "tokens_per_day", 20 - held)
        refusal = await b.admit_topped_up("t", limits)
        assert refusal is not None and refusal.retry_after_s <= 1.0  # a's next round


async def test_requests_arriving_together_share_a_top_up_and_hold_the_limit(
    tmp_path: Path, database_url: str | None
) -> None:
    """Requests of a tenant without a request rate, each waiting for the same top-up, end
    in any order (each was once the last to leave what they wanted together)."""
    limits, clock = Limits(prompt_tokens_per_minute=40), Clock()
    async with two_proxies(tmp_path, database_url, limits, clock) as (a, b):

        async def prompt_served(proxy: SharedLimits) -> bool:
            if not await served(proxy, limits):
                return False
            if proxy.take_prompt("t", limits, 20):
                return True
            return await proxy.take_prompt_topped_up("t", limits, 20) is None

        answers = await asyncio.gather(*(prompt_served(proxy) for proxy in (a, b) * 3))
        # never past the limit; what one proxy took at admission and could not use (a token
        # of the rate) goes back at its next round, so a burst may get one prompt fewer
        assert 1 <= answers.count(True) <= 2


async def test_a_proxy_cut_off_from_the_database_spends_what_it_holds_only_until_it_expires(
    tmp_path: Path, database_url: str | None
) -> None:
    limits, clock = Limits(requests_per_minute=600), Clock()
    async with two_proxies(tmp_path, database_url, limits, clock) as (a, b):
        for _ in range(20):
            assert await served(a, limits)
        await a.round()  # a holds what it spent in the period: 20 requests
        assert a.allowances[("t", RPM)].held == 20

        async def unreachable(*_: object) -> object:
            raise OSError("the database does not answer")

        a.store.aexchange = unreachable  # type: ignore[method-assign]
        clock.now += 2.9  # within its holding's expiry (3 s): spent from memory
        assert a.admit("t", limits)
        # past it the pool counts what a held as spent, and b may be granted it: a spends it
        # no more, and its next request waits for the database (a 503 at the request path)
        clock.now += 0.2
        assert not a.admit("t", limits)
        with pytest.raises(SharedLimitsUnavailable):
            await a.admit_topped_up("t", limits)
        assert "a" not in b.store.holdings("t", RPM, clock.now)


# -- the concurrency count ------------------------------------------------------------------


async def test_max_concurrent_holds_across_two_proxies_and_a_dead_ones_places_expire(
    tmp_path: Path, database_url: str | None
) -> None:
    clock = Clock()
    with two_stores(tmp_path, database_url) as (first, second):
        a = SharedConcurrency(first, "a", 3.0, clock=clock)
        b = SharedConcurrency(second, "b", 3.0, clock=clock)
        async with a.running(), b.running():
            assert await a.take("t", 2) is None
            assert await b.take("t", 2) is None
            assert await b.take("t", 2) == 1  # the cap is reached: a holds one
            assert not a.try_take("t", 2)
            a.give_back("t")
            assert await b.take("t", 2) is None  # given back, at once
            assert second.holdings("t", CONCURRENCY, clock.now) == {"b": 2}
            # b dies: what it holds expires, and a may have it all
            clock.now += 3.1
            assert await a.take("t", 2) is None
            assert await a.take("t", 2) is None
            assert first.holdings("t", CONCURRENCY, clock.now) == {"a": 2}


async def test_a_split_requests_places_are_taken_all_at_once_or_none(
    tmp_path: Path, database_url: str | None
) -> None:
    """A split request's tasks each take a place: all of them, or none (and the places its ask
    held meanwhile are given up for the other proxies)."""
    clock = Clock()
    with two_stores(tmp_path, database_url) as (first, second):
        a = SharedConcurrency(first, "a", 3.0, clock=clock)
        b = SharedConcurrency(second, "b", 3.0, clock=clock)
        async with a.running(), b.running():
            assert await a.take("t", 4, 2) is None
            assert await b.take("t", 4, 3) == 2  # two places left: none of the three taken
            await wait_for(
                lambda: second.holdings("t", CONCURRENCY, clock.now) == {"a": 2},
                "the refused request's places given up",
            )
            assert await b.take("t", 4, 2) is None
            assert not a.try_take("t", 4)  # the cap is reached
            b.give_back("t", 2)
            assert await a.take("t", 4, 2) is None
            assert first.holdings("t", CONCURRENCY, clock.now) == {"a": 4}


async def test_a_refusal_while_other_proxies_hold_places_is_looked_at_twice(
    tmp_path: Path,
) -> None:
    """A place another proxy gave back a moment ago may not be written yet: the first refusal
    is asked again (after `RECHECK_S`), the second is answered."""
    with two_stores(tmp_path, None) as (store, _):
        count = SharedConcurrency(store, "b", 3.0)  # its writer not running: asks by hand
        asking = asyncio.create_task(count.take("t", 1))
        await asyncio.sleep(0)
        (waiter,) = count.counts["t"].waiting
        waiter.counted = True
        count._hand_out("t", held=0, others=1)
        assert not asking.done() and waiter.rechecked
        waiter.counted = True
        count._hand_out("t", held=0, others=1)
        assert await asking == 1


# -- the hand-off header --------------------------------------------------------------------


def test_a_handoff_proof_holds_for_its_request_tenant_and_time_only() -> None:
    secret = b"s" * 32
    proof = handoff_proof(secret, "POST", "/completion", "t_1", "http://10.0.0.1:8080", NOW)
    assert proof_holds(secret, proof, "POST", "/completion", "t_1", NOW + 5, 10)
    assert not proof_holds(secret, proof, "POST", "/completion", "t_1", NOW + 11, 10)
    assert not proof_holds(secret, proof, "POST", "/completion", "t_2", NOW, 10)
    assert not proof_holds(secret, proof, "POST", "/v1/completions", "t_1", NOW, 10)
    assert not proof_holds(secret, proof, "GET", "/completion", "t_1", NOW, 10)
    assert not proof_holds(b"x" * 32, proof, "POST", "/completion", "t_1", NOW, 10)
    for forged in ("", "anything", "v1.1.2.3", proof.replace("v1", "v2", 1), proof + "x"):
        assert not proof_holds(secret, forged, "POST", "/completion", "t_1", NOW, 10)


# -- the meters ---------------------------------------------------------------------------------


async def test_a_restarted_proxy_holds_nothing_its_killed_self_held(
    tmp_path: Path, database_url: str | None
) -> None:
    target = databases.target(database_url, tmp_path / "cacheproxy.db")
    clock = Clock()
    with PoolStore(target) as store:
        store.set_concurrency("a", [ConcurrencyAsk("t", 1, 1, 1)], clock.now, clock.now + 3)
    sharing = LimitSharing(target, "a", 1.0, 3.0)
    ledger = databases.target(database_url, tmp_path / "usage.db")
    async with running_shared_meter(ledger, UsageSettings(), lambda _: Limits(), sharing):
        with PoolStore(target) as store:
            assert store.holdings("t", CONCURRENCY, clock.now) == {}


async def test_a_single_proxy_meters_in_memory_alone(tmp_path: Path) -> None:
    limits = Limits(requests_per_minute=1, tokens_per_day=10)
    async with running_meter(tmp_path / "usage.db", UsageSettings(), lambda _: limits) as meter:
        assert type(meter) is Meter and meter.across is None
        assert meter.admit("t") is not None  # never a top-up: nothing shared to ask
        assert meter.take_prompt("t", 5)
