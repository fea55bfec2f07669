"""A llama-server started with a LoRA adapter (`--lora`), behind the proxy.

Each task runs under adapter scales: its body's `lora`, or the server's global ones. The same
tokens computed under other scales are another KV state, and llama-server follows that only in
part: a task naming other scales than its slot's last one clears the slot, one naming none keeps
whatever the slot holds, and a slot restored from a file keeps its last task's scales. So the
proxy lets a request reuse a slot, or restore an archive, only under the scales it was computed
under (upstreams/adapters.py). Each answer is compared with a llama-server of its own that
computes the same request afresh. The adapter is the test bed's (`make_model.ensure_lora`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.provision.make_model import ensure_lora, ensure_model
from cacheproxy.settings import load_settings
from tests.support.completions import complete
from tests.support.disk_tier import (
    PROMPT_TOKENS,
    SAVED_ON_THE_PATH,
    conversation,
    disk_settings,
    next_turn,
    tier,
)
from tests.support.metrics import proxy_counters
from tests.support.routers import SEEDS, start_router
from tests.support.servers import LlamaServer, StartServer, serving
from tests.support.waiting import wait_for

MISMATCH = 'cacheproxy_predictions_total{result="mismatch"}'
RESTORED = 'cacheproxy_archive_restores_total{outcome="restored"}'
SAVED = 'cacheproxy_archive_saves_total{outcome="saved"}'
HELD = PROMPT_TOKENS + 3  # a slot after a 4-token answer: the prompt and 3 tokens generated
ONE_SLOT = {"parallel": 1, "ctx_size": 4096}


@pytest.fixture(scope="module")
def adapter() -> Path:
    return ensure_lora()


def scales(scale: float) -> dict[str, Any]:
    return {"lora": [{"id": 0, "scale": scale}]}


def with_adapter(start_server: StartServer, adapter: Path, **options: Any) -> LlamaServer:
    return start_server(extra_args=("--lora", str(adapter)), **{**ONE_SLOT, **options})


async def fresh(
    client: aiohttp.ClientSession, server: LlamaServer, prompt: list[int], **fields: Any
) -> list[int]:
    """The answer of a server that never saw the prompt's head: computed whole."""
    answer = await complete(client, server.url, prompt, cache_prompt=False, **fields)
    return answer["tokens"]


async def test_an_archive_is_restored_only_under_the_scales_it_was_computed_under(
    start_server: StartServer, adapter: Path, tmp_path: Path
) -> None:
    """A conversation computed without the adapter (scale 0), pushed out of the one slot by
    one under the adapter: its next turn under the adapter computes afresh (restoring the
    archive would have the server go on from text computed without it: another answer), one
    under its own scales gets it back, and so does one naming no scales (the global one) the
    archive of a conversation computed under them."""
    server = with_adapter(start_server, adapter)
    reference = with_adapter(start_server, adapter)
    settings = disk_settings(server, tmp_path, disk=SAVED_ON_THE_PATH)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        assert tier(app).attached[0] is not None
        first = await complete(client, url, conversation(1), **scales(0.0))
        await complete(client, url, conversation(2), **scales(1.0))  # takes the slot
        turn = next_turn(conversation(1), first, 1001)
        answer = await complete(client, url, turn, **scales(1.0))
        assert answer["timings"]["cache_n"] == 0
        assert answer["tokens"] == await fresh(client, reference, turn, **scales(1.0))

        # under its own scales it comes back, although the slot's last task ran under others
        # (the server would clear the slot restored: it is given the scales first)
        restored = (await proxy_counters(client, url)).get(RESTORED, 0)
        turn = next_turn(conversation(1), first, 1002)
        answer = await complete(client, url, turn, **scales(0.0))
        assert answer["timings"]["cache_n"] == HELD
        assert (await proxy_counters(client, url))[RESTORED] == restored + 1
        assert answer["tokens"] == await fresh(client, reference, turn, **scales(0.0))

        # the global scales: computed under them, archived, and restored for the next turn
        third = await complete(client, url, conversation(3))
        await complete(client, url, conversation(4), **scales(0.0))
        restored = (await proxy_counters(client, url)).get(RESTORED, 0)
        turn = next_turn(conversation(3), third, 1003)
        answer = await complete(client, url, turn)
        assert answer["timings"]["cache_n"] == HELD
        assert (await proxy_counters(client, url))[RESTORED] == restored + 1
        assert answer["tokens"] == await fresh(client, reference, turn)


