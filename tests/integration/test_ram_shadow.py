"""The shadow of llama-server's own RAM cache (`--cache-ram`, on by default), against a real one.

A conversation evicted from its slot by another is kept by the server's RAM cache: the proxy
predicts the restore the server will make (its `cache_n` exactly), and the disk tier does not
make the request wait for a save of what that cache keeps, unless the cost model finds the part
no archive holds worth it at the chance the RAM copy is lost (`disk.ram_cache_loss_chance`): it
dies with a restart, the disk's copy does not. A RAM cache smaller than the proxy believes drops
the entry: the server's answer shows it, the table and the shadow are corrected, and `/metrics`
counts it. A budget the proxy learns (its default) is counted on only as far as the server has
shown it: until then the disk tier saves and restores as if the RAM cache were not there, so a
budget set too high costs no prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import Settings, load_settings
from tests.support.completions import complete
from tests.support.metrics import proxy_counters
from tests.support.restarts import found_under_a_request
from tests.support.servers import LlamaServer, StartServer, serving
from tests.support.waiting import wait_for

PROMPT_TOKENS = 600
TWO_SLOTS = {"parallel": 2, "ctx_size": 8192}


def conversation(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


# the chance a RAM copy is gone when its conversation comes back, in the tests of restarts
RESTART = 1.0


def with_disk_tier(server: LlamaServer, tmp_path: Path, **disk: object):  # noqa: ANN201
    return load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        routing={"health_interval_s": 0.2},
        disk={
            "directory": server.slot_save_path,
            "database": tmp_path / "archive.db",
            "min_tokens": 128,
            # the server is never idle long enough to archive ahead, as under a steady load:
            # what the disk tier does at eviction is all there is
            "ahead_idle_s": 3600,
            **disk,
        },
    )


def count(counters: dict[str, float], name: str, label: str, value: str) -> float:
    return counters.get(f'cacheproxy_{name}_total{{{label}="{value}"}}', 0.0)


async def evict_and_return(client: aiohttp.ClientSession, url: str) -> tuple[dict, list[int]]:
    """Conversation A, then B takes A's slot (the router pins a slot that holds something,
    so the server's RAM cache keeps A), then A's next turn: the answer, and A's next prompt."""
    first = conversation(1)
    answer = await complete(client, url, first)
    await complete(client, url, conversation(2))
    follow_up = first + answer["tokens"] + conversation(3, 40)
    return await complete(client, url, follow_up), follow_up


