"""In front of a llama-server started with --api-key, with no tenants: the proxy asks clients for
the key the server itself would accept (or its own list), never opening a protected server."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from cacheproxy.settings import load_settings
from tests.support.servers import StartServer, running_proxy

SERVER_KEY = "server-key-0123456789"
PROMPT = {"prompt": [1, 2, 3, 4, 5], "n_predict": 1, "temperature": 0}


async def status(
    client: aiohttp.ClientSession, method: str, url: str, key: str | None, **kwargs: object
) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with client.request(method, url, headers=headers, **kwargs) as response:
        await response.read()
        return response.status


@pytest.mark.parametrize(
    ("api_keys", "good", "bad"),
    [
        ([], SERVER_KEY, "not-the-key"),  # the key llama-server itself accepts
        (["client-a", "client-b"], "client-b", SERVER_KEY),  # the proxy's own list
    ],
)
async def test_a_protected_server_stays_protected_behind_the_proxy(
    start_server: StartServer,
    tmp_path: Path,
    client: aiohttp.ClientSession,
    api_keys: list[str],
    good: str,
    bad: str,
) -> None:
    server = start_server(extra_args=("--api-key", SERVER_KEY))
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        upstream_api_key=SERVER_KEY,
        api_keys=api_keys,
    )
    async with running_proxy(settings) as url:
        for method, path, body in (
            ("POST", "/completion", PROMPT),
            (
                "POST",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            ),
            ("POST", "/tokenize", {"content": "hello"}),
            ("GET", "/props", None),
            ("GET", "/slots", None),
            ("GET", "/metrics", None),
        ):
            kwargs = {"json": body} if body is not None else {}
            assert await status(client, method, url + path, None, **kwargs) == 401, path
            assert await status(client, method, url + path, bad, **kwargs) == 401, path
            assert await status(client, method, url + path, good, **kwargs) != 401, path
        # as llama-server: /health needs no key
        assert await status(client, "GET", url + "/health", None) == 200


async def test_an_open_server_behind_the_proxy_needs_no_key(
    start_server: StartServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    server = start_server()
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        assert await status(client, "POST", url + "/completion", None, json=PROMPT) == 200


async def test_a_cors_preflight_is_answered_without_a_key_as_llama_server_answers_it(
    start_server: StartServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Browsers send no Authorization header with a preflight: llama-server answers OPTIONS
    before it checks any key (tools/server/server-http.cpp, the pre-routing handler), with its
    CORS headers; through the proxy the same request gets the same answer."""
    server = start_server(extra_args=("--api-key", SERVER_KEY))
    settings = load_settings(
        upstreams=[server.url], state_dir=tmp_path / "state", upstream_api_key=SERVER_KEY
    )
    cors = (
        "Access-Control-Allow-Origin",
        "Access-Control-Allow-Methods",
        "Access-Control-Allow-Headers",
        "Access-Control-Allow-Credentials",
    )
    preflight = {"Origin": "http://localhost:8080", "Access-Control-Request-Method": "POST"}
    async with running_proxy(settings) as url:
        for path in ("/v1/chat/completions", "/completion", "/props"):
            answers = []
            for base in (server.url, url):
                async with client.options(base + path, headers=preflight) as response:
                    body = await response.read()
                    answers.append(
                        (response.status, body, {name: response.headers.get(name) for name in cors})
                    )
            assert answers[0][0] == 200, answers[0]
            assert answers[1] == answers[0], path
        # the preflight opens nothing else: the request itself still needs the key
        assert await status(client, "POST", url + "/completion", None, json=PROMPT) == 401
