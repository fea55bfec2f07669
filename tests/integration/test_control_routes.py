"""The routes that act on a task by its id answer a tenant only about its own tasks, on a real
llama-server: another tenant naming a running completion's id is answered as llama-server
answers an id it has no running completion for, and the completion's own tenant reaches it."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import orjson

from tests.support.fair_share import Proxy, fair_proxy
from tests.support.servers import StartServer

_rng = random.Random(3406)
CONTROL = "/v1/chat/completions/control"
# llama-server's answer to an id no running completion has (server-context.cpp, the control task)
NO_SUCH_COMPLETION = {"success": False, "message": "no active completion for this id"}


async def control(client: aiohttp.ClientSession, proxy: Proxy, key: str, named: str) -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    body = {"id": named, "action": "reasoning_end"}
    async with client.post(proxy.url + CONTROL, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_a_tenant_reaches_only_its_own_running_completion(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2)
    async with fair_proxy(server, tmp_path) as proxy:
        _, owner = await proxy.create("owner")
        _, other = await proxy.create("other")
        words = " ".join(f"w{_rng.randrange(100000)}" for _ in range(40))
        body = {
            "messages": [{"role": "user", "content": words}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {owner}"}
        response = await client.post(proxy.url + "/v1/chat/completions", json=body, headers=headers)
        try:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: {"):
                    completion_id = orjson.loads(line[6:])["id"]
                    break
            # the other tenant is told what an unknown id gets: nothing of the running task
            assert await control(client, proxy, other, completion_id) == NO_SUCH_COMPLETION
            # so is a made-up id, for either tenant
            assert await control(client, proxy, other, "chatcmpl-none") == NO_SUCH_COMPLETION
            # its owner reaches it: the server found its slot (this model has no reasoning)
            mine = await control(client, proxy, owner, completion_id)
            assert mine == {
                "success": False,
                "message": "reasoning control not enabled for this completion",
            }
        finally:
            response.close()