async def test_ram_cache_restore_is_predicted_and_not_saved_to_disk(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(cache_ram_mib=8192, **TWO_SLOTS)  # llama-server's default budget
    # declared never lost: the RAM copy is as good as the disk's, so no save at all
    settings = with_disk_tier(server, tmp_path, ram_cache_loss_chance=0)
    settings.routing.server_ram_cache_learn = False  # the budget told is a fact: counted on
    async with serving(settings) as (url, _):
        before = await proxy_counters(client, url)
        returned, _ = await evict_and_return(client, url)
        after = await proxy_counters(client, url)
    # the server brought A back from its RAM cache: all of A and the answer's cached tokens
    assert returned["timings"]["cache_n"] >= PROMPT_TOKENS
    # ... and the proxy predicted exactly that: every prediction held
    assert (
        count(after, "predictions", "result", "match")
        - count(before, "predictions", "result", "match")
        == 3
    )
    assert count(after, "predictions", "result", "ram_load") == 0
    assert count(after, "shadow_mispredictions", "upstream", server.url) == 0
    # the disk tier left A to the RAM cache: no save, no restore from disk
    assert count(after, "archive_saves", "outcome", "saved") == 0
    assert count(after, "archive_saves", "outcome", "ram_cache") >= 1
    assert count(after, "archive_restores", "outcome", "restored") == 0


async def test_a_slot_the_ram_cache_refills_with_another_conversation_is_weighed_for_a_save(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """A, then B on the only slot, then A again: the server moves B to its RAM cache and loads
    A from there. B keeps none of its tokens in the slot (A's reuse comes from the cache, not
    from B), so B's eviction is at stake as A's was, and each is weighed for a save."""
    server = start_server(cache_ram_mib=8192, parallel=1, ctx_size=4096)
    # the RAM copy declared as good as lost: each eviction is worth a save to the cost model
    settings = with_disk_tier(server, tmp_path, ram_cache_loss_chance=1)
    async with serving(settings) as (url, _):
        returned, _ = await evict_and_return(client, url)
        counters = await proxy_counters(client, url)
    assert returned["timings"]["cache_n"] >= PROMPT_TOKENS  # A came back from the RAM cache
    assert count(counters, "evictions", "archive", "saved") == 2


async def test_a_ram_cache_smaller_than_believed_is_corrected_and_counted(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """1 MiB holds one 600-token state of the small model, not two: saving B drops A, so the
    server cannot restore A where the shadow (told 8192 MiB) expects it to."""
    server = start_server(cache_ram_mib=1, **TWO_SLOTS)
    settings = with_disk_tier(server, tmp_path)
    settings.routing.server_ram_cache_learn = False  # told 8192 MiB as a fact: counted on
    async with serving(settings) as (url, _):
        returned, prompt = await evict_and_return(client, url)
        assert returned["timings"]["cache_n"] == 0
        counters = await proxy_counters(client, url)
        assert count(counters, "shadow_mispredictions", "upstream", server.url) == 1
        assert count(counters, "predictions", "result", "mismatch") == 1
        # corrected: the slot's row is what the server holds, so the next turn is predicted
        again = prompt + returned["tokens"] + conversation(4, 40)
        answer = await complete(client, url, again)
        assert answer["timings"]["cache_n"] >= len(prompt)
        after = await proxy_counters(client, url)
    assert count(after, "shadow_mispredictions", "upstream", server.url) == 1
    assert (
        count(after, "predictions", "result", "match")
        - count(counters, "predictions", "result", "match")
        == 1
    )


async def test_what_the_ram_cache_keeps_is_archived_too_and_outlives_a_restart(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """The RAM cache keeps A when B takes its slot; then the server restarts (a crash), and
    with it that cache. A's next turn still comes back without prefill: from the disk."""
    server = start_server(cache_ram_mib=8192, **TWO_SLOTS)
    # a restart loses the RAM copy: declared so, every eviction is worth a save (the small
    # model prefills so fast that at the default chance the cost model may rightly skip it)
    settings = with_disk_tier(server, tmp_path, ram_cache_loss_chance=RESTART)
    async with serving(settings) as (url, app):
        first = conversation(1)
        answer = await complete(client, url, first)
        await complete(client, url, conversation(2))  # B: takes A's slot, A goes to RAM

        table = app[CACHE].tables[0]
        server.kill()
        await wait_for(lambda: not table.healthy)
        start_server(port=server.port, cache_ram_mib=8192, **TWO_SLOTS)
        await wait_for(lambda: table.healthy)
        # a fresh server: its RAM cache is empty, and A's slot is long gone
        follow_up = first + answer["tokens"] + conversation(3, 40)
        returned = await complete(client, url, follow_up)
        assert returned["timings"]["cache_n"] >= PROMPT_TOKENS
        after = await proxy_counters(client, url)
    # saved once, when B took A's slot: a first eviction holds nothing any archive has
    assert count(after, "evictions", "archive", "saved") == 1
    assert count(after, "archive_restores", "outcome", "restored") == 1


def unwatched_with_disk_tier(server: LlamaServer, tmp_path: Path) -> Settings:
    """`with_disk_tier` with no health check or reconcile to see a restart: only what the
    requests themselves show can tell the proxy (and the RAM copy declared lost, as above)."""
    settings = with_disk_tier(server, tmp_path, ram_cache_loss_chance=RESTART)
    settings.routing.health_interval_s = 3600
    settings.routing.reconcile_interval_s = 3600
    return settings


async def test_a_restart_between_health_checks_is_found_and_the_disk_serves_after_it(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """A server that restarts quicker than a health check looks is found by its slots' task
    ids (they begin again): its table and the shadow of its RAM cache are emptied, so the
    conversations the shadow thought that cache held come back from the disk."""
    server = start_server(cache_ram_mib=8192, **TWO_SLOTS)
    settings = unwatched_with_disk_tier(server, tmp_path)
    async with serving(settings) as (url, app):
        prompts = [conversation(seed) for seed in (1, 2, 3, 4)]
        answers = [await complete(client, url, prompt) for prompt in prompts]
        # A and B were evicted by C and D: kept in the server's RAM cache, and archived
        table = app[CACHE].tables[0]
        slots_before = table.slots
        server.kill()
        start_server(port=server.port, cache_ram_mib=8192, **TWO_SLOTS)

        def next_turn(index: int) -> list[int]:
            return prompts[index] + answers[index]["tokens"] + conversation(10 + index, 40)

        # the first answer shows less cached than predicted: the proxy looks at the slots
        await complete(client, url, next_turn(0))
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: table.slots is not slots_before and table.healthy, within_s=20)
        returned = await complete(client, url, next_turn(1))
    assert returned["timings"]["cache_n"] >= PROMPT_TOKENS


async def test_a_restart_found_while_the_new_process_serves_keeps_the_upstream_in_service(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """A restart found by the task ids while a request already runs on the new process: the
    upstream is not taken out of service (its table could not be rebuilt before that request
    ends, and every request meanwhile would get 502); what the table held is forgotten in
    place, and the next requests are answered."""
    server = start_server(cache_ram_mib=8192, **TWO_SLOTS)
    settings = unwatched_with_disk_tier(server, tmp_path)
    async with serving(settings) as (url, app):
        for seed in (1, 2, 3):  # three tasks answered: the new process's ids begin below
            await complete(client, url, conversation(seed))
        table = app[CACHE].tables[0]
        server.kill()
        start_server(port=server.port, cache_ram_mib=8192, **TWO_SLOTS)

        # a long answer on the new process, holding one slot through what follows
        long_body = {"prompt": conversation(20), "n_predict": 3000, "ignore_eos": True}
        long_answer = asyncio.create_task(client.post(url + "/completion", json=long_body))
        await found_under_a_request(app, long_answer)
        await complete(client, url, conversation(40))  # 502 when taken out of service
        assert table.healthy
        response = await long_answer
        assert response.status == 200
        response.release()


async def test_a_restart_while_idle_is_found_before_the_next_requests_are_placed(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """A server that restarts while the proxy sends it nothing, quicker than a health check
    looks: the first requests after it (sent together, as a client's workers resume) find
    the new process before they are placed, so none is placed on a RAM-cache or slot hit the
    restart took away: each comes back from the disk at once."""
    server = start_server(cache_ram_mib=8192, **TWO_SLOTS)
    settings = unwatched_with_disk_tier(server, tmp_path)
    async with serving(settings) as (url, app):
        prompts = [conversation(seed) for seed in (1, 2, 3, 4)]
        answers = [await complete(client, url, prompt) for prompt in prompts]
        # A and B were evicted by C and D: kept in the server's RAM cache, and archived
        table = app[CACHE].tables[0]
        server.kill()
        start_server(port=server.port, cache_ram_mib=8192, **TWO_SLOTS)
        before = await proxy_counters(client, url)

        def next_turn(index: int) -> list[int]:
            return prompts[index] + answers[index]["tokens"] + conversation(10 + index, 40)

        returned = await asyncio.gather(*(complete(client, url, next_turn(i)) for i in (0, 1)))
        after = await proxy_counters(client, url)
    # both from their archives (the shadow had them in the RAM cache): restored before they
    # ran, no prediction missed
    assert [answer["timings"]["cache_n"] >= PROMPT_TOKENS for answer in returned] == [True, True]
    assert count(after, "predictions", "result", "mismatch") == count(
        before, "predictions", "result", "mismatch"
    )
    assert table.healthy


async def test_a_restore_into_a_slot_keeps_what_the_slot_held(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """llama-server restores an archive into a slot without copying what the slot held to its
    RAM cache first (it does that only when a task is placed): C, just answered on the only
    slot, is lost there when B's archive is restored over it, whatever the shadow says the
    server would do on placing B's task. So the disk tier saves C as at any eviction, and C's
    next turn comes back from the disk (before, the RAM cache was trusted with C: its next
    turn was prefilled in full)."""
    server = start_server(cache_ram_mib=8192, parallel=1, ctx_size=4096)
    # a RAM copy is declared never lost, so only a restore can make the disk tier save C; B is
    # archived ahead of need, while the server is idle
    settings = with_disk_tier(server, tmp_path, ram_cache_loss_chance=0, ahead_idle_s=0.3)
    async with serving(settings) as (url, app):
        first_b = conversation(1)
        answer_b = await complete(client, url, first_b)

        async def saved() -> float:
            return count(await proxy_counters(client, url), "archive_saves", "outcome", "saved")

        deadline = asyncio.get_running_loop().time() + 30
        while await saved() < 1:
            assert asyncio.get_running_loop().time() < deadline, "B was never archived ahead"
            await asyncio.sleep(0.1)
        # a new process: B is only on disk now, and the slot is empty
        table = app[CACHE].tables[0]
        server.kill()
        await wait_for(lambda: not table.healthy)
        start_server(port=server.port, cache_ram_mib=8192, parallel=1, ctx_size=4096)
        await wait_for(lambda: table.healthy)

        first_c = conversation(2)
        answer_c = await complete(client, url, first_c)
        # at once, before C could be archived ahead: B's next turn, on the slot C is in
        returned_b = await complete(client, url, first_b + answer_b["tokens"] + conversation(3, 40))
        assert returned_b["timings"]["cache_n"] >= PROMPT_TOKENS  # restored from disk
        returned_c = await complete(client, url, first_c + answer_c["tokens"] + conversation(4, 40))
        after = await proxy_counters(client, url)
    assert returned_c["timings"]["cache_n"] >= PROMPT_TOKENS
    assert count(after, "archive_restores", "outcome", "restored") == 2


# --- the budget learnt from the server's answers ---------------------------------------------

USERS, TURNS = 12, 4
FOUR_SLOTS = {"parallel": 4, "ctx_size": 4 * 4096}
DEFAULT_BUDGET = 8192 * (1 << 20)  # routing.server_ram_cache_mib's default, in bytes


async def users_taking_turns(client: aiohttp.ClientSession, url: str) -> tuple[int, int]:
    """More conversations than slots, one turn each in turn, one request at a time: the
    tokens the server decoded, and the turns that reused less than their conversation's last
    prompt (it was prefilled anew: nothing kept it, or what was counted on to was not there)."""
    prompts = [conversation(100 + user) for user in range(USERS)]
    last_sent = [0] * USERS  # each conversation's last prompt, in tokens
    decoded = prefilled_anew = 0
    for turn in range(TURNS):
        for user in range(USERS):
            answer = await complete(client, url, prompts[user])
            decoded += answer["timings"]["prompt_n"]
            prefilled_anew += answer["timings"]["cache_n"] < last_sent[user]
            last_sent[user] = len(prompts[user])
            prompts[user] = prompts[user] + answer["tokens"] + conversation(1000 * turn + user, 40)
    return decoded, prefilled_anew


async def run_users(
    client: aiohttp.ClientSession, server: LlamaServer, tmp_path: Path, learn: bool
) -> tuple[int, int, float, int]:
    """The users through a proxy at its default settings (learning or not): tokens decoded,
    the shadow's budget after them, the answers it did not predict, and the turns prefilled
    anew."""
    settings = with_disk_tier(server, tmp_path / ("learning" if learn else "fixed"))
    settings.routing.server_ram_cache_learn = learn
    async with serving(settings) as (url, app):
        decoded, prefilled_anew = await users_taking_turns(client, url)
        shadow = app[CACHE].tables[0].ram_shadow
        assert shadow is not None
        counters = await proxy_counters(client, url)
    misses = count(counters, "shadow_mispredictions", "upstream", server.url)
    # what the server has shown it keeps, as /metrics tells it (-1: the budget is a fact)
    shown = counters[f'cacheproxy_shadow_proven_bytes{{upstream="{server.url}"}}']
    assert shown == (shadow.proven_bytes if learn else -1), (shown, shadow.proven_bytes)
    return decoded, shadow.budget_bytes, misses, prefilled_anew


async def test_a_ram_cache_smaller_than_the_setting_costs_no_prefill(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """`--cache-ram 4` holds a few of the 12 conversations; the proxy, left at its default
    (8192 MiB, learnt), has no answer yet that shows the server keeping a conversation while
    others are cached after it, so it counts on no such load: each evicted conversation is
    saved, and restored when it comes back, and no turn is prefilled anew. Told the 8192 MiB
    as a fact, it leaves each to the RAM cache, which has dropped it: prefilled in full."""
    fixed = await run_users(client, start_server(cache_ram_mib=4, **FOUR_SLOTS), tmp_path, False)
    learnt = await run_users(client, start_server(cache_ram_mib=4, **FOUR_SLOTS), tmp_path, True)
    assert fixed[1] == DEFAULT_BUDGET  # taken as a fact
    assert fixed[3] > 0
    assert learnt[0] < 0.6 * fixed[0], (learnt, fixed)
    assert learnt[3] == 0, learnt
    assert learnt[2] == 0, learnt  # nothing counted on that the server did not do


@pytest.mark.parametrize("cache_ram", [64, None])
async def test_a_ram_cache_that_holds_everything_is_left_as_it_is(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    cache_ram: int | None,
) -> None:
    """`--cache-ram 64` and llama-server's default (no flag: 8192 MiB) keep all 12
    conversations: nothing the server does contradicts the shadow, the budget stays, nothing
    more is decoded."""
    flags = {"cache_ram_mib": cache_ram, **FOUR_SLOTS}
    fixed = await run_users(client, start_server(**flags), tmp_path, False)
    learnt = await run_users(client, start_server(**flags), tmp_path, True)
    assert learnt[1] == DEFAULT_BUDGET
    assert learnt[0] <= fixed[0]
    assert learnt[2] == fixed[2] == 0
