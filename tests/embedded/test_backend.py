"""The same calls on a real llama-server and on the embedded engine give the same answers."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.disk.slot_file import read_slot_file
from cacheproxy.embedded.backend import Backend, BackendError, EmbeddedBackend, LlamaServerBackend
from cacheproxy.embedded.server import build_engine
from cacheproxy.settings import EmbeddedSettings
from tests.support.servers import StartServer

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello <|im_end|> there"},
    ]
}


@pytest.fixture(params=["llama-server", "embedded"])
async def backend(
    request: pytest.FixtureRequest, start_server: StartServer, tiny_model: Path, tmp_path: Path
) -> AsyncIterator[tuple[Backend, Path]]:
    if request.param == "llama-server":
        server = start_server(parallel=2, ctx_size=4096, extra_args=("--threads", "1"))
        async with aiohttp.ClientSession() as session:
            yield LlamaServerBackend(session, server.url), server.slot_save_path
        return
    engine = build_engine(EmbeddedSettings(parallel=2, ctx_size=4096, threads=1), tiny_model)
    try:
        yield EmbeddedBackend(engine, tmp_path, tiny_model.name), tmp_path
    finally:
        engine.close()


async def test_text_and_templates(backend: tuple[Backend, Path]) -> None:
    """Pinned against llama-server's own answers on the test model."""
    server, _ = backend
    assert await server.health()
    assert await server.tokenize("Hello world", add_special=True) == [1, 15043, 3186]
    assert await server.tokenize("<|im_end|>", parse_special=False) != [32000]
    prompt = await server.apply_template(CHAT)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello <|im_end|> there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert await server.detokenize([15043, 3186]) == " Hello world"
    assert (await server.props())["default_generation_settings"]["n_ctx"] == 2048


async def test_reuse_streams_and_slot_files(backend: tuple[Backend, Path]) -> None:
    server, save_dir = backend
    rng = random.Random(3)
    prompt = [rng.randrange(100, 30000) for _ in range(64)]
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": 6,
        "temperature": 0,
        "id_slot": 1,
        "return_tokens": True,
    }
    first = await server.complete(body)
    assert (first["id_slot"], first["timings"]["cache_n"], first["tokens_cached"]) == (1, 0, 69)
    events = [event async for event in server.stream(body)]
    assert events[-1]["stop"] and events[-1]["timings"]["cache_n"] == 63
    assert all(event["id_slot"] == -1 for event in events[:-1])

    saved = await server.save_slot(1, "one.bin")
    assert saved["n_saved"] == 69
    assert read_slot_file(save_dir / "one.bin").n_tokens == 69
    assert (await server.restore_slot(0, "one.bin"))["n_restored"] == 69
    again = await server.complete({**body, "id_slot": 0})
    assert again["timings"]["cache_n"] == 63 and again["tokens"] == first["tokens"]
    assert (await server.erase_slot(0))["n_erased"] == 69
    assert (await server.slots())[0].get("n_prompt_tokens", 0) == 0

    (save_dir / "broken.bin").write_bytes(b"ggsq")
    with pytest.raises(BackendError) as refused:
        await server.restore_slot(1, "broken.bin")
    assert refused.value.status == 400 and "Unable to restore slot" in refused.value.message
