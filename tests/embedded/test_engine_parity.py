"""The same calls over HTTP to a real llama-server and to the embedded engine's server give the
same answers."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from cacheproxy.disk.slot_file import read_slot_file
from cacheproxy.embedded.tasks import EngineError
from cacheproxy.errors import ApiError
from tests.support.embedded import embedded
from tests.support.servers import StartServer

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello <|im_end|> there"},
    ]
}


class Server:
    """llama-server's API over HTTP, answers as JSON; an error answer comes back as is."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, save_dir: Path) -> None:
        self.session = session
        self.base_url = base_url
        self.save_dir = save_dir

    async def call(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        async with self.session.request(method, self.base_url + path, json=body) as response:
            return response.status, orjson.loads(await response.read() or b"null")

    async def ok(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        status, payload = await self.call(method, path, body)
        assert status == 200, payload
        return payload

    async def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        # llama-server may close the connection once a stream ends: never reuse it for a POST
        async with self.session.post(
            self.base_url + "/completion",
            json={**body, "stream": True},
            headers={"Connection": "close"},
        ) as response:
            assert response.status == 200
            return [
                orjson.loads(line[6:]) async for line in response.content if line[:6] == b"data: "
            ]


@pytest.fixture(params=["llama-server", "embedded"])
async def server(
    request: pytest.FixtureRequest, start_server: StartServer, tiny_model: Path, tmp_path: Path
) -> AsyncIterator[Server]:
    async with aiohttp.ClientSession() as session:
        if request.param == "llama-server":
            child = start_server(parallel=2, ctx_size=4096, extra_args=("--threads", "1"))
            yield Server(session, child.url, child.slot_save_path)
            return
        async with embedded(tiny_model, tmp_path, parallel=2) as engine_server:
            yield Server(session, engine_server.base_url, engine_server.slot_save_path)


async def test_text_and_templates(server: Server) -> None:
    """Pinned against llama-server's own answers on the test model."""
    await server.ok("GET", "/health")
    tokenize = {"content": "Hello world", "add_special": True}
    assert (await server.ok("POST", "/tokenize", tokenize))["tokens"] == [1, 15043, 3186]
    literal = {"content": "<|im_end|>", "parse_special": False}
    assert (await server.ok("POST", "/tokenize", literal))["tokens"] != [32000]
    assert (await server.ok("POST", "/apply-template", CHAT))["prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello <|im_end|> there<|im_end|>\n<|im_start|>assistant\n"
    )
    detokenize = {"tokens": [15043, 3186]}
    assert (await server.ok("POST", "/detokenize", detokenize))["content"] == " Hello world"
    props = await server.ok("GET", "/props")
    assert props["default_generation_settings"]["n_ctx"] == 2048


async def test_reuse_streams_and_slot_files(server: Server) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(100, 30000) for _ in range(64)]
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": 6,
        "temperature": 0,
        "id_slot": 1,
        "return_tokens": True,
    }
    first = await server.ok("POST", "/completion", body)
    assert (first["id_slot"], first["timings"]["cache_n"], first["tokens_cached"]) == (1, 0, 69)
    events = await server.stream(body)
    assert events[-1]["stop"] and events[-1]["timings"]["cache_n"] == 63
    assert all(event["id_slot"] == -1 for event in events[:-1])

    saved = await server.ok("POST", "/slots/1?action=save", {"filename": "one.bin"})
    assert saved["n_saved"] == 69
    assert read_slot_file(server.save_dir / "one.bin").n_tokens == 69
    restored = await server.ok("POST", "/slots/0?action=restore", {"filename": "one.bin"})
    assert restored["n_restored"] == 69
    again = await server.ok("POST", "/completion", {**body, "id_slot": 0})
    assert again["timings"]["cache_n"] == 63 and again["tokens"] == first["tokens"]
    assert (await server.ok("POST", "/slots/0?action=erase"))["n_erased"] == 69
    assert (await server.ok("GET", "/slots"))[0].get("n_prompt_tokens", 0) == 0

    (server.save_dir / "broken.bin").write_bytes(b"ggsq")
    status, refused = await server.call(
        "POST", "/slots/1?action=restore", {"filename": "broken.bin"}
    )
    assert status == 400 and "Unable to restore slot" in refused["error"]["message"]
    assert refused["error"]["type"] == "invalid_request_error"


def test_engine_errors_take_the_proxys_arguments() -> None:
    error = EngineError(501, "no chat template")
    assert isinstance(error, ApiError)
    assert (error.status, error.error_type) == (501, "not_supported_error")
