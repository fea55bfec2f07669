"""Archiving ahead of need, and decisions that follow the disk, against real llama-servers.

What is saved and when is read from the proxy's own counters and from the files llama-server
writes into its `--slot-save-path`, not from timings. The slow disk is real: a loop device under
the archive folder, throttled through a block-I/O cgroup that the llama-server is put in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.disk.tier import others_busy
from cacheproxy.http.app_keys import ARCHIVES, CACHE
from cacheproxy.provision.make_model import ensure_model, server_args
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support import databases
from tests.support.completions import complete
from tests.support.disk_tier import PROMPT_TOKENS, conversation, disk_settings, next_turn
from tests.support.metrics import sample
from tests.support.mounts import slow_disk
from tests.support.servers import LlamaServer, StartServer, serving
from tests.support.waiting import wait_for as wait_until

# archived ahead once idle 0.2 s, looked for every 0.05 s
AHEAD = {"ahead_mib_s": 64.0, "ahead_idle_s": 0.2, "ahead_interval_s": 0.05}


# the tests that count an archive's saves by its slot files keep archives as whole files
WHOLE_FILES = {"blocks": False}


def slot_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("a_*.slot"))


def hold(app: Any) -> None:
    """Keep the background archiver from saving: its bandwidth bucket deep in debt."""
    app[CACHE].ahead._credit = -1e18


def release(app: Any) -> float:
    """Let it save again, starting from an empty bucket now; when that was."""
    now = time.monotonic()
    app[CACHE].ahead._refilled = now
    app[CACHE].ahead._credit = 0.0
    return now


def one_slot_kv_heavy(start_server: StartServer) -> LlamaServer:
    """A llama-server of the kv-heavy model (64 KiB a token) with one slot and one thread."""
    return start_server(
        model=ensure_model("kv-heavy"),
        parallel=1,
        ctx_size=2048,
        extra_args=("--threads", "1", *server_args("kv-heavy")),
    )


async def test_an_idle_slot_is_archived_ahead_and_its_eviction_saves_nothing(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1, ctx_size=4096)
    settings = disk_settings(server, tmp_path, disk={**AHEAD, **WHOLE_FILES})
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        first = conversation(1)
        answer = await complete(client, url, first)
        # nobody needs the slot yet: the conversation is saved in the background
        await wait_until(lambda: sample(app, "cacheproxy_archive_ahead_bytes_total") > 0)
        [file] = slot_files(server.slot_save_path)
        ahead_bytes = sample(app, "cacheproxy_archive_ahead_bytes_total")
        assert ahead_bytes == file.stat().st_size
        assert [a.n_tokens for a in app[ARCHIVES].blocking.list()] == [PROMPT_TOKENS + 3]

        # another conversation takes the only slot: the first one is covered, nothing is saved
        await complete(client, url, conversation(2))
        assert sample(app, "cacheproxy_evictions_total", archive="covered") == 1
        assert sample(app, "cacheproxy_evictions_total", archive="saved") == 0
        assert sample(app, "cacheproxy_archive_saves_total", outcome="saved") == 1  # the ahead one
        assert file.exists()

        # and the first conversation comes back from its archive
        again = await complete(client, url, next_turn(first, answer, 3))
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3
        assert sample(app, "cacheproxy_archive_restores_total", outcome="restored") == 1


async def test_ahead_saves_keep_to_the_budget_newest_first(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=4, ctx_size=4 * 1024)
    # about 0.6 MB per conversation, 0.25 MiB/s: one save at once, then one every ~2.4 s
    budget = {**AHEAD, "ahead_mib_s": 0.25, "ahead_idle_s": 0.0}
    settings = disk_settings(server, tmp_path, disk={**budget, **WHOLE_FILES})
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        hold(app)  # until all four are idle
        for seed in range(4):
            await complete(client, url, conversation(seed))
        started = release(app)
        await wait_until(lambda: sample(app, "cacheproxy_archive_ahead_bytes_total") > 0)
        samples = []
        # the four files, and their rows in the index (committed just after each file)
        while len(slot_files(server.slot_save_path)) < 4 or len(app[ARCHIVES].blocking.list()) < 4:
            assert time.monotonic() - started < 30, "the budget starved the saves"
            written = sample(app, "cacheproxy_archive_ahead_bytes_total")
            samples.append((time.monotonic() - started, written))
            await asyncio.sleep(0.05)
        one = max(a.bytes for a in app[ARCHIVES].blocking.list())
        for elapsed, written in samples:
            # what the bucket allows: one save at once, then the budget
            assert written <= one + elapsed * 0.25 * (1 << 20) + 1
        # the last conversation used was saved first, the first one last
        archives = sorted(app[ARCHIVES].blocking.list(), key=lambda a: a.created)
        first_tokens = [app[ARCHIVES].blocking.tokens(a.id)[:PROMPT_TOKENS] for a in archives]
        assert first_tokens == [conversation(seed) for seed in (3, 2, 1, 0)]


async def test_a_request_for_a_slot_being_saved_waits_for_that_save_only(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=4096)
    settings = disk_settings(server, tmp_path, disk=AHEAD)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        layer = app[CACHE]
        disk, scheduler = layer.disk, layer.scheduler
        hold(app)  # until both slots are idle
        prompts = [conversation(seed) for seed in (1, 2)]
        answers = [await complete(client, url, prompt) for prompt in prompts]
        saves: list[tuple[float, int]] = []  # when each save began, and of which slot
        being_saved: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        real_save = disk.save

        # the real save, once the request for the slot's conversation has reached the scheduler
        async def save_while_a_request_arrives(table, slot_id, content, attached):  # noqa: ANN001, ANN202
            saves.append((time.monotonic(), slot_id))
            if table.slots[slot_id].saving and not being_saved.done():
                being_saved.set_result(slot_id)
                await wait_until(lambda: scheduler.queued == 1, within_s=10)
            return await real_save(table, slot_id, content, attached)

        disk.save = save_while_a_request_arrives
        release(app)
        saved_slot = await being_saved
        held = layer.tables[0].slots[saved_slot].known[:PROMPT_TOKENS]
        which = prompts.index(held)
        sent = time.monotonic()
        again = await complete(client, url, next_turn(prompts[which], answers[which], 9))
        answered = time.monotonic()
        # it got its own slot back, with everything in it, once that one save was done
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3
        assert sample(app, "cacheproxy_evictions_total", archive="saved") == 0
        assert sample(app, "cacheproxy_evictions_total", archive="covered") == 0
        # no other save started while it waited or ran
        assert [save for save in saves if sent <= save[0] <= answered] == []
        assert saves[0][1] == saved_slot


@pytest.mark.database  # the tenant's quota, counted in the archive index
async def test_ahead_saves_never_push_out_a_tenants_archives(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=4096)
    database = tmp_path / "tenants.db"
    with TenantRegistry(databases.chosen(database)) as registry:
        # room for one 600-token conversation (about 0.62 MB), not two
        tenant, key = registry.create("alice", quota_bytes=1_000_000)
    settings = disk_settings(
        server, tmp_path, disk={**AHEAD, **WHOLE_FILES}, tenants={"database": database}
    )
    headers = {"Authorization": f"Bearer {key}"}
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        hold(app)  # until both are idle
        await complete(client, url, conversation(1), headers)
        await complete(client, url, conversation(2), headers)
        release(app)
        await wait_until(
            lambda: (
                sample(app, "cacheproxy_saves_skipped_total", path="ahead", reason="no_room") >= 1
            )
        )
        # one conversation was archived (ahead, or when the other took its slot); the other
        # one's ahead save would have pushed it out of the quota, and was not made
        [archive] = app[ARCHIVES].blocking.list()
        assert archive.tenant_id == tenant.id
        held = app[ARCHIVES].blocking.tokens(archive.id)[:PROMPT_TOKENS]
        assert held in (conversation(1), conversation(2))
        assert app[ARCHIVES].blocking.usage(tenant.id).bytes <= 1_000_000
        assert len(slot_files(server.slot_save_path)) == 1


async def test_another_tenants_request_never_waits_for_a_save(
    start_server: StartServer, tmp_path: Path
) -> None:
    # how long it waited would tell the size of a conversation not its own: evicted by another
    # tenant, a conversation is kept only if archiving ahead covered it
    server = start_server(parallel=1, ctx_size=4096)
    database = tmp_path / "tenants.db"
    with TenantRegistry(databases.chosen(database)) as registry:
        keys = {name: registry.create(name)[1] for name in ("alice", "bob")}
    settings = disk_settings(server, tmp_path, disk=AHEAD, tenants={"database": database})
    alice, bob = ({"Authorization": f"Bearer {keys[name]}"} for name in ("alice", "bob"))
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:

        def evictions(archive: str) -> float:
            return sample(app, "cacheproxy_evictions_total", archive=archive)

        hold(app)
        await complete(client, url, conversation(1), bob)
        await complete(client, url, conversation(2), alice)
        assert evictions("dropped") == 1 and evictions("saved") == 0
        assert sample(app, "cacheproxy_saves_skipped_total", path="eviction", reason="other_tenant")
        assert app[ARCHIVES].blocking.list() == []
        # her own next conversation waits for the save of her first, as before
        await complete(client, url, conversation(3), alice)
        assert evictions("saved") == 1
        # archived ahead, bob's conversation outlives alice's request
        await complete(client, url, conversation(4), bob)
        release(app)
        await wait_until(lambda: sample(app, "cacheproxy_archive_ahead_bytes_total") > 0)
        hold(app)
        await complete(client, url, conversation(5), alice)
        assert evictions("covered") == 1 and evictions("dropped") == 2
        assert len(app[ARCHIVES].blocking.list()) == 2


async def one_cycle(client: aiohttp.ClientSession, url: str, seed: int, disk: Any) -> dict:
    """A conversation evicted by another from the only slot, then back for its next turn, its
    archive (if it has one) read from the device, as if written long ago."""
    first = conversation(seed)
    answer = await complete(client, url, first)
    await complete(client, url, conversation(seed + 1))
    disk.forget_cached()
    return await complete(client, url, next_turn(first, answer, seed + 2))


async def old_conversation_back(
    client: aiohttp.ClientSession, url: str, seed: int, disk: Any
) -> dict:
    """Conversation 100 (archived while the disk was fast) comes back with a new question."""
    disk.forget_cached()
    return await complete(client, url, conversation(100) + conversation(seed, 40))


async def test_the_only_copy_is_saved_until_saves_have_measured_the_disk(
    start_server: StartServer, tmp_path: Path
) -> None:
    # a disk so slow from the start that, measured, a save costs far more than the prefill it
    # spares: the first evictions, each the only copy of its conversation, are saved all the
    # same until three saves have measured it (one figure may be an outlier), then dropped
    server = start_server(parallel=1, ctx_size=4096)
    with slow_disk(server.slot_save_path) as disk:
        disk.add(server.process.pid)
        disk.limit(256 * 1024)
        tier = {"ahead_mib_s": 0.0}
        # llama-server answers no health check while it saves on the slow disk
        routing = {"health_timeout_s": 60.0}
        settings = disk_settings(server, tmp_path, disk={**tier, **WHOLE_FILES}, routing=routing)
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:

            def evictions(archive: str) -> float:
                return sample(app, "cacheproxy_evictions_total", archive=archive)

            # each conversation evicts the one before it from the only slot
            for seed in range(1, 6):
                await complete(client, url, conversation(seed))
            assert evictions("saved") == 3 and evictions("dropped") == 1
            reason = {"path": "eviction", "reason": "not_worth"}
            assert sample(app, "cacheproxy_saves_skipped_total", **reason) == 1
            [attached] = app[CACHE].disk.attached.values()
            assert attached.save_bytes_per_ms.samples == 3
            assert len(slot_files(server.slot_save_path)) == 3


# the tiny model's rates as a quiet two-core machine measures them (the page cache's writes)
QUIET_MACHINE_RATES = {
    "prefill_ms_per_token": 0.065,
    "save_bytes_per_ms": 900_000.0,
    "save_overhead_ms": 1.5,
    "restore_bytes_per_ms": 880_000.0,
    "restore_overhead_ms": 2.0,
}


async def test_questions_on_an_archived_document_stop_saving_their_own_text(
    start_server: StartServer, tmp_path: Path
) -> None:
    # questions on one document, each evicted by a conversation before the next comes: every
    # question restores the document's archive and reuses the document only, so its tenant's
    # requests are seen to branch off what they reuse. Soon a question's own text is no longer
    # written at its eviction, and the document still comes back for every question.
    server = start_server(parallel=1, ctx_size=4096)
    settings = disk_settings(server, tmp_path, disk={"ahead_mib_s": 0.0})
    document = conversation(10, 400)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        # What a question's text is worth keeping is its prefill against a write: on a loaded
        # machine the server's prefill slows many times more than a write to the page cache,
        # and every question would rightly be saved. The rates are those a quiet machine
        # measures here, so that what is tested is the tenant's requests being seen to branch.
        costs = app[CACHE].disk.costs
        measured = costs.rates
        costs.rates = lambda *args, **kwargs: dataclasses.replace(  # type: ignore[method-assign]
            measured(*args, **kwargs), **QUIET_MACHINE_RATES
        )

        def skipped() -> float:
            return sum(
                sample(app, "cacheproxy_saves_skipped_total", path="eviction", reason=reason)
                for reason in ("archived", "not_worth", "restore_loses")
            )

        await complete(client, url, document + conversation(11, 40))
        await complete(client, url, conversation(20))  # evicts the first question: saved whole
        assert sample(app, "cacheproxy_evictions_total", archive="saved") == 1
        for seed in range(12, 24):
            answer = await complete(client, url, document + conversation(seed, 40))
            assert answer["timings"]["cache_n"] == len(document)
            await complete(client, url, conversation(seed + 100))  # evicts the question
            if skipped():
                break
        else:
            raise AssertionError("every question's own text was saved")
        # the last question's text was not saved: the conversations' texts were, whole
        # (nothing says they branch), and every question after the first one before it
        saved = sample(app, "cacheproxy_evictions_total", archive="saved")
        assert saved == 1 + 2 * (seed - 12) + 1
        assert sample(app, "cacheproxy_evictions_total", archive="dropped") == 1
        # the cost model's input, as it weighed the last save: the tenant's requests branch
        chance = sample(app, "cacheproxy_disk_continue_chance", tenant="default")
        assert 0 < chance < 1


async def test_decisions_follow_a_slow_disk_and_back(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1, ctx_size=4096)
    remeasure_s = 15.0
    # reads slowed, writes to the page cache: written synchronously to the loop device, a save
    # of the small model's state (~40 MiB/s) costs about what prefilling it does, and the cost
    # model rightly drops it on the "fast" disk too
    with slow_disk(server.slot_save_path, sync=False) as disk:
        disk.add(server.process.pid)
        tier = {"ahead_mib_s": 0.0, "remeasure_s": remeasure_s}
        # llama-server answers no health check while it saves or restores on the slow disk
        routing = {"health_timeout_s": 60.0}
        # archives kept whole: restores read the slow disk (a file put together from blocks
        # would be read from the page cache, the blocks by the proxy)
        settings = disk_settings(server, tmp_path, disk={**tier, **WHOLE_FILES}, routing=routing)
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:

            def count(name: str, **labels: str) -> float:
                return sample(app, name, **labels)

            def skipped() -> float:
                return sum(
                    count("cacheproxy_saves_skipped_total", path="eviction", reason=reason)
                    for reason in ("not_worth", "restore_loses")
                )

            # fast: evictions are saved, conversations come back from disk
            for seed in (100, 110):
                again = await one_cycle(client, url, seed, disk)
                assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3
            assert count("cacheproxy_archive_restores_total", outcome="restored") == 2
            assert skipped() == 0

            # a disk four times slower at reading a conversation than the server at prefilling
            # it, however loaded the machine is now
            [archive, *_] = app[ARCHIVES].blocking.list()
            prefill_tokens_s = count("cacheproxy_prefill_tokens_per_second", upstream=server.url)
            slow = int(archive.bytes / archive.n_tokens * prefill_tokens_s / 4)
            disk.limit(max(slow, 64 * 1024))
            for attempt in range(8):
                await one_cycle(client, url, 200 + 10 * attempt, disk)
                back = await old_conversation_back(client, url, 500 + attempt, disk)
                not_worth = count("cacheproxy_archive_restores_total", outcome="not_worth")
                if skipped() >= 1 and not_worth >= 1:
                    assert back["timings"]["cache_n"] == 0  # prefilled, its archive left alone
                    break
            else:
                raise AssertionError("decisions never turned to prefill on the slow disk")
            slow_rate = count("cacheproxy_disk_restore_mib_per_second", upstream=server.url)

            # fast again: once the rates are old, one save and one restore measure them again,
            # and the decisions come back (the restore: conversation 100, archived while the
            # disk was fast, comes back once more)
            disk.lift()
            await asyncio.sleep(remeasure_s + 0.5)
            for attempt in range(8):
                await old_conversation_back(client, url, 600 + attempt, disk)
                remeasured = count("cacheproxy_archive_saves_total", outcome="remeasure") + count(
                    "cacheproxy_archive_restores_total", outcome="remeasure"
                )
                saved = count("cacheproxy_evictions_total", archive="saved")
                again = await one_cycle(client, url, 300 + 10 * attempt, disk)
                decided = remeasured == count(
                    "cacheproxy_archive_saves_total", outcome="remeasure"
                ) + count("cacheproxy_archive_restores_total", outcome="remeasure")
                restore_rate = count("cacheproxy_disk_restore_mib_per_second", upstream=server.url)
                if (
                    decided
                    and again["timings"]["cache_n"] == PROMPT_TOKENS + 3
                    and count("cacheproxy_evictions_total", archive="saved") > saved
                    and restore_rate > 4 * slow_rate  # a restore measured the fast disk again
                ):
                    break
            else:
                raise AssertionError("decisions never came back to the disk once it was fast")


async def test_a_prompt_token_is_priced_at_what_it_costs_the_server(
    start_server: StartServer, tmp_path: Path
) -> None:
    # four prompts computed together: each request's own prompt_ms counts the whole of the
    # batches it shared, the server computed the four in that time
    model = ensure_model("kv-heavy")
    server = start_server(
        model=model,
        parallel=4,
        ctx_size=4 * 2048,
        extra_args=("--threads", "1", *server_args("kv-heavy")),
    )
    settings = disk_settings(server, tmp_path, disk=AHEAD)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        answers = await asyncio.gather(
            *(complete(client, url, conversation(seed)) for seed in range(4))
        )
        per_request = [a["timings"]["prompt_n"] / a["timings"]["prompt_ms"] * 1000 for a in answers]
        # the background archiver's decisions publish the figure it decides by
        await wait_until(
            lambda: (
                sample(app, "cacheproxy_prefill_server_tokens_per_second", upstream=server.url) > 0
            )
        )
        server_rate = sample(
            app, "cacheproxy_prefill_server_tokens_per_second", upstream=server.url
        )
        # the prompts that shared batches each report a share of what the server did (how
        # many shared which batches depends on when each arrived): the server computed faster
        # than those sharing, at most as fast as all of them together
        assert 1.5 * min(per_request) < server_rate < 1.1 * sum(per_request)


async def test_the_first_eviction_prices_a_prompt_token_at_what_the_first_prompt_measured(
    start_server: StartServer, tmp_path: Path
) -> None:
    # the kv-heavy model: a conversation dear to prefill, cheap to read back. The router's
    # per-request rate starts from a guess and learns gradually; the server's throughput is
    # what its first prompt measured, and what the first eviction is priced at
    server = one_slot_kv_heavy(start_server)
    settings = disk_settings(server, tmp_path, disk={"ahead_mib_s": 0.0})
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        first = conversation(1)
        answer = await complete(client, url, first)
        await complete(client, url, conversation(2))
        assert sample(app, "cacheproxy_evictions_total", archive="saved") == 1
        again = await complete(client, url, next_turn(first, answer, 3))
        assert again["timings"]["cache_n"] == PROMPT_TOKENS + 3


async def test_an_ahead_save_waits_until_no_other_slot_is_busy(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=2 * 4096)
    # a conversation idle 0.5 s is all but sure not to come back (half-life 50 ms): worth a
    # save only while nobody waits for it, never while another slot decodes. (Idle for more
    # than 50 s its chance would round to nothing: the test ends the other slot's request
    # itself, once the proxy has looked at the idle slot, not when a long answer ends.)
    tier = {**AHEAD, "ahead_idle_s": 0.5, "return_half_life_s": 0.05}
    settings = disk_settings(server, tmp_path, disk={**tier, **WHOLE_FILES})
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        disk = app[CACHE].disk
        busy_at_saves: list[int] = []  # the other slots busy as each save began
        real_save = disk.save

        async def save(table, slot_id, content, attached):  # noqa: ANN001, ANN202
            busy_at_saves.append(others_busy(table, slot_id))
            return await real_save(table, slot_id, content, attached)

        disk.save = save
        hold(app)
        await complete(client, url, conversation(1))
        # the other slot generates, its answer not read, until the test cuts it
        body = {"prompt": conversation(2, 64), "n_predict": 4000, "ignore_eos": True}
        long_answer = await client.post(url + "/completion", json={**body, "stream": True})
        assert long_answer.status == 200
        await wait_until(lambda: sum(slot.busy for slot in app[CACHE].tables[0].slots) == 1)
        release(app)
        # the idle slot was looked at (its rates read) with the other one busy: not saved
        await wait_until(
            lambda: sample(app, "cacheproxy_disk_busy_slots", upstream=server.url) == 1
        )
        assert sample(app, "cacheproxy_archive_ahead_bytes_total") == 0
        long_answer.close()  # the client leaves: the server stops, the slot is given back
        # once nobody waits for the write, the idle conversation is saved (the cut answer's
        # slot holds what the proxy cannot name: it is not archived)
        await wait_until(lambda: sample(app, "cacheproxy_archive_ahead_bytes_total") > 0)
        assert len(slot_files(server.slot_save_path)) == 1
        assert busy_at_saves == [0]
        assert sample(app, "cacheproxy_saves_skipped_total", path="ahead", reason="not_worth") == 0


async def test_the_cost_model_knows_a_states_size_and_save_rate_before_the_first_save(
    start_server: StartServer, tmp_path: Path
) -> None:
    # 64 KiB a token: a guess of 1 KiB would price the first saves and restores 64 times low
    server = one_slot_kv_heavy(start_server)
    settings = disk_settings(server, tmp_path, disk=AHEAD)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        known = sample(app, "cacheproxy_disk_bytes_per_token", upstream=server.url)
        assert sample(app, "cacheproxy_archive_saves_total", outcome="saved") == 0
        # and how fast it writes them: measured by the probe's save, not the starting guess
        [attached] = app[CACHE].disk.attached.values()
        assert attached.save_bytes_per_ms.samples == 1
        assert sample(app, "cacheproxy_disk_save_mib_per_second", upstream=server.url) > 0
        await complete(client, url, conversation(1))
        await wait_until(lambda: len(app[ARCHIVES].blocking.list()) == 1)
        [archive] = app[ARCHIVES].blocking.list()
        assert known == pytest.approx(archive.bytes / archive.n_tokens, rel=0.01)
