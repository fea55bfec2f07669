"""The admin API through a real proxy in front of a real llama-server: routes, refusals, fuzz."""

from __future__ import annotations

import json
import random
import string
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from cacheproxy.http.app import create_app
from cacheproxy.http.app_keys import REGISTRY, USAGE
from cacheproxy.settings import Settings, load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support import databases
from tests.support.local_app import served
from tests.support.servers import LlamaServer, serving

# runs on the database backend chosen with --database (the registry, ledger and index)
pytestmark = pytest.mark.database

ADMIN_KEY = "admin-key-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
TENANT_FIELDS = {
    "id",
    "name",
    "disabled",
    "hide_cache_signals",
    "may_use_public_prefixes",
    "quota_bytes",
    "quota_archives",
    "weight",
    "max_queued",
    "max_concurrent",
    "max_priority",
    "models",
    "key_prefix",
}


def admin_settings(llama_server: LlamaServer, tmp_path: Path, **tenants: Any) -> Settings:
    return load_settings(
        upstreams=[llama_server.url],
        state_dir=tmp_path / "state",
        tenants={"admin_api_key": ADMIN_KEY, **tenants},
    )


@pytest.fixture
async def admin(
    llama_server: LlamaServer, tmp_path: Path
) -> AsyncIterator[tuple[str, web.Application]]:
    async with serving(admin_settings(llama_server, tmp_path)) as served:
        yield served


async def call(
    client: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = AUTH,
) -> tuple[int, Any]:
    data = json.dumps(body) if body is not None else None
    async with client.request(method, url, data=data, headers=headers) as response:
        text = await response.text()
        return response.status, json.loads(text) if text else None


def assert_envelope(document: Any, status: int, error_type: str | None = None) -> None:
    assert set(document) == {"error"}, document
    assert document["error"]["code"] == status
    assert isinstance(document["error"]["message"], str) and document["error"]["message"]
    if error_type is not None:
        assert document["error"]["type"] == error_type


async def test_tenant_routes(
    admin: tuple[str, web.Application], client: aiohttp.ClientSession
) -> None:
    url, app = admin
    registry = app[REGISTRY]

    async with client.post(
        f"{url}/admin/tenants", json={"name": "acme", "quota_bytes": 1000}, headers=AUTH
    ) as response:
        assert response.status == 201
        assert response.headers["Cache-Control"] == "no-store"  # it carries a key
        created = await response.json()
    tenant = created["tenant"]
    assert response.headers["Location"] == f"/admin/tenants/{tenant['id']}"
    assert set(tenant) == TENANT_FIELDS
    assert (tenant["name"], tenant["quota_bytes"], tenant["quota_archives"]) == ("acme", 1000, None)
    assert created["api_key"].startswith(tenant["key_prefix"])
    assert registry.authenticate(created["api_key"]).id == tenant["id"]
    tenant_url = f"{url}/admin/tenants/{tenant['id']}"

    status, listed = await call(client, "GET", f"{url}/admin/tenants")
    assert (status, listed) == (200, {"tenants": [tenant]})

    status, fetched = await call(client, "GET", tenant_url)
    assert status == 200
    assert {k: fetched[k] for k in TENANT_FIELDS} == tenant
    assert [key["revoked_at"] for key in fetched["keys"]] == [None]

    status, patched = await call(
        client,
        "PATCH",
        tenant_url,
        {"disabled": True, "quota_bytes": None, "quota_archives": 3, "hide_cache_signals": True},
    )
    assert status == 200
    assert patched == {
        **tenant,
        "disabled": True,
        "quota_bytes": None,
        "quota_archives": 3,
        "hide_cache_signals": True,
    }
    assert registry.authenticate(created["api_key"]) is None
    status, patched = await call(
        client, "PATCH", tenant_url, {"disabled": False, "may_use_public_prefixes": False}
    )
    assert (status, patched["disabled"], patched["may_use_public_prefixes"]) == (200, False, False)

    status, rotated = await call(client, "POST", f"{tenant_url}/rotate-key")
    assert status == 200
    assert registry.authenticate(created["api_key"]) is None
    assert registry.authenticate(rotated["api_key"]).id == tenant["id"]
    assert rotated["tenant"]["key_prefix"] == rotated["api_key"][:12]
    status, _ = await call(client, "POST", f"{tenant_url}/rotate-key", {})
    assert status == 200

    status, usage = await call(client, "GET", f"{tenant_url}/usage")
    no_traffic = {
        "requests": 0,
        "prompt_tokens": 0,
        "reused_tokens": 0,
        "decoded_tokens": 0,
        "reuse_ratio": 0.0,
    }
    assert (status, usage) == (200, {"tenant_id": tenant["id"], "usage": no_traffic})
    status, usage = await call(client, "GET", f"{url}/admin/tenants/default/usage")
    assert (status, usage) == (200, {"tenant_id": "default", "usage": no_traffic})


