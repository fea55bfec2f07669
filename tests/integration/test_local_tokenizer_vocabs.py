"""The proxy's in-process tokenizer differentially against the pinned llama.cpp tree's own
tokenizer tests: every `models/ggml-vocab-*.gguf` that comes with test texts and expected ids
(`.inp`, `.out`, made by the models' reference tokenizers), loaded vocabulary-only as the proxy
loads an upstream's model file, must make exactly those ids; a vocabulary the installed llama.cpp
cannot load must be refused before any prompt is tokenized with it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from cacheproxy.slots.local_tokenizer import (
    BATTERY,
    InProcessTokenizers,
    load_vocabulary,
)
from cacheproxy.upstreams.pool import Upstream
from tests.support.vocab_cases import expected_ids, tokenizer_cases, vocabularies_with_expected_ids

pytestmark = pytest.mark.integration

VOCABULARIES = vocabularies_with_expected_ids()


def test_the_pinned_tree_has_vocabularies_with_expected_ids() -> None:
    assert len(VOCABULARIES) >= 15
    assert {"ggml-vocab-llama-spm.gguf", "ggml-vocab-qwen2.gguf"} <= {p.name for p in VOCABULARIES}


def test_the_battery_carries_a_share_of_the_pinned_trees_cases() -> None:
    assert len(set(BATTERY) & set(tokenizer_cases())) >= 20


async def refusal_of(vocabulary_file: Path) -> bool:
    """Whether the proxy refuses the upstream that names `vocabulary_file` before any battery
    round trip (one to the server would fail the proof instead)."""
    verdicts: list[str] = []

    async def props(upstream: Upstream) -> dict:
        return {"model_path": str(vocabulary_file)}

    async def no_server(upstream: Upstream, text: str, add: bool, parse: bool) -> list[int]:
        raise AssertionError("a vocabulary that does not load is never compared")

    tokenizers = InProcessTokenizers(True, props, no_server, lambda _, v: verdicts.append(v))
    proven = await tokenizers.proven(Upstream("http://127.0.0.1:9"))
    return not proven and verdicts == ["refused"]


@pytest.mark.parametrize("vocabulary_file", VOCABULARIES, ids=lambda path: path.stem)
def test_in_process_ids_are_the_pinned_trees_expected_ones(vocabulary_file: Path) -> None:
    vocabulary = load_vocabulary(vocabulary_file)
    if vocabulary is None:  # not loadable here: the proxy must refuse it
        assert asyncio.run(refusal_of(vocabulary_file))
        return
    cases = expected_ids(vocabulary_file)
    assert len(cases) >= 40
    for text, expected in cases:
        assert vocabulary.tokenize(text, False, False) == expected, text


@pytest.mark.parametrize("fault", ["truncated", "not a model"])
def test_a_model_file_llama_cpp_cannot_load_is_refused(fault: str, tmp_path: Path) -> None:
    whole = (VOCABULARIES[0]).read_bytes()
    broken = tmp_path / "model.gguf"
    broken.write_bytes(whole[: len(whole) // 2] if fault == "truncated" else b"{}\n" * 1000)
    assert load_vocabulary(broken) is None
    assert asyncio.run(refusal_of(broken))


def test_without_llama_cpp_no_vocabulary_loads() -> None:
    """A proxy installed without the embedded extra tokenizes nothing itself (and still runs)."""
    script = (
        "import sys; sys.modules['llama_cpp'] = None\n"
        "from cacheproxy.slots.local_tokenizer import load_vocabulary\n"
        f"print(load_vocabulary(__import__('pathlib').Path({str(VOCABULARIES[0])!r})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_a_vocabulary_found_wrong_is_proven_again_only_once_the_server_restarts() -> None:
    """Proven, then an answer counted otherwise: the server tokenizes from then on, with no new
    proof, until its process is a new one (maybe with another model), which is proven afresh; a
    proof under way when the server restarts is dropped for one of the new process. The server
    here is its own file's vocabulary: what is tested is when the proxy proves, not the battery
    (tests/integration/test_local_tokenizer.py runs that against real servers)."""
    vocabulary_file = VOCABULARIES[0]
    servers = load_vocabulary(vocabulary_file)
    assert servers is not None
    asked = 0

    async def props(upstream: Upstream) -> dict:
        return {"model_path": str(vocabulary_file)}

    async def server_tokenize(upstream: Upstream, text: str, add: bool, parse: bool) -> list[int]:
        nonlocal asked
        asked += 1
        await asyncio.sleep(0)
        return servers.tokenize(text, add, parse)

    async def run() -> list[str]:
        verdicts: list[str] = []
        tokenizers = InProcessTokenizers(
            True, props, server_tokenize, lambda _, verdict: verdicts.append(verdict)
        )
        upstream = Upstream("http://127.0.0.1:9")
        assert await tokenizers.proven(upstream)
        assert tokenizers.distrust(upstream)
        before = asked
        assert not await tokenizers.proven(upstream)  # not proven again: no battery sent
        assert asked == before and tokenizers.vocabulary(upstream) is None
        tokenizers.restarted(upstream)
        assert tokenizers.vocabulary(upstream) is None  # its proof starts
        tokenizers.restarted(upstream)  # again while it runs: that one is dropped
        assert await tokenizers.proven(upstream)
        await tokenizers.aclose()
        return verdicts

    assert asyncio.run(run()) == ["proven", "mispredicted", "proven"]
