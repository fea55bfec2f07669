"""Tasks the proxy does not pin to a slot are charged what the server computed when their client
leaves early: on llama-server's default topology, where the server picks each task's slot
itself, and on a whole upstream (a request the proxy cannot pin). Each is charged in the
budget, the ledger and the metrics, on the native, chat and messages routes, streamed or not.

Real processes: a llama-server started with no flag but the model (4 slots, a unified KV cache,
batches of 2,048 tokens, its RAM cache on: served to a single user, whose day's budget is the
default limit), the proxy in this process on a real socket, clients that close their connection
as soon as the server runs their request."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import Settings, load_settings
from cacheproxy.tenancy.registry import DEFAULT_TENANT
from tests.support.charges import (
    last_task_slot,
    leave_once_running,
    ledger_row,
    prompt_tokens,
    wait_until_let_go,
)
from tests.support.fair_share import ADMIN_KEY
from tests.support.metrics import sample
from tests.support.servers import LlamaServer, StartServer, serving
from tests.support.waiting import wait_for as until

PROMPT_TOKENS = 12000  # several of the server's batches: it stops part-way once it sees the cut
# a day's tokens: the warm-up's (below) leave most of it, a batch of the server's (512 tokens at
# the least here) uses the rest up; a charge of nothing would not
BUDGET = 1000
# a first request measures the server's prompt rate, which bounds how long a cut task's slot is
# waited for (an unmeasured server is taken for a fast one); it leaves the budget unspent
WARM_UP = {"prompt": list(range(300, 800)), "n_predict": 1}
WARM_UP_TOKENS = len(WARM_UP["prompt"]) + 1

_rng = random.Random(3535)


def ids(n: int) -> list[int]:
    return [_rng.randrange(300, 31000) for _ in range(n)]


def words(n: int) -> str:
    return " ".join(f"w{_rng.randrange(100000)}" for _ in range(n))


def completion_body() -> dict[str, Any]:
    return {"prompt": ids(PROMPT_TOKENS), "n_predict": 4}


def chat_body() -> dict[str, Any]:
    content = words(PROMPT_TOKENS // 6)  # about 6 tokens a word once templated
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


def messages_body() -> dict[str, Any]:
    return {**chat_body(), "model": "any"}


# route, a fresh body, and where the server counts that body's prompt tokens
ROUTES: dict[str, tuple[str, Callable[[], dict[str, Any]], str | None]] = {
    "completion": ("/completion", completion_body, None),
    "chat": ("/v1/chat/completions", chat_body, "/v1/chat/completions/input_tokens"),
    "messages": ("/v1/messages", messages_body, "/v1/messages/count_tokens"),
}


USER = DEFAULT_TENANT.id


def budgeted(server: LlamaServer, workdir: Path) -> Settings:
    """The proxy's settings: no tenants, and a day's budget for the single user."""
    return load_settings(
        upstreams=[server.url],
        state_dir=workdir / "state",
        tenants={"database": workdir / "tenants.db", "admin_api_key": ADMIN_KEY},
        limits={"tokens_per_day": BUDGET},
    )


def busy_slots(app: web.Application) -> int:
    return sum(slot.busy for slot in app[CACHE].tables[0].slots)


async def assert_charged(
    client: aiohttp.ClientSession, url: str, app: web.Application, computed: int
) -> None:
    """`computed` prompt tokens charged in the ledger, the metrics and the budget, besides
    the warm-up's."""
    row = await ledger_row(client, url, USER)
    warm_prompt = WARM_UP_TOKENS - 1
    assert row["prompt_tokens"] == row["computed_tokens"] == warm_prompt + computed
    assert row["generated_tokens"] == 1  # the warm-up's
    prompt = sample(app, "cacheproxy_prompt_tokens_total", tenant=USER)
    decoded = sample(app, "cacheproxy_decoded_prompt_tokens_total", tenant=USER)
    assert prompt == decoded == warm_prompt + computed
    # the day's budget is used up: the next request is refused
    body = {"prompt": "Hello", "n_predict": 1}
    async with client.post(url + "/completion", json=body) as response:
        assert response.status == 429, await response.text()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ROUTES)
