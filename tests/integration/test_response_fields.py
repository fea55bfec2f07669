"""`response_fields` on a real llama-server: the projection a client asks for, made by the proxy.

llama-server keeps only the fields a body's `response_fields` names in a native final answer (and
in an OpenAI answer's `__verbose`). The proxy reads the whole answer (what the task cost, what the
slot holds), so it takes the field off the request and projects the answer itself: the client
gets llama-server's projection, the meter what the task really cost, and a tenant hiding its cache
signals no path to them.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.settings import load_settings
from tests.support.servers import StartServer, serving, serving_tenants
from tests.support.sse import collect_sse

ADMIN_KEY = "admin-key-for-tests-0123456789"
PROMPT = list(range(600, 640))
# what does not depend on what the slot held before: the text, the counts, a setting, and a
# path nothing has (left out)
FIELDS = ["content", "tokens_predicted", "stop_type", "generation_settings/n_predict", "no/such"]


async def answer_of(
    client: aiohttp.ClientSession, url: str, path: str, body: dict, headers: dict | None = None
) -> tuple[int, object]:
    """The status and the JSON answer, or for a stream its events' JSON (`[DONE]` left out)."""
    async with client.post(url + path, json=body, headers=headers or {}) as response:
        if not body.get("stream"):
            return response.status, await response.json()
        events = await collect_sse(response)
    return response.status, [orjson.loads(event) for event in events if event != "[DONE]"]


def comparable(answer: object) -> object:
    """An answer without what differs per request (an OpenAI answer's id and creation time,
    and the timings of every answer that has them: milliseconds)."""
    if isinstance(answer, list):
        return [comparable(item) for item in answer]
    if not isinstance(answer, dict):
        return answer
    return {key: value for key, value in answer.items() if key not in ("id", "created", "timings")}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/completion", {"prompt": PROMPT}),
        ("/completions", {"prompt": PROMPT}),
        ("/v1/completions", {"prompt": PROMPT, "verbose": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "verbose": True},
        ),
    ],
)
async def test_the_answer_is_projected_as_llama_server_projects_it(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    path: str,
    body: dict,
    stream: bool,
) -> None:
    server = start_server(parallel=2)
    body = {**body, "n_predict": 6, "temperature": 0, "response_fields": FIELDS, "stream": stream}
    direct = await answer_of(client, server.url, path, body)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, _):
        proxied = await answer_of(client, url, path, body)
    assert direct[0] == proxied[0] == 200
    assert comparable(proxied[1]) == comparable(direct[1])
    projected = proxied[1][-1] if stream else proxied[1]
    if path in ("/completion", "/completions"):  # the native final answer itself
        assert set(projected) == set(FIELDS) - {"no/such"}
    elif not stream:  # an OpenAI answer's native part
        assert set(projected["__verbose"]) == set(FIELDS) - {"no/such"}


async def test_what_a_projection_leaves_out_is_still_charged(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """A tenant keeping only `content` of its answers is charged the tokens it generated: its
    rate of generated tokens refuses it once they are spent, and the ledger counts them."""
    server = start_server(parallel=1)
    async with serving_tenants(server.url, tmp_path, ADMIN_KEY) as (url, registry):
        tenant, key = registry.create("alice")
        registry.set_limits(tenant.id, generated_tokens_per_minute=50)
        headers = {"Authorization": f"Bearer {key}"}
        statuses = []
        for turn in range(5):
            body = {
                "prompt": [700 + turn, *PROMPT],
                "n_predict": 20,
                "ignore_eos": True,
                "response_fields": ["content"],
            }
            status, shown = await answer_of(client, url, "/completion", body, headers)
            statuses.append(status)
            if status == 200:
                assert list(shown) == ["content"]
        # 20 generated tokens each: the third takes the bucket below zero, the fourth waits
        assert statuses == [200, 200, 200, 429, 429]
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        query = {"tenant": tenant.id, "group_by": "tenant"}
        async with client.get(url + "/admin/usage", params=query, headers=admin) as response:
            [row] = (await response.json())["rows"]
        assert row["generated_tokens"] == 60
        assert row["prompt_tokens"] == 3 * (len(PROMPT) + 1)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_projection_shows_no_hidden_cache_signal(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, stream: bool
) -> None:
    """A tenant hiding its cache signals gets them as an uncached run shows them, whatever
    paths its `response_fields` name."""
    server = start_server(parallel=1)
    async with serving_tenants(server.url, tmp_path, ADMIN_KEY) as (url, registry):
        _, key = registry.create("quiet", hide_cache_signals=True)
        headers = {"Authorization": f"Bearer {key}"}
        fields = ["timings/cache_n", "timings/prompt_n", "timings/prompt_ms", "timings"]
        body = {"prompt": PROMPT, "n_predict": 2, "response_fields": fields, "stream": stream}
        await answer_of(client, url, "/completion", body, headers)
        status, shown = await answer_of(client, url, "/completion", body, headers)
        assert status == 200
        final = shown[-1] if stream else shown
        assert (final["timings/cache_n"], final["timings/prompt_n"]) == (0, len(PROMPT))
        assert (final["timings"]["cache_n"], final["timings"]["prompt_n"]) == (0, len(PROMPT))
        assert "timings/prompt_ms" not in final and "prompt_ms" not in final["timings"]
