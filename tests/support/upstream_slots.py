"""What a llama-server's slots are doing, read from its `GET /slots`, for tests that check the
server itself rather than what the proxy believes."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.support.servers import LlamaServer


async def slots(client: aiohttp.ClientSession, server: LlamaServer) -> list[dict]:
    async with client.get(server.url + "/slots") as response:
        return await response.json()


# Each GET /slots is a task for the server's main loop; polled too often it starves generation
# and delays llama-server's own check for a closed connection (made about once a second).
SLOTS_POLL_S = 0.25


async def wait_until_idle(
    client: aiohttp.ClientSession, server: LlamaServer, within_s: float
) -> list[dict]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        state = await slots(client, server)
        if not any(slot["is_processing"] for slot in state):
            return state
        await asyncio.sleep(SLOTS_POLL_S)
    raise AssertionError(f"a slot was still processing after {within_s} s: {state}")


def generated_by_last_task(state: list[dict], prompt_length: int) -> int:
    """Tokens the most recent task generated before it ended (completed or cancelled).

    After a task the slot keeps prompt + generated tokens, minus the last sampled one, which is
    never decoded; `n_decoded` itself is reset on release, so the slot's length is the witness.
    """
    last = max((slot for slot in state if "id_task" in slot), key=lambda slot: slot["id_task"])
    return last["n_prompt_tokens"] - prompt_length + 1
