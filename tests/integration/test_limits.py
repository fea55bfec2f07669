"""Per-tenant rate limits and token budgets through a real proxy in front of a real llama-server:
each limit reached under concurrency, answered 429 in llama-server's envelope with a `type`
naming the limit, `Retry-After` and OpenAI's `x-ratelimit-*` headers; limits and budgets that
hold across a restart of the proxy process; the `openai` SDK's RateLimitError."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from cacheproxy.http.app_keys import METER
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support import databases
from tests.support.serve_process import start_serve
from tests.support.servers import LlamaServer, serving

# runs on the database backend chosen with --database (the registry, ledger and index)
pytestmark = pytest.mark.database

ADMIN_KEY = "admin-key-for-limit-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}


@dataclass
class Limited:
    url: str
    app: web.Application
    registry: TenantRegistry
    tenant_id: str
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
async def limited(llama_server: LlamaServer, tmp_path: Path) -> AsyncIterator[Limited]:
    database = tmp_path / "state" / "cacheproxy.db"
    settings = load_settings(
        upstreams=[llama_server.url],
        state_dir=tmp_path / "state",
        tenants={"admin_api_key": ADMIN_KEY},
        usage={"flush_interval_s": 0.2},
    )
    with TenantRegistry(databases.chosen(database)) as registry:
        tenant, key = registry.create("limited")
        async with serving(settings) as (url, app):
            yield Limited(url, app, registry, tenant.id, key)


async def set_limits(client: aiohttp.ClientSession, proxy: Limited, **limits: Any) -> dict:
    async with client.patch(
        f"{proxy.url}/admin/tenants/{proxy.tenant_id}/limits", json=limits, headers=ADMIN
    ) as response:
        document = await response.json()
        assert response.status == 200, document
        return document


async def post(
    client: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]
) -> tuple[int, Any, Any]:
    async with client.post(url, json=body, headers=headers) as response:
        text = await response.text()
        try:
            document = json.loads(text)
        except json.JSONDecodeError:
            document = text
        return response.status, response.headers, document


def assert_refused(status: int, headers: Any, document: Any, limit_type: str) -> None:
    assert status == 429, document
    assert set(document) == {"error"}, document
    assert document["error"]["code"] == 429
    assert document["error"]["type"] == limit_type
    assert limit_type.replace("_", " ") in document["error"]["message"]
    assert int(headers["Retry-After"]) >= 1


async def test_requests_per_minute_under_concurrency(
    limited: Limited, client: aiohttp.ClientSession
) -> None:
    await set_limits(client, limited, requests_per_minute=5)
    answers = await asyncio.gather(
        *(post(client, limited.url + "/v1/chat/completions", CHAT, limited.auth) for _ in range(12))
    )
    ok = [answer for answer in answers if answer[0] == 200]
    refused = [answer for answer in answers if answer[0] != 200]
    assert len(ok) == 5, [answer[0] for answer in answers]
    for status, headers, document in refused:
        assert_refused(status, headers, document, "requests_per_minute")
        assert headers["x-ratelimit-remaining-requests"] == "0"
    remaining = sorted(int(headers["x-ratelimit-remaining-requests"]) for _, headers, _ in ok)
    assert remaining == [0, 1, 2, 3, 4]
    for _, headers, _ in answers:
        assert headers["x-ratelimit-limit-requests"] == "5"
        assert headers["x-ratelimit-reset-requests"].endswith("s")
    # another route shape counts against the same bucket
    status, headers, document = await post(
        client, limited.url + "/completion", {"prompt": "hi", "n_predict": 1}, limited.auth
    )
    assert_refused(status, headers, document, "requests_per_minute")


async def test_prompt_tokens_per_minute_under_concurrency(
    limited: Limited, client: aiohttp.ClientSession
) -> None:
    await set_limits(client, limited, prompt_tokens_per_minute=100)
    prompt = {"prompt": list(range(10, 50)), "n_predict": 1, "temperature": 0}  # 40 tokens
    answers = await asyncio.gather(
        *(post(client, limited.url + "/completion", prompt, limited.auth) for _ in range(5))
    )
    statuses = sorted(answer[0] for answer in answers)
    assert statuses == [200, 200, 429, 429, 429], statuses
    for status, headers, document in answers:
        assert headers["x-ratelimit-limit-tokens"] == "100"
        assert headers["x-ratelimit-limit-prompt-tokens"] == "100"
        if status == 429:
            assert_refused(status, headers, document, "prompt_tokens_per_minute")
            # 20 tokens left, 40 needed, 100 a minute come back: 12 s
            assert 11 <= int(headers["Retry-After"]) <= 13
    remaining = sorted(int(h["x-ratelimit-remaining-prompt-tokens"]) for s, h, _ in answers)
    assert remaining[0] >= 19


async def test_generated_tokens_charged_on_completion_refuse_the_next_request(
    limited: Limited, client: aiohttp.ClientSession
) -> None:
    await set_limits(client, limited, generated_tokens_per_minute=20)
    body = {"prompt": "Once", "n_predict": 16, "ignore_eos": True, "temperature": 0}
    # admitted together while the bucket is positive: each is charged when it has finished
    answers = await asyncio.gather(
        *(post(client, limited.url + "/completion", body, limited.auth) for _ in range(3))
    )
    assert [answer[0] for answer in answers] == [200, 200, 200]
    generated = sum(answer[2]["timings"]["predicted_n"] for answer in answers)
    assert generated == 48
    # the bucket is now 20 - 48 = -28: streamed or not, the next is refused
    async with client.post(
        limited.url + "/completion", json={**body, "stream": True}, headers=limited.auth
    ) as response:
        document = await response.json()
        assert_refused(response.status, response.headers, document, "generated_tokens_per_minute")
        # 28 tokens below zero, 20 a minute: 84 s (plus the one token it must reach)
        assert 84 <= int(response.headers["Retry-After"]) <= 88
        assert response.headers["x-ratelimit-remaining-generated-tokens"] == "0"


async def test_rate_headers_on_a_streamed_answer(
    limited: Limited, client: aiohttp.ClientSession
) -> None:
    await set_limits(client, limited, requests_per_minute=50, generated_tokens_per_minute=1000)
    async with client.post(
        limited.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=limited.auth
    ) as response:
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        assert response.headers["x-ratelimit-limit-requests"] == "50"
        assert response.headers["x-ratelimit-remaining-requests"] == "49"
        assert response.headers["x-ratelimit-limit-tokens"] == "1000"
        assert "x-ratelimit-reset-tokens" in response.headers
        await response.read()


async def test_daily_and_monthly_budgets(limited: Limited, client: aiohttp.ClientSession) -> None:
    body = {"prompt": list(range(10, 30)), "n_predict": 4, "ignore_eos": True, "temperature": 0}
    for limit_type in ("tokens_per_day", "tokens_per_month"):
        await set_limits(client, limited, tokens_per_day=None, tokens_per_month=None)
        status, _, document = await post(client, limited.url + "/completion", body, limited.auth)
        assert status == 200, document
        used = await tokens_used(client, limited)
        # the next request fits under the budget; the one after does not
        await set_limits(client, limited, **{limit_type: used + 10})
        answers = [
            await post(client, limited.url + "/completion", body, limited.auth) for _ in range(2)
        ]
        assert answers[0][0] == 200, answers[0]
        assert_refused(*answers[1], f"budget_{limit_type}")
        retry_after = int(answers[1][1]["Retry-After"])
        assert 1 <= retry_after <= (86400 if limit_type == "tokens_per_day" else 31 * 86400)


async def tokens_used(client: aiohttp.ClientSession, proxy: Limited) -> int:
    """Prompt plus generated tokens the ledger counted today (flushed, or not yet)."""
    async with client.get(
        f"{proxy.url}/admin/usage",
        params={"tenant": proxy.tenant_id, "group_by": "tenant"},
        headers=ADMIN,
    ) as response:
        document = await response.json()
        assert response.status == 200, document
    row = document["rows"][0]
    return row["prompt_tokens"] + row["generated_tokens"]


async def test_limits_and_budgets_survive_a_restart(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    state = tmp_path / "state"
    with TenantRegistry(databases.chosen(state / "cacheproxy.db")) as registry:
        tenant, key = registry.create("steady")
        budgeted, budget_key = registry.create("budgeted")
        registry.set_limits(tenant.id, requests_per_minute=3)
        registry.set_limits(budgeted.id, tokens_per_day=30)
    auth = {"Authorization": f"Bearer {key}"}
    budget_auth = {"Authorization": f"Bearer {budget_key}"}
    body = {"prompt": list(range(10, 30)), "n_predict": 4, "ignore_eos": True}
    flags = ("--upstream", llama_server.url)
    env = {"CACHEPROXY_USAGE__FLUSH_INTERVAL_S": "0.2"}
    served = await start_serve(tmp_path, *flags, env=env)
    try:
        for _ in range(3):
            status, _, document = await post(client, served.url + "/completion", body, auth)
            assert status == 200, document
        assert (await post(client, served.url + "/completion", body, auth))[0] == 429
        for expected in (200, 200):  # 24 tokens, then 48 (the budget is checked before)
            status, _, document = await post(client, served.url + "/completion", body, budget_auth)
            assert status == expected, document
        assert (await post(client, served.url + "/completion", body, budget_auth))[0] == 429
        served.process.send_signal(signal.SIGTERM)
        assert await served.process.wait() == 0
    finally:
        await served.stop()
    served = await start_serve(tmp_path, *flags, env=env)
    try:
        status, headers, document = await post(client, served.url + "/completion", body, auth)
        assert_refused(status, headers, document, "requests_per_minute")
        status, headers, document = await post(
            client, served.url + "/completion", body, budget_auth
        )
        assert_refused(status, headers, document, "budget_tokens_per_day")
    finally:
        await served.stop()


async def test_openai_sdk_raises_rate_limit_error_and_honours_the_retry_hint(
    limited: Limited, client: aiohttp.ClientSession
) -> None:
    # 600 a minute: 10 tokens a second come back; 40 over, and one token to spend, is a hint of
    # at most 4.1 s (less as time passes before the next request: a loaded machine has 3 s)
    await set_limits(client, limited, generated_tokens_per_minute=600)
    # the client built, and its resources loaded, before the tokens are charged
    sdk = openai.AsyncOpenAI(base_url=limited.url + "/v1", api_key=limited.key, max_retries=0)
    assert sdk.chat.completions is not None
    body = {"prompt": "Once", "n_predict": 640, "ignore_eos": True, "temperature": 0}
    status, _, document = await post(client, limited.url + "/completion", body, limited.auth)
    assert status == 200 and document["timings"]["predicted_n"] == 640, document
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            await sdk.chat.completions.create(model="any", messages=CHAT["messages"], max_tokens=1)
        error = refused.value
        assert error.status_code == 429
        assert isinstance(error.body, dict)
        assert error.body["type"] == "generated_tokens_per_minute"
        assert "generated tokens per minute" in error.message
        assert error.body["message"] in error.message  # the proxy's own words
        assert 1 <= int(error.response.headers["retry-after"]) <= 5
        assert 1000 <= int(error.response.headers["retry-after-ms"]) <= 4100
        # with retries, the SDK waits as the proxy says and then gets its answer
        started = time.monotonic()
        answer = await sdk.with_options(max_retries=3).chat.completions.create(
            model="any", messages=CHAT["messages"], max_tokens=1
        )
        assert answer.choices[0].message is not None
        assert time.monotonic() - started >= 0.5
        # it was refused first, then retried: two refusals in the ledger, both errors
        row = await ledger_row(client, limited)
        assert (row["requests"], row["errors"]) == (4, 2)
    finally:
        await sdk.close()


async def test_limits_and_usage_through_the_admin_api(
    limited: Limited, client: aiohttp.ClientSession
) -> None:
    base = f"{limited.url}/admin/tenants/{limited.tenant_id}/limits"
    async with client.get(base, headers=ADMIN) as response:
        document = await response.json()
        assert response.status == 200
        assert document["limits"] == dict.fromkeys(document["limits"])  # all unset
    changed = await set_limits(client, limited, tokens_per_month=10**6, requests_per_minute=9)
    assert changed["limits"]["tokens_per_month"] == 10**6
    assert changed["effective"]["requests_per_minute"] == 9
    limited.registry.refresh()  # the test's own connection: read what the proxy committed
    assert limited.registry.limits(limited.tenant_id).requests_per_minute == 9  # in the file
    cleared = await set_limits(client, limited, requests_per_minute=None)
    assert cleared["limits"]["requests_per_minute"] is None
    assert cleared["limits"]["tokens_per_month"] == 10**6
    for body, status in (
        ({}, 400),
        ({"requests_per_minute": -1}, 400),
        ({"requests_per_minute": "5"}, 400),
        ({"weight": 2}, 400),
    ):
        async with client.patch(base, json=body, headers=ADMIN) as response:
            assert response.status == status, body
            assert (await response.json())["error"]["code"] == status
    unknown = f"{limited.url}/admin/tenants/t_0000000000000000/limits"
    async with client.patch(unknown, json={"tokens_per_day": 1}, headers=ADMIN) as response:
        assert response.status == 404
    async with client.get(unknown, headers=ADMIN) as response:
        assert response.status == 404
    # the ledger: the admin key only, and its parameters checked
    async with client.get(limited.url + "/admin/usage", headers=limited.auth) as response:
        assert response.status == 401
    for query, status in (
        ({"group_by": "week"}, 400),
        ({"from": "yesterday"}, 400),
        ({"from": "2026-01-01", "to": "2026-01-02T00:00:00Z", "group_by": "day"}, 200),
    ):
        async with client.get(
            limited.url + "/admin/usage", params=query, headers=ADMIN
        ) as response:
            document = await response.json()
            assert response.status == status, document
    assert document["rows"] == [] and document["group_by"] == "day"


async def test_a_stream_the_client_leaves_is_charged_what_it_was_sent(
    limited: Limited, client: aiohttp.ClientSession
) -> None:
    """No way around the generated-token limit by leaving before the end: the tokens streamed
    are charged (and counted in the ledger) all the same."""
    await set_limits(client, limited, generated_tokens_per_minute=100_000)
    body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with client.post(
        limited.url + "/v1/chat/completions", json=body, headers=limited.auth
    ) as response:
        assert response.status == 200
        chunks = 0
        async for line in response.content:
            if line.startswith(b"data: ") and b'"content":"' in line:
                chunks += 1
            if chunks >= 40:
                break
        response.close()  # gone before the end
    await asyncio.sleep(1.0)
    generated = (await ledger_row(client, limited))["generated_tokens"]
    assert 40 <= generated < 3000
    # charged as it was counted (nothing has read the bucket since, so it has not refilled)
    bucket = limited.app[METER].buckets[limited.tenant_id]["generated_tokens_per_minute"]
    assert bucket.level == 100_000 - generated


async def ledger_row(client: aiohttp.ClientSession, proxy: Limited) -> dict[str, Any]:
    async with client.get(
        f"{proxy.url}/admin/usage",
        params={"tenant": proxy.tenant_id, "group_by": "tenant"},
        headers=ADMIN,
    ) as response:
        document = await response.json()
        assert response.status == 200, document
    return document["rows"][0]
