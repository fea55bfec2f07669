"""A stream its client cuts is charged what the server computed: its prompt once computed, in
the budget, the ledger and the metrics, on every mirrored route (native, OpenAI text
completions, chat, messages, responses), and the tokens it carried; and a client that leaves
before the prompt was computed is charged what the server had computed by then, the slot's own
count.

Real processes: a llama-server, the proxy in this process on a real socket, clients that close
their connection after two events (or as soon as the answer's head arrives)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE, REGISTRY
from tests.support.charges import ledger_row, prompt_tokens
from tests.support.fair_share import Proxy, busy_slots, fair_proxy
from tests.support.metrics import sample
from tests.support.servers import StartServer
from tests.support.upstream_slots import wait_until_idle
from tests.support.waiting import wait_for as until

ONE_THREAD = ("--threads", "1", "--threads-batch", "1")
PROMPT_TOKENS = 1000
GENERATE = 3000  # far more than is read: the client always leaves first

_rng = random.Random(3434)


def ids(n: int) -> list[int]:
    return [_rng.randrange(300, 31000) for _ in range(n)]


def words(n: int) -> str:
    return " ".join(f"w{_rng.randrange(100000)}" for _ in range(n))


def completion_body() -> dict[str, Any]:
    return {"prompt": ids(PROMPT_TOKENS), "n_predict": GENERATE, "ignore_eos": True}


def text_body() -> dict[str, Any]:
    return {"prompt": ids(PROMPT_TOKENS), "max_tokens": GENERATE, "ignore_eos": True}


def chat_body() -> dict[str, Any]:
    content = words(165)  # about 1,000 tokens once templated
    return {"messages": [{"role": "user", "content": content}], "max_tokens": GENERATE}


def messages_body() -> dict[str, Any]:
    return {**chat_body(), "model": "any"}


def responses_body() -> dict[str, Any]:
    return {"input": words(165), "max_output_tokens": GENERATE}


# route, a fresh body, where the server counts that body's prompt tokens, and what an event
# carrying generated text holds (a stream's first events may carry none: a role, a start)
ROUTES: dict[str, tuple[str, Callable[[], dict[str, Any]], str | None, bytes]] = {
    "completion": ("/completion", completion_body, None, b'"content":'),
    "text": ("/v1/completions", text_body, None, b'"text":"'),
    "chat": (
        "/v1/chat/completions",
        chat_body,
        "/v1/chat/completions/input_tokens",
        b'"content":"',
    ),
    "messages": ("/v1/messages", messages_body, "/v1/messages/count_tokens", b'"text_delta"'),
    "responses": (
        "/v1/responses",
        responses_body,
        "/v1/responses/input_tokens",
        b'"response.output_text.delta"',
    ),
}


async def cut_after_two_events(
    client: aiohttp.ClientSession, proxy: Proxy, key: str, path: str, body: dict, text: bytes
) -> int:
    """Send the stream, read two events carrying generated text (`text` in them) and close the
    connection; the status (a refusal is read whole)."""
    headers = {"Authorization": f"Bearer {key}"}
    response = await client.post(proxy.url + path, json={**body, "stream": True}, headers=headers)
    if response.status != 200:
        await response.read()
        response.release()
        return response.status
    events = 0
    async for line in response.content:
        if line.startswith(b"data: ") and text in line:
            events += 1
            if events == 2:
                break
    response.close()  # gone before the end
    return 200


@pytest.mark.parametrize("route", ROUTES)
async def test_a_cut_stream_is_charged_its_prompt_in_the_budget_ledger_and_metrics(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, route: str
) -> None:
    path, body_of, counter, text = ROUTES[route]
    server = start_server(parallel=2)
    bodies = [body_of() for _ in range(8)]
    sizes = [await prompt_tokens(client, server, counter, body) for body in bodies]
    async with fair_proxy(server, tmp_path) as proxy:
        tenant, key = await proxy.create("cutter")
        # a day's budget of three of these ~1,000-token prompts
        proxy.registry.set_limits(tenant.id, tokens_per_day=sum(sizes[:3]))
        await proxy.app[REGISTRY].arefresh()
        statuses = []
        for body in bodies:
            status = await cut_after_two_events(client, proxy, key, path, body, text)
            statuses.append(status)
            if status != 200:
                break
            # the proxy has read what the server computed and given the slot back
            await until(lambda: busy_slots(proxy) == 0, "the cut task to be settled")
        # three prompts use the budget up: the fourth request is refused
        assert statuses == [200, 200, 200, 429], statuses
        charged = sum(sizes[:3])
        row = await ledger_row(client, proxy.url, tenant.id)
        # every prompt charged; each computed but for what it shares with the tenant's last
        # (random text: a chat template's first tokens at most)
        assert row["prompt_tokens"] == charged
        assert row["computed_tokens"] + row["reused_tokens"] == charged
        assert row["reused_tokens"] < 3 * 16
        assert row["generated_tokens"] >= 3 * 2  # at least what was streamed
        # a client that leaves is counted as an error (499), as the refusal is
        assert row["requests"] == row["errors"] == 4
        assert sample(proxy.app, "cacheproxy_prompt_tokens_total", tenant=tenant.id) == charged
        decoded = sample(proxy.app, "cacheproxy_decoded_prompt_tokens_total", tenant=tenant.id)
        assert decoded == row["computed_tokens"]


async def test_a_client_gone_before_its_prompt_was_computed_is_charged_what_was_computed(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """The client leaves as soon as the answer's head arrives (llama-server sends it as the
    prompt starts). The server notices a second later and stops after the batch it computes
    (512 tokens a batch here, one thread): far less than the 24,000-token prompt. The charge is
    what the slot then holds, the server's own count; so is the table's row."""
    server = start_server(
        parallel=1,
        ctx_size=32768,
        extra_args=(*ONE_THREAD, "--batch-size", "512", "--ubatch-size", "512"),
    )
    async with fair_proxy(server, tmp_path) as proxy:
        tenant, key = await proxy.create("leaver")
        prompt = ids(24000)
        headers = {"Authorization": f"Bearer {key}"}
        body = {"prompt": prompt, "n_predict": 4, "stream": True}
        response = await client.post(proxy.url + "/completion", json=body, headers=headers)
        assert response.status == 200
        response.close()  # gone before the first token
        await until(lambda: busy_slots(proxy) == 0, "the cut task to be settled", within_s=120)
        [slot] = await wait_until_idle(client, server, within_s=10)
        computed = slot["n_prompt_tokens"]
        assert 0 < computed < len(prompt)  # the server stopped part-way
        row = await ledger_row(client, proxy.url, tenant.id)
        assert row["prompt_tokens"] == row["computed_tokens"] == computed
        assert row["generated_tokens"] == 0
        assert sample(proxy.app, "cacheproxy_decoded_prompt_tokens_total", tenant=tenant.id) == (
            computed
        )
        # the table knows the slot holds that prefix, the tenant's own text
        [held] = proxy.app[CACHE].tables[0].slots
        assert held.tenant == tenant.id
        assert held.unknown_tail == 0 and held.known == prompt[:computed]
