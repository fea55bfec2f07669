"""A conversation's next turn, sent while its slot is being saved for another conversation,
waits for that save and restores it, rather than find no archive and prefill it all.

Against the fake llama-server: the race needs the save held at the server while the next turn
is placed, which the real one cannot be made to do (it runs a slot action between two batches,
in milliseconds); the fake holds it until the test lets it go.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.completions import bearer, complete
from tests.support.fake_llama_server import fake_llama_server
from tests.support.fake_stack import proxy_before
from tests.support.metrics import sample
from tests.support.waiting import wait_for

# saves only at eviction (none ahead, none at shutdown), and every one made: the subject is
# when a save is found, not whether the cost model makes it
DISK = {"ahead_mib_s": 0.0, "drain_on_shutdown": False, "always_save": True}


def ids(seed: int, length: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


@pytest.mark.parametrize(
    ("sender", "route"),
    [("acme", "/completion"), ("globex", "/completion"), ("acme", "/v1/chat/completions")],
    ids=["own-tenant", "another-tenant", "own-tenant-chat"],
)
async def test_a_next_turn_placed_while_its_text_is_saved_restores_it(
    tmp_path: Path, sender: str, route: str
) -> None:
    """`own-tenant`: the next turn waits for the save of its text, then restores it.
    `another-tenant` sends the same tokens: it never waits for a save of acme's text (its time
    would tell acme's text is being saved), nor reuses it. `own-tenant-chat`: the first turn
    a chat, whose answer's ids the proxy is not given (the first OpenAI-shaped answer is asked
    without `verbose`): the slot's text ends in ids it does not know, and is waited for all the
    same."""
    folder = tmp_path / "slots"
    folder.mkdir()
    with TenantRegistry(tmp_path / "state" / "cacheproxy.db") as registry:
        keys = {name: bearer(registry.create(name)[1]) for name in ("acme", "globex")}
    acme = keys["acme"]
    other, third = ids(2), ids(3)
    async with (
        aiohttp.ClientSession() as client,
        fake_llama_server(n_slots=2, slot_save_path=folder) as fake,
        proxy_before(fake, tmp_path, disk=DISK) as (url, app),
    ):
        if route == "/completion":
            turn = await complete(client, url, ids(1), acme)
            next_turn: dict = {"prompt": [*ids(1), *turn["tokens"], *ids(4, 40)]}
            reused = turn["tokens_cached"]
        else:
            messages = [{"role": "user", "content": "a question " * 150}]
            turn = await complete(client, url, None, acme, path=route, messages=messages)
            reply = turn["choices"][0]["message"]["content"]
            said = [{"role": "assistant", "content": reply}, {"role": "user", "content": "on"}]
            next_turn = {"prompt": None, "messages": [*messages, *said]}
            reused = turn["usage"]["prompt_tokens"] + len(reply) - 1  # all but its last token
        first_slot = fake.bodies(route)[0]["id_slot"]
        # the other slot busy, so that the third conversation takes the first one's slot
        busy = fake.hold(lambda body: body.get("prompt") == other)
        running = asyncio.create_task(complete(client, url, other, acme))
        await busy.arrived.wait()
        saving = fake.hold(
            lambda body: body["action"] == "save" and body["id_slot"] == first_slot,
            stage="slot_action",
        )
        evicting = asyncio.create_task(complete(client, url, third, acme))
        await saving.arrived.wait()  # the first conversation's text is being saved
        busy.release()
        await running
        # its next turn: the only idle slot is the other one, which holds none of it
        answering = asyncio.create_task(
            complete(client, url, headers=keys[sender], path=route, **next_turn)
        )
        if sender == "acme":
            await wait_for(
                lambda: sample(app, "cacheproxy_archive_saves_awaited_total") == 1,
                "the next turn to wait for the save",
            )
            assert not answering.done()
        else:
            await wait_for(answering.done, "globex's answer while acme's save is held")
        saving.release()
        answer, _ = await asyncio.gather(answering, evicting)
        awaited = sample(app, "cacheproxy_archive_saves_awaited_total")
        restored = sample(app, "cacheproxy_archive_restores_total", outcome="restored")
    [sent] = [
        body
        for body in fake.bodies(route)
        if all(body.get(field) == value for field, value in next_turn.items())
    ]
    next_slot = sent["id_slot"]
    assert next_slot != first_slot
    restores = [r.path for r in fake.received if r.query.get("action") == "restore"]
    if sender == "acme":
        assert answer["timings"]["cache_n"] == reused
        assert (awaited, restored) == (1, 1)
        assert restores == [f"/slots/{next_slot}"]
    else:
        assert answer["timings"]["cache_n"] == 0
        assert (awaited, restored) == (0, 0)
        assert restores == []