async def test_a_slot_is_reused_only_under_the_scales_its_text_was_computed_under(
    start_server: StartServer, adapter: Path, tmp_path: Path
) -> None:
    """A conversation computed without the adapter, then its next turn naming no scales (the
    server's global one, 1): llama-server would go on from the slot's text, computed under
    other scales. The proxy has the server compute it afresh; and predicts, with no mismatch,
    that a request naming other scales than the slot's last reuses nothing (the server clears
    it), one naming the same reuses it all."""
    server = with_adapter(start_server, adapter)
    reference = with_adapter(start_server, adapter)
    settings = disk_settings(server, tmp_path, disk={"enabled": False})
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        first = await complete(client, url, conversation(1), **scales(0.0))
        turn = next_turn(conversation(1), first, 1001)
        answer = await complete(client, url, turn)
        assert answer["timings"]["cache_n"] == 0
        assert answer["tokens"] == await fresh(client, reference, turn)

        again = next_turn(turn, answer, 1002)  # computed under the global scales now
        answer = await complete(client, url, again, **scales(0.5))
        assert answer["timings"]["cache_n"] == 0
        assert answer["tokens"] == await fresh(client, reference, again, **scales(0.5))
        last = next_turn(again, answer, 1003)
        answer = await complete(client, url, last, **scales(0.5))
        assert answer["timings"]["cache_n"] == len(again) + 3
        assert answer["tokens"] == await fresh(client, reference, last, **scales(0.5))
        assert (await proxy_counters(client, url)).get(MISMATCH, 0) == 0


async def test_new_global_scales_set_through_the_proxy_are_followed(
    start_server: StartServer, adapter: Path, tmp_path: Path
) -> None:
    """`POST /lora-adapters` changes the scales a request naming none runs under: a slot (and
    an archive) computed under the old ones is not reused under the new."""
    server = with_adapter(start_server, adapter)
    reference = with_adapter(start_server, adapter)
    settings = disk_settings(server, tmp_path, disk=SAVED_ON_THE_PATH)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        first = await complete(client, url, conversation(1))
        new_scales = [{"id": 0, "scale": 0.25}]
        async with client.post(url + "/lora-adapters", json=new_scales) as response:
            assert response.status == 200, await response.text()
        async with client.post(reference.url + "/lora-adapters", json=new_scales) as response:
            assert response.status == 200
        turn = next_turn(conversation(1), first, 1001)
        answer = await complete(client, url, turn)
        assert answer["timings"]["cache_n"] == 0
        assert answer["tokens"] == await fresh(client, reference, turn)
        assert app[CACHE].tables[0].adapters == (0.25,)


async def test_a_chat_is_reused_only_under_the_scales_it_was_computed_under(
    start_server: StartServer, adapter: Path, tmp_path: Path
) -> None:
    """The same on `/v1/chat/completions`, whose body's `lora` llama-server reads too: a chat
    computed without the adapter, then its next turn naming no scales."""
    server = with_adapter(start_server, adapter)
    reference = with_adapter(start_server, adapter)
    settings = disk_settings(server, tmp_path, disk={"enabled": False})
    system = {"role": "system", "content": " ".join(f"rule {n} of the house" for n in range(120))}
    messages = [system, {"role": "user", "content": "What is rule 7?"}]
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        first = await chat(client, url, messages, **scales(0.0))
        messages += [first["choices"][0]["message"], {"role": "user", "content": "And rule 9?"}]
        answer = await chat(client, url, messages)
        assert answer["timings"]["cache_n"] == 0
        expected = await chat(client, reference.url, messages, cache_prompt=False)
        assert answer["choices"][0]["message"] == expected["choices"][0]["message"]
        again = await chat(client, url, messages)  # now computed under the global scales
        assert again["timings"]["cache_n"] > 0
        assert (await proxy_counters(client, url)).get(MISMATCH, 0) == 0


