"""Blocks against the pinned llama-server, on every KV type and layout it makes on this build:
a state it saved, cut into blocks and put together again, is the file it wrote, byte for byte;
a prefix put together from the blocks and restored answers greedily as that prefix prefilled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cacheproxy.disk.fingerprint import compatibility_fingerprint
from cacheproxy.disk.kv_frame import read_framed
from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.plugins import load_plugin
from cacheproxy.provision.make_model import ensure_model, server_args
from tests.support import databases
from tests.support.servers import LlamaServer, StartServer
from tests.support.slot_files import post_json, random_tokens

TENANT = "t_aaaa"
PROMPT = 300
QUESTION = random_tokens(9, seed=99)

# (--cache-type-k, --cache-type-v, -fa): without flash attention V is stored transposed; a
# quantized V needs flash attention on this build
KV_LAYOUTS = {
    "f16": ("f16", "f16", "on"),
    "f16-transposed": ("f16", "f16", "off"),
    "q8_0": ("q8_0", "q8_0", "on"),
    "q8_0-k-transposed": ("q8_0", "f16", "off"),
    "f32": ("f32", "f32", "on"),
    "f32-transposed": ("f32", "f32", "off"),
}


def kv_args(layout: str) -> tuple[str, ...]:
    k, v, flash = KV_LAYOUTS[layout]
    return ("--cache-type-k", k, "--cache-type-v", v, "-fa", flash, "--threads", "1")


def complete(server: LlamaServer, prompt: list[int], slot: int, **body: Any) -> dict[str, Any]:
    return post_json(
        server.url + "/completion",
        {
            "prompt": prompt,
            "n_predict": 12,
            "temperature": 0,
            "ignore_eos": True,
            "return_tokens": True,
            "id_slot": slot,
            **body,
        },
    )


def slot_action(server: LlamaServer, slot: int, action: str, file_name: str = "") -> dict:
    body = {"filename": file_name} if file_name else {}
    return post_json(f"{server.url}/slots/{slot}?action={action}", body)


def check_blocks(server: LlamaServer, tmp_path: Path, slot: int) -> None:
    """Save a slot's state as an archive, cut it into blocks, and check what they give back."""
    prompt = random_tokens(PROMPT, seed=7)
    complete(server, prompt, slot)
    with ArchiveIndex(
        server.slot_save_path,
        databases.chosen(tmp_path / "archive.db"),
        load_plugin("eviction", "lru"),
        10**10,
        blocks=True,
        whole_copies=False,  # every restore put together from the blocks
    ) as store:
        reservation = store.reserve(TENANT, 10**6, None, None)
        saved = slot_action(server, slot, "save", reservation.file_name)
        written = reservation.path.read_bytes()
        framed = read_framed(reservation.path)
        assert framed.n_cells == saved["n_saved"] and framed.frame.seq_id == slot
        committed = store.commit(reservation, None, saved["n_written"], FINGERPRINT)
        conversion = store.convert(committed.archive.id)
        assert conversion is not None and conversion.kept_whole is None
        archive = store.get(committed.archive.id)
        assert archive is not None and archive.blocks and not archive.path.exists()
        tokens = store.tokens(archive.id)
        assert tokens is not None

        # the whole archive put together: the file llama-server wrote
        whole = store.restore_file(archive, tokens, len(tokens))
        assert whole is not None
        assert store.path_for(whole.file_name).read_bytes() == written
        store.release(whole)

        # a quarter of it, and a prefix ending inside a block, restored as llama-server reads
        # files: the slot reuses exactly that prefix and answers as the prefix prefilled
        for n_tokens in (len(tokens) // 4, 130):
            made = store.restore_file(archive, tokens, n_tokens)
            assert made is not None and made.bytes < len(written)
            restored = slot_action(server, slot, "restore", made.file_name)
            store.release(made)
            assert restored["n_restored"] == n_tokens
            follow_up = tokens[:n_tokens] + QUESTION
            from_blocks = complete(server, follow_up, slot)
            assert from_blocks["timings"]["cache_n"] == n_tokens

            slot_action(server, slot, "erase")
            complete(server, tokens[:n_tokens], slot, n_predict=0)  # the prefix prefilled
            prefilled = complete(server, follow_up, slot)
            assert prefilled["timings"]["cache_n"] == n_tokens
            assert from_blocks["tokens"] == prefilled["tokens"]


FINGERPRINT = compatibility_fingerprint({"model": "tiny", "format": "blocks"})


@pytest.mark.parametrize("parallel", [1, 4])
@pytest.mark.parametrize("layout", list(KV_LAYOUTS))
def test_blocks_give_back_what_llama_server_wrote(
    start_server: StartServer, tmp_path: Path, layout: str, parallel: int
) -> None:
    server = start_server(parallel=parallel, ctx_size=1024 * parallel, extra_args=kv_args(layout))
    check_blocks(server, tmp_path, slot=parallel - 1)  # with -np 4, cells in the last stream


def test_blocks_of_the_kv_heavy_model(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(
        model=ensure_model("kv-heavy"),
        parallel=2,
        ctx_size=2048,
        extra_args=("--threads", "1", *server_args("kv-heavy")),
    )
    check_blocks(server, tmp_path, slot=1)
