"""Closed routes stay closed however their path is spelled, checked on a real llama-server.

Every variant of `GET /slots`, `POST /slots/{id}?action=save|restore|erase` and `GET /metrics`
is sent with a tenant's key, byte for byte, through the proxy. Whatever status the proxy gives,
the test then asks the llama-server itself what happened: no file appeared in its slot-save
folder, the slots hold what they held, and no answer carried its slot list or its metrics.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest

from cacheproxy.settings import load_settings
from tests.support.raw_http import RawResponse, raw_request
from tests.support.servers import LlamaServer, StartServer, running_proxy, serving_tenants

ADMIN_KEY = "admin-key-for-path-tests-0123456789"
SLOT_0_PROMPT = [random.Random(1).randrange(300, 31000) for _ in range(48)]
SLOT_1_PROMPT = [random.Random(2).randrange(300, 31000) for _ in range(80)]


def spellings(path: str) -> list[str]:
    """Ways to write `path` that a lax proxy would route elsewhere but a server may serve."""
    first, rest = path[1], path[2:]
    variants = [
        f"/.{path}",
        f"{path}/.",
        f"/v1/..{path}",
        f"/v1/x/../..{path}",
        f"/../..{path}",
        f"/{path}",
        f"/.//{path}",
        f"{path}/",
        f"{path}//",
        f"/%2e{path}",
        f"/%2E{path}",
        f"/v1/%2e%2e{path}",
        f"/v1/%2E%2E{path}",
        f"/v1/.%2e{path}",
        f"/%{ord(first):02x}{rest}",
        f"/%{ord(first):02X}{rest}",
        "/" + "".join(f"%{ord(char):02x}" for char in path[1:]),
        f"/%u{ord(first):04x}{rest}",
        f"{path}%2F",
        f"{path}%2f",
        f"{path}%2F.",
        f"{path}%5C",
        f"{path}%00",
        f"{path}%2500",
        f"/x%2F..{path}",
        f"/health#/..{path}",
    ]
    if path.count("/") > 1:  # a slot id: its own spellings
        head, _, slot = path.rpartition("/")
        variants += [
            path.replace("/", "%2F").replace("%2F", "/", 1),
            path.replace("/", "%2f").replace("%2f", "/", 1),
            f"{head}/./{slot}",
            f"{head}/x/../{slot}",
            f"{head}//{slot}",
            f"{head}/%{ord(slot[0]):02X}{slot[1:]}",
            f"{head}/%25{ord(slot[0]):02X}{slot[1:]}",
            f"{head}/{slot}/",
            f"{head}/{slot}%2F",
        ]
    return variants


@dataclass
class Setup:
    proxy_url: str
    server: LlamaServer
    tenant_key: str

    @property
    def tenant_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tenant_key}"}


async def upstream_slots(http: aiohttp.ClientSession, server: LlamaServer) -> dict[int, int]:
    async with http.get(server.url + "/slots") as response:
        return {slot["id"]: slot.get("n_prompt_tokens", 0) for slot in await response.json()}


@pytest.fixture
async def setup(start_server: StartServer, tmp_path: Path) -> AsyncIterator[Setup]:
    server = start_server(parallel=2)
    async with aiohttp.ClientSession() as http:
        # slot 0 and slot 1 hold prompts of different lengths; slot 1's state is saved, so a
        # restore into slot 0 that got through would change slot 0's length
        for slot, prompt in ((0, SLOT_0_PROMPT), (1, SLOT_1_PROMPT)):
            body = {"prompt": prompt, "n_predict": 1, "id_slot": slot}
            async with http.post(server.url + "/completion", json=body) as response:
                assert response.status == 200
        body = {"filename": "other.bin"}
        async with http.post(server.url + "/slots/1?action=save", json=body) as response:
            assert response.status == 200
    async with serving_tenants(server.url, tmp_path, ADMIN_KEY) as (url, registry):
        _, key = registry.create("acme")
        yield Setup(url, server, key)


CLOSED = [
    ("GET", "/slots", ""),
    ("POST", "/slots/0", "?action=save"),
    ("POST", "/slots/0", "?action=restore"),
    ("POST", "/slots/0", "?action=erase"),
    ("GET", "/metrics", ""),
]


async def test_closed_routes_stay_closed_in_every_spelling(setup: Setup) -> None:
    async with aiohttp.ClientSession() as http:
        slots_before = await upstream_slots(http, setup.server)
    files_before = set(setup.server.slot_save_path.iterdir())
    assert slots_before[0] != slots_before[1] > 0
    outcomes: dict[str, int] = {}
    number = 0
    for method, path, query in CLOSED:
        for variant in [path, *spellings(path)]:
            for target in (variant + query, variant + query + "&x=/../" if query else None):
                if target is None:
                    continue
                number += 1
                body = None
                if query in ("?action=save", "?action=restore"):
                    name = "other.bin" if "restore" in query else f"leak-{number}.bin"
                    body = orjson.dumps({"filename": name})
                answer = await raw_request(
                    setup.proxy_url, method, target, setup.tenant_headers, body
                )
                outcomes[f"{method} {target}"] = answer.status
                assert_not_served(method, target, answer)
    async with aiohttp.ClientSession() as http:
        assert await upstream_slots(http, setup.server) == slots_before
    assert set(setup.server.slot_save_path.iterdir()) == files_before
    assert set(outcomes.values()) <= {400, 401, 403}, outcomes


def assert_not_served(method: str, target: str, answer: RawResponse) -> None:
    shown = f"{method} {target}: {answer.status} {answer.body[:200]!r}"
    assert answer.status in (400, 401, 403), shown
    assert b"llamacpp:" not in answer.body, shown
    assert b"n_ctx" not in answer.body and b"n_saved" not in answer.body, shown
    assert b"n_erased" not in answer.body and b"n_restored" not in answer.body, shown
    error = orjson.loads(answer.body)["error"]  # llama-server's envelope, from the proxy
    assert error["code"] == answer.status, shown


@pytest.mark.parametrize(
    ("method", "target", "body"),
    [
        ("POST", "/v1/./chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1//chat/completions/", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/x/../%63ompletion", {"prompt": "hello", "n_predict": 1}),
        ("GET", "//health", None),
        ("GET", "/%761/models", None),
    ],
)
async def test_normal_routes_work_through_canonical_paths(
    setup: Setup, method: str, target: str, body: dict | None
) -> None:
    payload = None if body is None else {"max_tokens": 2, "n_predict": 2, **body}
    answer = await raw_request(
        setup.proxy_url,
        method,
        target,
        setup.tenant_headers,
        None if payload is None else orjson.dumps(payload),
    )
    assert answer.status == 200, answer.body[:300]


async def test_unsafe_path_refused_in_llama_server_envelope(setup: Setup) -> None:
    answer = await raw_request(setup.proxy_url, "GET", "/v1%2Fmodels", setup.tenant_headers)
    assert answer.status == 400
    error = orjson.loads(answer.body)["error"]
    assert error["type"] == "invalid_request_error"
    assert "path" in error["message"]


async def test_single_user_is_forwarded_the_canonical_path(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    """Without tenants every route is open: the path the server gets is the canonical one."""
    settings = load_settings(upstreams=[llama_server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        slots = await raw_request(url, "GET", "/v1/../slots/.")
        assert slots.status == 200
        assert isinstance(slots.json(), list) and "n_ctx" in slots.json()[0]
        erased = await raw_request(url, "POST", "/slots/x/..//%31/?action=erase")
        assert erased.status == 200
        assert erased.json()["id_slot"] == 1
