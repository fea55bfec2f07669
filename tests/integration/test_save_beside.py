"""A request that evicts a slot waits for the server's save of it, not for the archive's commit
to the index: the commit runs while the request is sent, and an answer given whole waits for it.
A real llama-server (-np 1) and a real archive index.

To watch the request go on while the commit has not ended, the index's commit is held (the real
one, wrapped to wait for an event the test sets): the request's task must reach the server and
be answered meanwhile, and its client must get the answer only once the commit is let go.
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.http.app_keys import ARCHIVES
from tests.support.completions import complete
from tests.support.disk_tier import SAVED_ON_THE_PATH, conversation, disk_settings
from tests.support.metrics import sample
from tests.support.servers import StartServer, serving
from tests.support.waiting import wait_for

ANSWER_TOKENS = 8


async def tokens_predicted(client: aiohttp.ClientSession, server_url: str) -> float:
    """llama-server's count of the tokens it generated, over the tasks it has finished."""
    async with client.get(server_url + "/metrics") as response:
        text = await response.text()
    found = re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.MULTILINE)
    assert found, text
    return float(found.group(1))


async def test_an_evicting_request_is_sent_while_its_save_is_committed(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=1, ctx_size=4096)
    settings = disk_settings(server, tmp_path, disk={"always_save": True, **SAVED_ON_THE_PATH})
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        held = conversation(1)
        await complete(client, url, held)
        index = app[ARCHIVES].blocking
        assert index.list() == []

        let_go, entered = threading.Event(), threading.Event()
        commit = index.commit

        def held_commit(*args: Any) -> Any:  # in the store's worker thread
            entered.set()
            assert let_go.wait(60), "the test never let the commit go"
            return commit(*args)

        index.commit = held_commit  # type: ignore[method-assign]
        before = await tokens_predicted(client, server.url)
        try:
            # another conversation takes the only slot: the first is saved
            evicting = asyncio.ensure_future(
                complete(client, url, conversation(2), n_predict=ANSWER_TOKENS, ignore_eos=True)
            )
            await wait_for(entered.is_set, "the save's commit begins")

            async def answered() -> bool:
                return await tokens_predicted(client, server.url) >= before + ANSWER_TOKENS

            # the server answered the evicting request while its save's commit was held
            await wait_for(answered, "the server answers the evicting request")
            assert not evicting.done()  # the client's answer waits for the commit
            assert index.list() == []
        finally:
            let_go.set()
        answer = await evicting
        assert answer["tokens_predicted"] == ANSWER_TOKENS
        [archive] = index.list()
        assert archive.n_tokens >= len(held)
        assert sample(app, "cacheproxy_archive_saves_total", outcome="saved") == 1
        assert sample(app, "cacheproxy_evictions_total", archive="saved") == 1