async def test_public_prefix_routes(
    admin: tuple[str, web.Application], client: aiohttp.ClientSession
) -> None:
    url, _ = admin
    status, prefix = await call(
        client, "POST", f"{url}/admin/public-prefixes", {"name": "system", "tokens": [1, 2, 3]}
    )
    assert status == 201
    assert (prefix["name"], prefix["tokens"], prefix["n_tokens"]) == ("system", [1, 2, 3], 3)
    status, listed = await call(client, "GET", f"{url}/admin/public-prefixes")
    assert (status, listed) == (
        200,
        {"public_prefixes": [{"id": prefix["id"], "name": "system", "n_tokens": 3}]},
    )
    status, fetched = await call(client, "GET", f"{url}/admin/public-prefixes/{prefix['id']}")
    assert (status, fetched) == (200, prefix)

    status, duplicate = await call(
        client, "POST", f"{url}/admin/public-prefixes", {"name": "SYSTEM", "tokens": [4]}
    )
    assert status == 409
    assert_envelope(duplicate, 409)
    for tokens in ([], [-1], ["1"], [1.0], [True], 5):
        status, refused = await call(
            client, "POST", f"{url}/admin/public-prefixes", {"name": "bad", "tokens": tokens}
        )
        assert status == 400, tokens
        assert_envelope(refused, 400, "invalid_request_error")

    async with client.delete(f"{url}/admin/public-prefixes/{prefix['id']}", headers=AUTH) as gone:
        assert gone.status == 204
    status, missing = await call(client, "DELETE", f"{url}/admin/public-prefixes/{prefix['id']}")
    assert status == 404
    assert_envelope(missing, 404, "not_found_error")


