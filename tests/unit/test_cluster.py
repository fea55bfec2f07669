"""Several proxies: the lease plan (pure), the lease table on a real SQLite file opened by two
proxies' connections, the conversation key a hand-off follows, and start-up recovery of an
archive other proxies write."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections import Counter
from pathlib import Path

import pytest

from cacheproxy.cluster.handoff import conversation_key, owner_of
from cacheproxy.cluster.keeper import LeaseKeeper, Peer
from cacheproxy.cluster.leases import LeaseRow, LeaseStore
from cacheproxy.cluster.plan import plan_round
from cacheproxy.disk.archive_types import new_file_name
from cacheproxy.disk.slot_file import encode_slot_file
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.plugins import load_plugin
from cacheproxy.settings import load_settings
from cacheproxy.upstreams.pool import Upstream
from tests.support import databases
from tests.support.slot_files import kv_state, random_tokens

UPSTREAMS = ["http://u1", "http://u2", "http://u3", "http://u4"]
NOW = 1_700_000_000.0


def lease(upstream: str, holder: str, expires_at: float = NOW + 10) -> LeaseRow:
    return LeaseRow(upstream, holder, f"http://{holder}", expires_at)


# -- the plan --------------------------------------------------------------------------------


def test_alone_a_proxy_claims_every_upstream() -> None:
    plan = plan_round("a", NOW, UPSTREAMS, {"a"}, [], set(), set())
    assert sorted(plan.claim) == UPSTREAMS and not plan.renew


def test_a_proxy_claims_only_its_share_while_others_are_live() -> None:
    leases = [lease("http://u1", "b")]
    plan = plan_round("a", NOW, UPSTREAMS, {"a", "b"}, leases, set(), set())
    assert len(plan.claim) == 2 and "http://u1" not in plan.claim


def test_an_expired_lease_is_free_and_a_live_one_is_not() -> None:
    leases = [lease("http://u1", "b", NOW - 1), lease("http://u2", "c")]
    plan = plan_round("a", NOW, UPSTREAMS[:2], {"a", "c"}, leases, set(), set())
    assert plan.claim == ["http://u1"]


def test_above_its_share_beside_a_starved_proxy_one_lease_is_given_up_once_idle() -> None:
    mine = [lease(url, "a") for url in UPSTREAMS]
    plan = plan_round("a", NOW, UPSTREAMS, {"a", "b"}, mine, set(), set())
    assert plan.start_releasing in UPSTREAMS and sorted(plan.renew) == UPSTREAMS
    giving = {plan.start_releasing}
    busy = plan_round("a", NOW, UPSTREAMS, {"a", "b"}, mine, giving, set())
    assert not busy.release and busy.start_releasing is not None  # the next one, 3 > 2
    idle = plan_round("a", NOW, UPSTREAMS, {"a", "b"}, mine, giving, giving)
    assert idle.release == [plan.start_releasing] and plan.start_releasing not in idle.renew
    # at its share: nothing more given up
    at_share = [lease(url, "a") for url in UPSTREAMS[:2]] + [lease(UPSTREAMS[2], "b")]
    settled = plan_round("a", NOW, UPSTREAMS, {"a", "b"}, at_share, set(), set())
    assert settled.start_releasing is None and settled.claim == []


def test_two_proxies_starting_together_prefer_different_upstreams() -> None:
    first = plan_round("a", NOW, UPSTREAMS[:2], {"a", "b"}, [], set(), set())
    second = plan_round("b", NOW, UPSTREAMS[:2], {"a", "b"}, [], set(), set())
    assert len(first.claim) == len(second.claim) == 1
    assert first.claim != second.claim or first.claim[0] in UPSTREAMS  # hashing, not a rule


# -- the lease table on one database (a file, or PostgreSQL under --database postgresql), two
# proxies' connections -------------------------------------------------------------------------


def test_a_live_lease_is_one_proxys_and_an_expired_one_is_taken_over(
    database_url: str | None, tmp_path: Path
) -> None:
    where = databases.target(database_url, tmp_path / "cacheproxy.db")
    with_a, with_b = LeaseStore(where), LeaseStore(where)
    try:
        with with_a.transaction():
            assert with_a.claim("http://u1", "a", "http://a", NOW, NOW + 3)
        with with_b.transaction():
            assert not with_b.claim("http://u1", "b", "http://b", NOW + 1, NOW + 4)
        with with_a.transaction():  # a renewal
            assert with_a.claim("http://u1", "a", "http://a", NOW + 2, NOW + 5)
        with with_b.transaction():
            assert not with_b.claim("http://u1", "b", "http://b", NOW + 4.9, NOW + 8)
            assert with_b.claim("http://u1", "b", "http://b", NOW + 5.1, NOW + 8)
        with with_a.transaction():
            assert not with_a.claim("http://u1", "a", "http://a", NOW + 6, NOW + 9)
            assert with_a.leases() == [LeaseRow("http://u1", "b", "http://b", NOW + 8)]
            with_a.heartbeat("a", "http://a", NOW + 9)
        with with_b.transaction():
            with_b.heartbeat("b", "http://b", NOW + 7)
            assert with_b.live_members(NOW + 8) == {"a": "http://a"}
    finally:
        with_a.close()
        with_b.close()


async def test_the_keeper_spreads_upstreams_and_a_stopped_one_gives_them_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cacheproxy.db"

    def keeper(name: str) -> LeaseKeeper:
        upstreams = [Upstream(url) for url in UPSTREAMS]
        return LeaseKeeper(LeaseStore(path), upstreams, name, f"http://{name}", 3.0, 1.0)

    first, second = keeper("a"), keeper("b")
    async with first.running():
        assert sorted(first.held) == UPSTREAMS  # alone
        async with second.running():
            assert second.held == []  # the first holds them all, live
            for _ in range(3):  # the first gives up one a round, idle
                await first.round()
                await second.round()
            assert len(first.held) == len(second.held) == 2
            assert set(first.held).isdisjoint(second.held)
            assert {peer.proxy_id for peer in first.peers} == {"a", "b"}
        # the second stopped: its leases were given up, the first takes them at once
        await first.round()
        assert sorted(first.held) == UPSTREAMS


def test_a_lease_not_renewed_in_time_stops_being_held_before_it_can_be_taken(
    tmp_path: Path,
) -> None:
    now = [NOW]
    upstreams = [Upstream(UPSTREAMS[0])]
    keeper = LeaseKeeper(
        LeaseStore(tmp_path / "c.db"), upstreams, "a", "http://a", 3.0, 1.0, lambda: now[0]
    )
    asyncio.run(keeper.round())
    assert upstreams[0].held
    now[0] += 0.9  # a failed round: the next one may still renew in time
    keeper._expire_unrenewed(now[0])
    assert upstreams[0].held
    now[0] += 0.2  # the next round might end after the lease lapsed
    keeper._expire_unrenewed(now[0])
    assert not upstreams[0].held


# -- the conversation key --------------------------------------------------------------------


def test_a_chat_keeps_its_key_over_turns_and_tenants_never_share_one() -> None:
    first = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
        ]
    }
    later = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "more"},
        ],
        "max_tokens": 9,
    }
    assert conversation_key("t1", first, None, 256) == conversation_key("t1", later, None, 256)
    assert conversation_key("t1", first, None, 256) != conversation_key("t2", first, None, 256)
    other = {"messages": [first["messages"][0], {"role": "user", "content": "bye"}]}
    assert conversation_key("t1", first, None, 256) != conversation_key("t1", other, None, 256)


def test_a_completion_is_known_by_its_prompts_first_tokens_and_a_batch_by_its_first() -> None:
    prompt = random_tokens(300, 1)
    turn = {"prompt": prompt}
    next_turn = {"prompt": prompt + random_tokens(50, 2), "n_predict": 4}
    assert conversation_key("t", turn, None, 256) == conversation_key("t", next_turn, None, 256)
    batch = {"prompt": [prompt, random_tokens(300, 3)]}
    assert conversation_key("t", batch, None, 256) == conversation_key("t", turn, None, 256)
    text = {"prompt": "x" * 2000}
    assert conversation_key("t", text, None, 256) == conversation_key(
        "t", {"prompt": "x" * 3000}, None, 256
    )
    assert conversation_key("t", turn, "s1", 256) != conversation_key("t", turn, "s2", 256)


def test_the_owner_of_a_key_stays_when_another_proxy_leaves() -> None:
    peers = [Peer(name, f"http://{name}") for name in "abc"]
    keys = [f"k{index}" for index in range(200)]
    before = {key: owner_of(key, peers) for key in keys}
    after = {key: owner_of(key, peers[:2]) for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert all(before[key] == peers[2] for key in moved)
    assert {owner.proxy_id for owner in before.values() if owner} == {"a", "b", "c"}


# -- settings ---------------------------------------------------------------------------------


def test_cluster_settings_default_off_and_bound_the_takeover() -> None:
    settings = load_settings()
    assert settings.cluster.enabled is False
    cluster = load_settings(cluster={"enabled": True, "lease_ttl_s": 9}).cluster
    assert cluster.renewal_s() == 3 and cluster.takeover_bound_s() == 12
    with pytest.raises(ValueError, match="renew_interval_s"):
        load_settings(cluster={"lease_ttl_s": 4, "renew_interval_s": 3})
    with pytest.raises(ValueError, match="advertise_url"):
        load_settings(host="0.0.0.0", cluster={"enabled": True})
    reachable = load_settings(
        host="0.0.0.0", cluster={"enabled": True, "advertise_url": "http://h:1/"}
    )
    assert reachable.advertise_url() == "http://h:1" == reachable.proxy_id()


# -- recovery of an archive several proxies write ------------------------------------------


def test_a_shared_archives_recovery_leaves_young_files_and_other_hosts_saves_alone(
    tmp_path: Path,
) -> None:
    def open_store(shared: bool) -> ArchiveIndex:
        eviction = load_plugin("eviction", "lru")
        return ArchiveIndex(
            tmp_path / "slots", tmp_path / "archive.db", eviction, 1 << 30, shared=shared
        )

    data = encode_slot_file(random_tokens(100), kv_state(1, 0, 100, data_bytes=16))
    with open_store(shared=True) as store:
        young = store.path_for(new_file_name())
        young.write_bytes(data)  # another proxy's save, as far as anyone can tell
        old = store.path_for(new_file_name())
        old.write_bytes(data)
        an_hour_ago = time.time() - 3600
        os.utime(old, (an_hour_ago, an_hour_ago))
        elsewhere = store.reserve("t", len(data), None, None)
        elsewhere.path.write_bytes(data[:10])
        # a reservation of another host's process, whose pid means nothing here
        with sqlite3.connect(tmp_path / "archive.db") as db:
            db.execute("UPDATE reservations SET pid = 4194000, pid_started = NULL, host = 'b/boot'")
        report = store.recover()
        assert report.orphan_files == [old.name] and not report.stale_reservations
        assert young.exists() and elsewhere.path.exists()
        # the same reservation of a process of this host: a dead pid here is dead
        with sqlite3.connect(tmp_path / "archive.db") as db:
            db.execute("UPDATE reservations SET host = ?", [store.host])
        assert store.recover().stale_reservations == [elsewhere.id]


def test_a_proxy_holding_more_upstreams_owns_more_conversations() -> None:
    peers = [Peer("a", "http://a", 3), Peer("b", "http://b", 1)]
    owners = Counter(owner_of(f"k{index}", peers).proxy_id for index in range(2000))
    assert 0.68 < owners["a"] / 2000 < 0.82, owners


async def test_a_keeper_cut_off_from_the_database_stops_holding_before_its_lease_lapses(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cacheproxy.db"
    upstreams = [Upstream(UPSTREAMS[0])]
    keeper = LeaseKeeper(LeaseStore(path), upstreams, "a", "http://a", 3.0, 0.5)
    async with keeper.running():
        assert upstreams[0].held
        # another process takes the write lock and keeps it: no round can renew
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            expires_at = max(lease.expires_at for lease in blocker_leases(blocker))
            for _ in range(500):  # up to 10 s
                if not upstreams[0].held:
                    break
                await asyncio.sleep(0.02)
            assert not upstreams[0].held
            # let go while the lease still stood: nobody could have taken it yet
            assert time.time() < expires_at
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        for _ in range(100):  # the database back: held again
            if upstreams[0].held:
                break
            await asyncio.sleep(0.05)
        assert upstreams[0].held


def blocker_leases(connection: sqlite3.Connection) -> list[LeaseRow]:
    rows = connection.execute(
        "SELECT upstream, holder, holder_address, expires_at FROM upstream_leases"
    ).fetchall()
    return [LeaseRow(*row) for row in rows]
