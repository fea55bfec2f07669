"""The disk tier over the embedded engine: archives saved and restored through its slot API,
in llama-server's file format, so a file crosses between the engine and a real llama-server."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.disk.fingerprint import compatibility_fingerprint
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.plugins import load_plugin
from tests.support.embedded import embedded
from tests.support.servers import StartServer

FINGERPRINT = compatibility_fingerprint({"model": "tiny", "n_stream": 2})
TENANT = "t_aaaa"


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with client.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def random_tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(count)]


async def test_archive_round_trip_and_files_cross_to_llama_server(
    start_server: StartServer, tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    prompt = random_tokens(200, seed=21)
    request = [*prompt, 5, 6, 7]
    body = {
        "prompt": prompt,
        "n_predict": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
        "id_slot": 0,
    }
    async with embedded(tiny_model, tmp_path / "engine") as server:
        url = server.base_url
        with ArchiveIndex(
            server.slot_save_path, tmp_path / "archive.db", load_plugin("eviction", "lru"), 10**9
        ) as store:
            completion = await post(client, url + "/completion", body)
            held = (prompt + completion["tokens"])[: completion["tokens_cached"]]
            reservation = store.reserve(TENANT, 2_000_000, None, None)
            saved = await post(
                client, url + "/slots/0?action=save", {"filename": reservation.file_name}
            )
            committed = store.commit(reservation, held, saved["n_written"], FINGERPRINT)
            assert committed.archive.n_tokens == len(held)

            match = store.find(TENANT, FINGERPRINT, request)
            assert match is not None and match.n_common == 200 and match.tokens == held
            restored = await post(
                client, url + "/slots/1?action=restore", {"filename": match.archive.file_name}
            )
            assert restored["n_restored"] == len(held)
            again = await post(
                client, url + "/completion", {**body, "prompt": request, "id_slot": 1}
            )
            assert again["timings"]["cache_n"] == 200
            engine_file = match.archive.path.read_bytes()

    # The same file restored into a real llama-server with the same slot count: same reuse.
    llama_server = start_server(parallel=2, ctx_size=4096, extra_args=("--threads", "1"))
    (llama_server.slot_save_path / "from-engine.bin").write_bytes(engine_file)
    restored = await post(
        client, llama_server.url + "/slots/1?action=restore", {"filename": "from-engine.bin"}
    )
    assert restored["n_restored"] == len(held)
    answer = await post(
        client, llama_server.url + "/completion", {**body, "prompt": request, "id_slot": 1}
    )
    assert answer["timings"]["cache_n"] == 200

    # And back: llama-server saves the slot, the engine restores its file.
    saved = await post(
        client, llama_server.url + "/slots/1?action=save", {"filename": "from-server.bin"}
    )
    server_file = (llama_server.slot_save_path / "from-server.bin").read_bytes()
    async with embedded(tiny_model, tmp_path / "engine-2") as server:
        (server.slot_save_path / "from-server.bin").write_bytes(server_file)
        restored = await post(
            client, server.base_url + "/slots/0?action=restore", {"filename": "from-server.bin"}
        )
        assert restored["n_restored"] == saved["n_saved"]
        answer = await post(
            client, server.base_url + "/completion", {**body, "prompt": request, "id_slot": 0}
        )
        assert answer["timings"]["cache_n"] == len(request) - 1


async def test_engine_archives_are_cut_into_blocks_and_their_prefixes_cross_to_llama_server(
    start_server: StartServer, tiny_model: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    prompt = random_tokens(300, seed=31)
    body = {"n_predict": 4, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    lru = load_plugin("eviction", "lru")
    async with embedded(tiny_model, tmp_path / "engine") as server:
        url = server.base_url
        with ArchiveIndex(
            server.slot_save_path, tmp_path / "archive.db", lru, 10**9, blocks=True
        ) as store:
            completion = await post(
                client, url + "/completion", {**body, "prompt": prompt, "id_slot": 0}
            )
            held = (prompt + completion["tokens"])[: completion["tokens_cached"]]
            reservation = store.reserve(TENANT, 2_000_000, None, None)
            saved = await post(
                client, url + "/slots/0?action=save", {"filename": reservation.file_name}
            )
            engine_file = reservation.path.read_bytes()
            committed = store.commit(reservation, held, saved["n_written"], FINGERPRINT)
            conversion = store.convert(committed.archive.id)
            assert conversion is not None and conversion.kept_whole is None
            archive = store.get(committed.archive.id)
            assert archive is not None and archive.blocks
            whole = store.restore_file(archive, held, len(held))
            assert whole is not None
            assert store.path_for(whole.file_name).read_bytes() == engine_file
            store.release(whole)
            # a prefix put together from the engine's blocks, restored into the engine
            prefix = store.restore_file(archive, held, 150)
            assert prefix is not None
            prefix_file = store.path_for(prefix.file_name).read_bytes()
            restored = await post(
                client, url + "/slots/1?action=restore", {"filename": prefix.file_name}
            )
            store.release(prefix)
            assert restored["n_restored"] == 150
            again = await post(
                client,
                url + "/completion",
                {**body, "prompt": [*held[:150], 5, 6, 7], "id_slot": 1},
            )
            assert again["timings"]["cache_n"] == 150

    # and into a real llama-server with the same slot count
    llama_server = start_server(parallel=2, ctx_size=4096, extra_args=("--threads", "1"))
    (llama_server.slot_save_path / "prefix.slot").write_bytes(prefix_file)
    restored = await post(
        client, llama_server.url + "/slots/1?action=restore", {"filename": "prefix.slot"}
    )
    assert restored["n_restored"] == 150
    answer = await post(
        client,
        llama_server.url + "/completion",
        {**body, "prompt": [*held[:150], 5, 6, 7], "id_slot": 1},
    )
    assert answer["timings"]["cache_n"] == 150
