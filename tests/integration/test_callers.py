"""Who a request acts for is resolved once per request, whatever its route: the registry is
asked once whether tenants exist, a tenant's key is looked up once, and nothing after (the
request path, the forward, the slot and metrics rules) asks again."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.http.app_keys import CALLERS, REGISTRY
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.servers import StartServer, serving

ADMIN_KEY = "admin-key-0123456789"
SINGLE_USER_KEY = "single-user-key"
CHAT = [{"role": "user", "content": "Say hello."}]
PREFLIGHT = {"Origin": "http://localhost:8080", "Access-Control-Request-Method": "POST"}


# (name, method, path, JSON body, which key it presents: "key" the client's, "admin", or None,
#  the status expected with no tenants, the status expected with tenants; None: any but 401)
REQUESTS: list[tuple[str, str, str, dict | None, str | None, int | None, int | None]] = [
    ("single", "POST", "/completion", {"prompt": "Hello", "n_predict": 1}, "key", 200, 200),
    ("batch", "POST", "/completion", {"prompt": ["a b", "c d"], "n_predict": 1}, "key", 200, 200),
    ("n > 1", "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "n": 2}, "key",
     200, 200),
    ("agent API", "POST", "/v1/messages",
     {"model": "any", "messages": CHAT, "max_tokens": 1}, "key", 200, 200),
    ("opaque", "POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 1},
     "key", None, None),
    ("whole upstream", "POST", "/embedding", {"content": "Hello"}, "key", None, None),
    ("pass-through", "POST", "/tokenize", {"content": "Hello"}, "key", 200, 200),
    ("pass-through GET", "GET", "/props", None, "key", 200, 200),
    ("slots", "GET", "/slots", None, "key", 200, 403),
    ("slot action", "POST", "/slots/0?action=erase", None, "key", 200, 403),
    ("metrics", "GET", "/metrics", None, "admin", 200, 200),
    ("health", "GET", "/health", None, None, 200, 200),
    ("CORS preflight", "OPTIONS", "/completion", None, None, 200, 200),
]  # fmt: skip


def count_calls(
    monkeypatch: pytest.MonkeyPatch, owner: Any, names: tuple[str, ...], counts: Counter[str]
) -> None:
    """Count the calls of `owner`'s methods `names` (each still does what it did)."""
    for name in names:
        real: Callable[..., Any] = getattr(owner, name)

        def counted(*args: Any, _real: Callable[..., Any] = real, _name: str = name) -> Any:
            counts[_name] += 1
            return _real(*args)

        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("tenants", [False, True], ids=["single user", "tenants"])
async def test_each_request_resolves_its_caller_exactly_once(
    start_server: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tenants: bool
) -> None:
    server = start_server(parallel=2)
    database = tmp_path / "tenants.db"
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        tenants={"database": database, "admin_api_key": ADMIN_KEY},
        api_keys=[SINGLE_USER_KEY],  # asked for while there are no tenants
        disk={"enabled": False},
    )
    with TenantRegistry(database) as registry:
        key = registry.create("acme")[1] if tenants else SINGLE_USER_KEY
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
            counts: Counter[str] = Counter()
            count_calls(monkeypatch, app[REGISTRY], ("has_tenants", "authenticate"), counts)
            resolutions = ("resolve", "resolve_open", "resolve_operator")
            count_calls(monkeypatch, app[CALLERS], resolutions, counts)
            for name, method, path, body, presents, single_status, tenants_status in REQUESTS:
                counts.clear()
                headers = dict(PREFLIGHT) if method == "OPTIONS" else {}
                if presents is not None:
                    shown = ADMIN_KEY if presents == "admin" and tenants else key
                    headers["Authorization"] = f"Bearer {shown}"
                async with client.request(
                    method, url + path, json=body, headers=headers
                ) as response:
                    await response.read()
                    status = response.status
                expected = tenants_status if tenants else single_status
                assert status == expected if expected is not None else status != 401, name
                assert sum(counts[how] for how in resolutions) == 1, (name, counts)
                assert counts["has_tenants"] == 1, (name, counts)
                looked_up = tenants and presents == "key"
                assert counts["authenticate"] == (1 if looked_up else 0), (name, counts)