WRONG_ADMIN_HEADERS: list[dict[str, str]] = [
    {},
    {"Authorization": "Bearer wrong-key-wrong-key-wrong"},
    {"X-Api-Key": "wrong"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Basic {ADMIN_KEY}"},
    {"Authorization": f"Bearer {ADMIN_KEY}x"},
    {"Authorization": f"Bearer {ADMIN_KEY[:-1]}"},
]


async def test_missing_or_wrong_admin_key_is_401(
    admin: tuple[str, web.Application], client: aiohttp.ClientSession
) -> None:
    url, app = admin
    for headers in WRONG_ADMIN_HEADERS:
        for method, path in (
            ("GET", "/admin/tenants"),
            ("POST", "/admin/tenants"),
            ("PATCH", "/admin/tenants/t_0000000000000000"),
            ("GET", "/admin/no-such-route"),  # unknown admin paths too: nothing to probe
            ("PUT", "/admin/tenants"),
        ):
            status, document = await call(client, method, url + path, {"name": "x"}, headers)
            assert status == 401, (headers, method, path)
            assert_envelope(document, 401, "authentication_error")
            assert document["error"]["message"] == "Invalid API Key"
    assert not app[REGISTRY].has_tenants()


async def test_admin_key_in_any_of_llama_server_s_places(
    admin: tuple[str, web.Application], client: aiohttp.ClientSession
) -> None:
    url, _ = admin
    for headers in ({"X-Api-Key": ADMIN_KEY}, {"Authorization": ADMIN_KEY}, AUTH):
        status, _ = await call(client, "GET", f"{url}/admin/tenants", headers=headers)
        assert status == 200, headers


async def test_a_tenant_is_limited_to_some_models_and_freed_again(
    admin: tuple[str, web.Application], client: aiohttp.ClientSession
) -> None:
    url, app = admin
    body = {"name": "acme", "models": ["alpha", "org/beta:Q4_K_M"]}
    status, created = await call(client, "POST", f"{url}/admin/tenants", body)
    assert status == 201
    assert created["tenant"]["models"] == ["alpha", "org/beta:Q4_K_M"]
    tenant_url = f"{url}/admin/tenants/{created['tenant']['id']}"
    status, patched = await call(client, "PATCH", tenant_url, {"models": ["gamma"]})
    assert (status, patched["models"]) == (200, ["gamma"])
    status, patched = await call(client, "PATCH", tenant_url, {"disabled": False})
    assert (status, patched["models"]) == (200, ["gamma"])  # kept when not named
    status, patched = await call(client, "PATCH", tenant_url, {"models": None})
    assert (status, patched["models"]) == (200, None)  # any model again
    for bad in ("alpha", [""], [1], ["m" * 1000]):
        status, refused = await call(client, "PATCH", tenant_url, {"models": bad})
        assert status == 400, bad
        assert_envelope(refused, 400)
    assert app[REGISTRY].get(created["tenant"]["id"]).models is None


async def test_refusals_map_to_4xx(
    admin: tuple[str, web.Application], client: aiohttp.ClientSession
) -> None:
    url, app = admin
    status, created = await call(client, "POST", f"{url}/admin/tenants", {"name": "acme"})
    assert status == 201
    tenant_url = f"{url}/admin/tenants/{created['tenant']['id']}"
    before = app[REGISTRY].list()

    refusals: list[tuple[str, str, Any, int]] = [
        ("GET", f"{url}/admin/tenants/t_0000000000000000", None, 404),
        ("PATCH", f"{url}/admin/tenants/nope", {"disabled": True}, 404),
        ("POST", f"{url}/admin/tenants/nope/rotate-key", None, 404),
        ("GET", f"{url}/admin/tenants/nope/usage", None, 404),
        ("GET", f"{url}/admin/nothing-here", None, 404),
        ("POST", f"{url}/admin/tenants", {"name": "acme"}, 409),
        ("POST", f"{url}/admin/tenants", {"name": "Acme"}, 409),
        ("POST", f"{url}/admin/tenants", {"name": "bad name"}, 400),
        ("POST", f"{url}/admin/tenants", {"name": ""}, 400),
        ("POST", f"{url}/admin/tenants", {}, 400),
        ("POST", f"{url}/admin/tenants", {"name": "x", "quota_bytes": -1}, 400),
        ("POST", f"{url}/admin/tenants", {"name": "x", "quota_bytes": "10"}, 400),
        ("POST", f"{url}/admin/tenants", {"name": "x", "quota_bytes": 1.5}, 400),
        ("POST", f"{url}/admin/tenants", {"name": "x", "quota_archives": True}, 400),
        ("POST", f"{url}/admin/tenants", {"name": "x", "quota_bytes": 1 << 64}, 400),
        ("POST", f"{url}/admin/tenants", {"name": "x", "admin": True}, 400),
        ("POST", f"{url}/admin/tenants", ["name", "x"], 400),
        ("POST", f"{url}/admin/tenants", "x", 400),
        ("PATCH", tenant_url, {}, 400),
        ("PATCH", tenant_url, {"name": None}, 400),
        ("PATCH", tenant_url, {"disabled": None}, 400),
        ("PATCH", tenant_url, {"disabled": 1}, 400),
        ("PATCH", tenant_url, {"id": "t_1"}, 400),
        ("POST", f"{tenant_url}/rotate-key", {"now": True}, 400),
        ("DELETE", tenant_url, None, 405),
        ("PUT", f"{url}/admin/tenants", {"name": "x"}, 405),
    ]
    for method, target, body, expected in refusals:
        status, document = await call(client, method, target, body)
        assert status == expected, (method, target, body, document)
        assert_envelope(document, expected)

    for raw in (b"{", b"\xff\xfe", b'{"name": "x",}', b"NaN"):
        async with client.post(f"{url}/admin/tenants", data=raw, headers=AUTH) as response:
            assert response.status == 400, raw
            assert_envelope(await response.json(), 400)
    async with client.post(f"{url}/admin/tenants", data=b" " * (5 << 20), headers=AUTH) as response:
        assert response.status == 413
        assert_envelope(await response.json(), 413)
    assert app[REGISTRY].list() == before


async def test_admin_api_off_without_a_key(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    settings = load_settings(upstreams=[llama_server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, _):
        for headers in (None, AUTH):
            status, document = await call(client, "GET", f"{url}/admin/tenants", headers=headers)
            assert status == 403
            assert_envelope(document, 403, "permission_error")
        async with client.get(f"{url}/health") as response:
            assert response.status == 200


async def test_usage_comes_from_the_installed_provider(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    app = create_app(admin_settings(llama_server, tmp_path))
    app[USAGE] = lambda tenant_id: {"asked_for": tenant_id, "reused_tokens": 42}
    async with served(app) as url:
        status, created = await call(client, "POST", f"{url}/admin/tenants", {"name": "acme"})
        tenant_id = created["tenant"]["id"]
        status, usage = await call(client, "GET", f"{url}/admin/tenants/{tenant_id}/usage")
        assert (status, usage["usage"]) == (200, {"asked_for": tenant_id, "reused_tokens": 42})


async def test_a_change_by_another_process_is_seen(
    admin: tuple[str, web.Application], client: aiohttp.ClientSession
) -> None:
    url, app = admin
    with TenantRegistry(app[REGISTRY].target) as other_process:
        tenant, _ = other_process.create("from-the-cli")
    status, listed = await call(client, "GET", f"{url}/admin/tenants")
    assert status == 200
    assert [t["id"] for t in listed["tenants"]] == [tenant.id]


# -- fuzz ----------------------------------------------------------------------------------

FUZZ_CALLS = 1000
FIELDS = (
    "name",
    "disabled",
    "hide_cache_signals",
    "may_use_public_prefixes",
    "quota_bytes",
    "quota_archives",
    "tokens",
)


class Fuzzer:
    """Seeded malformed admin calls: each is wrong in at least one way, so none may change state."""

    def __init__(self, seed: int, tenant_ids: list[str], prefix_ids: list[str]) -> None:
        self.rng = random.Random(seed)
        self.tenant_ids = tenant_ids
        self.prefix_ids = prefix_ids

    def text(self, longest: int = 40) -> str:
        alphabet = string.printable + "éü中\u202e\x00\ud7ff"
        return "".join(self.rng.choice(alphabet) for _ in range(self.rng.randint(0, longest)))

    def json_value(self, depth: int = 0) -> Any:
        kind = self.rng.choice(
            ["null", "bool", "int", "bigint", "float", "str", "longstr", "list", "biglist", "dict"]
        )
        if depth > 3 and kind in ("list", "dict"):
            kind = "int"
        match kind:
            case "null":
                return None
            case "bool":
                return self.rng.random() < 0.5
            case "int":
                return self.rng.randint(-(1 << 40), 1 << 40)
            case "bigint":
                return self.rng.choice([1 << 63, -(1 << 63) - 1, 1 << 200])
            case "float":
                return self.rng.choice([0.5, -1e308, 1e-300, 3.0])
            case "str":
                return self.text()
            case "longstr":
                return "x" * self.rng.randint(65, 100_000)
            case "list":
                return [self.json_value(depth + 1) for _ in range(self.rng.randint(0, 5))]
            case "biglist":
                return [self.rng.randrange(1 << 31) for _ in range(self.rng.randint(1000, 50_000))]
        return {self.text(12): self.json_value(depth + 1) for _ in range(self.rng.randint(0, 5))}

    def wrong_value(self, field: str) -> Any:
        """A value `field` can never take."""
        if field == "name":
            return self.rng.choice(["", "x" * 65, "a b", "ü", 5, None, ["a"], {"a": 1}])
        if field in ("quota_bytes", "quota_archives"):
            return self.rng.choice([-1, -(1 << 70), 1 << 64, 1.5, "10", True, [], {}])
        if field == "tokens":
            return self.rng.choice([[], [-1], [1.5], ["1"], [True], [1 << 31], "1,2", None])
        return self.rng.choice([0, 1, "true", None, [], {}, 0.0])  # the flags

    def valid_body(self, route: str) -> dict[str, Any]:
        if route == "create":
            return {"name": f"t{self.rng.randrange(10**9)}", "quota_bytes": 5}
        if route == "patch":
            return {"quota_archives": self.rng.randrange(100)}
        if route == "prefix":
            return {"name": f"p{self.rng.randrange(10**9)}", "tokens": [1, 2]}
        return {}

    def header_text(self) -> str:
        return "".join(
            self.rng.choice(string.ascii_letters + string.digits + "-_.~+/=")
            for _ in range(self.rng.randint(0, 60))
        )

    def call(self) -> tuple[str, str, bytes | None, dict[str, str], str]:
        """method, path, body, headers, and what is wrong with it."""
        rng = self.rng
        tenant = rng.choice(self.tenant_ids)
        routes = {  # name: (method, path, the methods that path answers)
            "create": ("POST", "/admin/tenants", {"POST", "GET"}),
            "patch": ("PATCH", f"/admin/tenants/{tenant}", {"PATCH", "GET"}),
            "rotate": ("POST", f"/admin/tenants/{tenant}/rotate-key", {"POST"}),
            "prefix": ("POST", "/admin/public-prefixes", {"POST", "GET"}),
            "delete": (
                "DELETE",
                f"/admin/public-prefixes/{rng.choice(self.prefix_ids)}",
                {"DELETE", "GET"},
            ),
            "list": ("GET", "/admin/tenants", {"GET", "POST"}),
        }
        route = rng.choice(list(routes))
        method, path, answered = routes[route]
        body: Any = self.valid_body(route)
        headers = dict(AUTH)
        flaw = rng.choice(["auth", "method", "path", "field", "extra", "document", "bytes"])
        if flaw == "auth":
            headers = rng.choice(
                [
                    {},
                    {"Authorization": "Bearer " + self.header_text()},
                    {"X-Api-Key": ADMIN_KEY[:-1]},
                    {"Authorization": "Bearer"},
                    {"Authorization": f"Token {ADMIN_KEY}"},
                ]
            )
        elif flaw == "method":
            others = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "FROB"]
            method = rng.choice([m for m in others if m not in answered])
        elif flaw == "path":
            junk = quote(self.text(rng.choice([10, 100, 300])), safe="") or "x"
            path = rng.choice(
                [
                    f"/admin/{junk}",
                    f"/admin/tenants/{junk}/{junk}",
                    f"/admin/tenants/t_{junk}/rotate-key",
                    f"/admin/tenants/t_{junk}",
                    f"/admin/public-prefixes/{junk}/x",
                    f"/admin/tenants/{tenant}/{junk}",
                ]
            )
        elif flaw == "field":
            field = rng.choice([f for f in FIELDS if f != "tokens" or route == "prefix"])
            body = {**self.valid_body(route), field: self.wrong_value(field)}
        elif flaw == "extra":
            body = {**self.valid_body(route), "_" + self.text(20): self.json_value()}
        elif flaw == "document":
            value = self.json_value()
            body = [value] if isinstance(value, dict) else value
        if route in ("list", "delete") and flaw in ("field", "extra", "document", "bytes"):
            # these routes read no body: make the call wrong where they look
            path = f"/admin/tenants/t_{quote(self.text(8), safe='')}/nothing"
        if flaw == "bytes":  # no JSON at all, now and then past the size limit
            size = rng.choice([1, 100, 10_000, 10_000, 10_000, 5 << 20])
            chunk = bytes(rng.getrandbits(8) for _ in range(2000))
            return method, path, (b"{" + chunk * (size // 2000 + 1))[:size], headers, flaw
        return method, path, json.dumps(body).encode(), headers, flaw


def database_state(where: databases.DatabaseTarget) -> tuple[list[tuple], ...]:
    return tuple(
        databases.query(where, f"SELECT * FROM {table} ORDER BY id")
        for table in ("tenants", "api_keys", "public_prefixes")
    )


async def test_fuzz_malformed_admin_calls(
    admin: tuple[str, web.Application], client: aiohttp.ClientSession
) -> None:
    url, app = admin
    registry = app[REGISTRY]
    tenant_ids, prefix_ids, keys = [], [], {}
    for index in range(3):
        status, created = await call(
            client, "POST", f"{url}/admin/tenants", {"name": f"seed{index}"}
        )
        tenant_ids.append(created["tenant"]["id"])
        keys[created["tenant"]["id"]] = created["api_key"]
    status, prefix = await call(
        client, "POST", f"{url}/admin/public-prefixes", {"name": "shared", "tokens": [1, 2, 3]}
    )
    prefix_ids.append(prefix["id"])

    fuzzer = Fuzzer(seed=20240611, tenant_ids=tenant_ids, prefix_ids=prefix_ids)
    statuses: dict[int, int] = {}
    valid_changes = 0
    for number in range(FUZZ_CALLS):
        before = database_state(registry.target)
        method, path, body, headers, flaw = fuzzer.call()
        async with client.request(
            method, URL(url + path, encoded=True), data=body, headers=headers
        ) as response:
            raw = await response.read()
            status = response.status
        statuses[status] = statuses.get(status, 0) + 1
        context = (number, flaw, method, path[:120], (body or b"")[:200], raw[:300])
        assert 400 <= status < 500, context
        if flaw == "auth":
            assert status == 401, context
        if method == "FROB":  # aiohttp's HTTP parser refuses unknown methods before any app
            assert status == 400, context
        else:
            assert_envelope(json.loads(raw), status)
        assert database_state(registry.target) == before, context

        # now and then a well-formed change in between, so the state the fuzz meets moves
        if fuzzer.rng.random() < 0.15:
            tenant_id = fuzzer.rng.choice(tenant_ids)
            action = fuzzer.rng.choice(["rotate", "disable", "enable", "create"])
            if action == "rotate":
                status, rotated = await call(
                    client, "POST", f"{url}/admin/tenants/{tenant_id}/rotate-key"
                )
                keys[tenant_id] = rotated["api_key"]
            elif action == "create":
                status, created = await call(
                    client, "POST", f"{url}/admin/tenants", {"name": f"n{number}"}
                )
                tenant_ids.append(created["tenant"]["id"])
                keys[created["tenant"]["id"]] = created["api_key"]
            else:
                status, _ = await call(
                    client,
                    "PATCH",
                    f"{url}/admin/tenants/{tenant_id}",
                    {"disabled": action == "disable"},
                )
            assert status in (200, 201)
            valid_changes += 1

    assert valid_changes > 50
    assert {401, 400, 404, 405} <= set(statuses), statuses

    # the database is sound, and says what the calls that succeeded said
    if not registry._db.is_postgresql:  # PostgreSQL checks its pages and keys as it writes
        assert registry._db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert registry._db.execute("PRAGMA foreign_key_check").fetchall() == []
    live = dict(
        registry._db.execute(
            "SELECT t.id, count(k.id) FROM tenants t LEFT JOIN api_keys k "
            "ON k.tenant_id = t.id AND k.revoked_at IS NULL GROUP BY t.id"
        ).fetchall()
    )
    assert set(live) == set(tenant_ids)
    assert set(live.values()) == {1}  # exactly one live key each: none lost, none doubled
    for tenant_id, api_key in keys.items():
        tenant = registry.get(tenant_id)
        assert registry.authenticate(api_key) == (None if tenant.disabled else tenant)
    with TenantRegistry(registry.target) as fresh:
        assert fresh.list() == registry.list()

    # and the proxy still serves
    async with client.get(f"{url}/health") as response:
        assert response.status == 200
    status, listed = await call(client, "GET", f"{url}/admin/tenants")
    assert status == 200 and len(listed["tenants"]) == len(tenant_ids)