async def test_a_client_gone_before_the_server_picked_slot_computed_its_prompt_is_charged_it(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    route: str,
    stream: bool,
) -> None:
    """The server picks the slot (the proxy sends no `id_slot`); the client leaves as the
    server starts the prompt. The server sees the closed connection a second later and stops
    after the batch it computes: the tenant is charged what the slot then holds, the server's
    own count, found on the one slot that ran while the task was the only one under way."""
    path, body_of, counter = ROUTES[route]
    server = start_server(bare=True)
    body = {**body_of(), "stream": stream}
    length = await prompt_tokens(client, server, counter, body)
    async with serving(budgeted(server, tmp_path)) as (url, app):
        table = app[CACHE].tables[0]
        assert table.server_picks
        async with client.post(url + "/completion", json=WARM_UP) as response:
            assert response.status == 200, await response.text()
        await leave_once_running(client, server, url + path, body, None)
        await until(lambda: busy_slots(app) == 0, "the cut task to be settled", within_s=120)
        ran = last_task_slot(await wait_until_let_go(client, server))
        computed = ran["n_prompt_tokens"]
        assert 0 < computed < length  # the server stopped part-way
        await assert_charged(client, url, app, computed)
        # the table follows the server's pick: that slot holds the prompt's first tokens
        held = table.slots[ran["id"]]
        assert held.tenant == USER and held.n_tokens == computed


# requests the proxy cannot pin to one slot, which a whole upstream serves: a native prompt
# given as an object, a chat asking for a fractional number of answers (llama-server reads
# both as one prompt and one completion); /v1/messages has neither (its converted chat body is
# always pinned). Route, a fresh body, and how the server counts its prompt.
WHOLE_ROUTES: dict[str, tuple[str, Callable[[], dict[str, Any]], str]] = {
    "completion": (
        "/completion",
        lambda: {"prompt": {"prompt_string": words(PROMPT_TOKENS // 6)}, "n_predict": 4},
        "/tokenize",
    ),
    "chat": (
        "/v1/chat/completions",
        lambda: {**chat_body(), "n": 1.5},
        "/v1/chat/completions/input_tokens",
    ),
}
ONE_THREAD = ("--threads", "1", "--threads-batch", "1", "--batch-size", "512")


async def whole_prompt_tokens(
    client: aiohttp.ClientSession, server: LlamaServer, counter: str, body: dict
) -> int:
    if counter != "/tokenize":
        return await prompt_tokens(client, server, counter, body)
    text = body["prompt"]["prompt_string"]
    async with client.post(server.url + counter, json={"content": text}) as response:
        return len((await response.json())["tokens"]) + 1  # and its BOS


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", WHOLE_ROUTES)
async def test_a_client_gone_before_its_whole_upstream_request_computed_is_charged_it(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    route: str,
    stream: bool,
) -> None:
    """The request holds its upstream whole; its client leaves as the server starts the
    prompt, and the server stops part-way. It is charged the tokens the slot it ran on then
    holds, the server's own count (no other task ran there: the upstream was the request's)."""
    path, body_of, counter = WHOLE_ROUTES[route]
    server = start_server(parallel=2, ctx_size=32768, extra_args=ONE_THREAD)
    body = {**body_of(), "stream": stream}
    length = await whole_prompt_tokens(client, server, counter, body)
    async with serving(budgeted(server, tmp_path)) as (url, app):
        async with client.post(url + "/completion", json=WARM_UP) as response:
            assert response.status == 200, await response.text()
        await leave_once_running(client, server, url + path, body, None)
        await until(lambda: busy_slots(app) == 0, "the cut request to be settled", within_s=120)
        assert (
            sample(app, "cacheproxy_requests_total", tenant=USER, placement="whole_upstream") == 1
        )
        ran = last_task_slot(await wait_until_let_go(client, server))
        computed = ran["n_prompt_tokens"]
        assert 0 < computed < length  # the server stopped part-way
        await assert_charged(client, url, app, computed)