async def chat(client: aiohttp.ClientSession, url: str, messages: list, **fields: Any) -> dict:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, **fields}
    async with client.post(url + "/v1/chat/completions", json=body) as response:
        answer = await response.json()
        assert response.status == 200, answer
    return answer


async def test_a_routers_instances_are_followed_under_their_scales(
    start_server: StartServer, llama_server_binary: Path, adapter: Path, tmp_path: Path
) -> None:
    """A router passes `--lora` to every instance it starts: each instance's scales are read
    through the router (`GET /lora-adapters?model=`), and an archive of text computed without
    the adapter is not restored for a turn under it there either."""
    archive = tmp_path / "archive"
    archive.mkdir()
    router = start_router(
        llama_server_binary,
        tmp_path,
        ("alpha",),
        parallel=1,
        ctx_size=4096,
        slot_save_path=archive,
        extra_args=("--lora", str(adapter)),
    )
    reference = with_adapter(start_server, adapter, model=ensure_model(seed=SEEDS["alpha"]))
    settings = load_settings(
        upstreams=[router.url],
        state_dir=tmp_path / "state",
        disk={"directory": archive, "database": tmp_path / "archive.db", **SAVED_ON_THE_PATH},
    )
    try:
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
            first = await complete(client, url, conversation(1), model="alpha", **scales(0.0))
            await complete(client, url, conversation(2), model="alpha", **scales(1.0))
            turn = next_turn(conversation(1), first, 1001)
            answer = await complete(client, url, turn, model="alpha", **scales(1.0))
            assert answer["timings"]["cache_n"] == 0
            assert answer["tokens"] == await fresh(client, reference, turn, **scales(1.0))
            turn = next_turn(conversation(1), first, 1002)
            answer = await complete(client, url, turn, model="alpha", **scales(0.0))
            assert answer["timings"]["cache_n"] == HELD  # its own scales: restored
            assert answer["tokens"] == await fresh(client, reference, turn, **scales(0.0))
            [instance] = [table for table in app[CACHE].tables if not table.router]
            assert instance.adapters == (1.0,)
    finally:
        router.stop()


async def test_an_archive_is_restored_only_under_the_adapters_it_was_computed_under(
    start_server: StartServer, adapter: Path, tmp_path: Path
) -> None:
    """A server restarted with another adapter file, loaded at a global scale of 0 (so that the
    model's fingerprint, taken from how it answers, does not change): a conversation computed
    under the first adapter is another state than the same scales of the second, and is not
    restored there."""

    def unapplied(lora: Path, **options: Any) -> LlamaServer:
        return start_server(extra_args=("--lora-scaled", f"{lora}:0"), **{**ONE_SLOT, **options})

    server = unapplied(adapter)
    settings = disk_settings(server, tmp_path, disk=SAVED_ON_THE_PATH)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        first = await complete(client, url, conversation(1), **scales(1.0))
        await complete(client, url, conversation(2))  # takes the slot: the first is archived
        assert (await proxy_counters(client, url))[SAVED] >= 1
        server.stop()
        other = ensure_lora(seed=8)
        again = unapplied(other, port=server.port)
        reference = unapplied(other)
        await wait_for(lambda: app[CACHE].tables[0].adapter_files == (str(other),), "re-read")
        await wait_for(lambda: 0 in tier(app).attached, "the disk tier attached again")
        turn = next_turn(conversation(1), first, 1001)
        answer = await complete(client, url, turn, **scales(1.0))
        assert answer["timings"]["cache_n"] == 0
        assert answer["tokens"] == await fresh(client, reference, turn, **scales(1.0))
        assert again.process.poll() is None
