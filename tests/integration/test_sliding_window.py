"""A model whose attention slides over a window (Gemma 2 and 3, gpt-oss), behind the proxy; and
one whose memory is a recurrent state.

llama-server keeps only the window's KV cells of such a model's sliding layers unless started
with `--swa-full`, saves only those in a slot file, and recomputes the whole prompt of a slot
restored from one (server-context.cpp wants one cell more than the file holds). Restores there
are work for nothing: the disk tier gives them up after two, until the server restarts, and a
llama-server the proxy starts itself gets `--swa-full`, with which restores are reused. The
model is the test bed's Gemma-2-layout one (`make_model`, `--size swa`: a window of 64).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.provision.make_model import ensure_model
from cacheproxy.upstreams.managed import free_port
from tests.support.completions import complete
from tests.support.disk_tier import (
    PROMPT_TOKENS,
    SAVED_ON_THE_PATH,
    TWO_SLOTS,
    conversation,
    disk_settings,
    next_turn,
    tier,
)
from tests.support.metrics import proxy_counters
from tests.support.servers import StartServer, child_pids, serving, wait_for_health
from tests.support.waiting import wait_for

SAVED = 'cacheproxy_archive_saves_total{outcome="saved"}'
RESTORED = 'cacheproxy_archive_restores_total{outcome="restored"}'
RECOMPUTED = 'cacheproxy_archive_restores_total{outcome="recomputed"}'
MISMATCH = 'cacheproxy_predictions_total{result="mismatch"}'
BRANCHED = 'cacheproxy_archive_restores_total{outcome="branched"}'
# what a slot holds after a 4-token answer: the prompt and all but the last token generated
HELD = PROMPT_TOKENS + 3


@pytest.fixture(scope="module")
def swa_model() -> Path:
    return ensure_model("swa")


async def test_the_probe_tells_a_state_after_the_kv_cache_from_a_kv_cache_alone(
    start_server: StartServer, swa_model: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """Whether a server's slot files hold more than its KV cache is read from the attach
    probe's save: the sliding-window model's do (its window cells follow), llama's do not."""
    plain = start_server(model=tiny_model, **TWO_SLOTS)
    windowed = start_server(model=swa_model, slot_save_path=plain.slot_save_path, **TWO_SLOTS)
    settings = disk_settings(plain, tmp_path)
    settings = settings.model_copy(update={"upstreams": [plain.url, windowed.url]})
    async with serving(settings) as (_, app):
        attached = tier(app).attached
        assert (attached[0].state_after_kv, attached[1].state_after_kv) == (False, True)
        assert attached[0].fingerprint != attached[1].fingerprint


async def test_a_recurrent_model_is_served_without_the_disk_tier(
    start_server: StartServer, tmp_path: Path
) -> None:
    """A recurrent model's slot files hold no KV cache (the test bed's Mamba-layout model): the
    attach probe cannot read them, and the upstream is served without the tier."""
    server = start_server(model=ensure_model("recurrent"), **TWO_SLOTS)
    async with (
        serving(disk_settings(server, tmp_path)) as (url, app),
        aiohttp.ClientSession() as client,
    ):
        assert 0 not in tier(app).attached
        answer = await complete(client, url, conversation(1))
        assert answer["timings"]["cache_n"] == 0 and len(answer["tokens"]) == 4


async def two_come_back(
    client: aiohttp.ClientSession, url: str, seeds: tuple[int, int], others: tuple[int, int]
) -> list[dict]:
    """Two conversations answered, pushed out of both slots by two others, and back for their
    next turn: the answers of those next turns."""
    answers = {seed: await complete(client, url, conversation(seed)) for seed in seeds}
    for seed in others:
        await complete(client, url, conversation(seed))
    return [
        await complete(client, url, next_turn(conversation(seed), answers[seed], seed + 1000))
        for seed in seeds
    ]


async def test_restores_a_sliding_window_server_recomputes_are_given_up_until_it_restarts(
    start_server: StartServer, swa_model: Path, tmp_path: Path
) -> None:
    server = start_server(model=swa_model, **TWO_SLOTS)
    settings = disk_settings(server, tmp_path, disk=SAVED_ON_THE_PATH)
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        returns = await two_come_back(client, url, (1, 2), (3, 4))
        # both were restored, and the server computed each prompt whole all the same
        assert [answer["timings"]["cache_n"] for answer in returns] == [0, 0]
        counters = await proxy_counters(client, url)
        assert counters[RESTORED] == 2 and counters[RECOMPUTED] == 2
        assert 0 not in tier(app).attached  # given up on this server process

        # nothing more is saved from it or restored into it
        saved = counters[SAVED]
        await two_come_back(client, url, (5, 6), (7, 8))
        counters = await proxy_counters(client, url)
        assert (counters[SAVED], counters[RESTORED]) == (saved, 2)

        # back with --swa-full: attached afresh, and its restores are reused as predicted
        server.stop()
        start_server(model=swa_model, port=server.port, extra_args=("--swa-full",), **TWO_SLOTS)
        await wait_for(lambda: 0 in tier(app).attached, "the disk tier attached again")
        mismatched = counters.get(MISMATCH, 0)
        returns = await two_come_back(client, url, (9, 10), (11, 12))
        assert [answer["timings"]["cache_n"] for answer in returns] == [HELD, HELD]
        counters = await proxy_counters(client, url)
        assert counters[RESTORED] == 4 and counters[RECOMPUTED] == 2
        assert counters.get(MISMATCH, 0) == mismatched


async def test_with_swa_full_an_archive_is_restored_only_for_a_request_continuing_all_of_it(
    start_server: StartServer, swa_model: Path, tmp_path: Path
) -> None:
    """With `--swa-full` a slot file still holds only the window's cells of the sliding layers,
    back from its end. A request that branches off an archive a little before its end (within
    the window) would reuse it all the same, its sliding layers attending over a window missing
    its first cells: another answer than llama-server's own. Such an archive is restored only
    for a request that continues all of it, as a conversation's next turn does."""
    server = start_server(model=swa_model, extra_args=("--swa-full",), **TWO_SLOTS)
    reference = start_server(model=swa_model, extra_args=("--swa-full",), **TWO_SLOTS)
    # only the full conversations are archived, not the branch
    disk = {**SAVED_ON_THE_PATH, "min_tokens": PROMPT_TOKENS}
    settings = disk_settings(server, tmp_path, disk=disk)
    first = conversation(1)
    branch = first[: PROMPT_TOKENS - 40] + conversation(50, 20)  # 43 tokens before its end
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        answer = await complete(client, url, first)
        for seed in (3, 4):  # both slots taken by others: the first is archived
            await complete(client, url, conversation(seed))
        branched = await complete(client, url, branch)
        own = await complete(client, reference.url, branch)
        assert branched["tokens"] == own["tokens"]
        assert branched["timings"]["cache_n"] == 0  # not restored: computed whole
        counters = await proxy_counters(client, url)
        assert counters.get(RESTORED, 0) == 0 and counters[BRANCHED] == 1

        for seed in (5, 6):  # the branch's slot too
            await complete(client, url, conversation(seed))
        follow_up = await complete(client, url, next_turn(first, answer, 1001))
        assert follow_up["timings"]["cache_n"] == HELD
        counters = await proxy_counters(client, url)
        assert counters[RESTORED] == 1 and counters.get(RECOMPUTED, 0) == 0
        assert 0 in tier(app).attached


def _complete(base_url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "return_tokens": True}
    request = urllib.request.Request(
        base_url + "/completion", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_a_managed_server_of_a_sliding_window_model_reuses_its_restores(
    llama_server_binary: Path, swa_model: Path, tmp_path: Path
) -> None:
    """`cacheproxy serve -m` a sliding-window model: its llama-server is started with
    `--swa-full`, and a conversation pushed out of its slot comes back from the disk without
    its prompt computed again."""
    port = free_port()
    env = {**os.environ, "CACHEPROXY_STATE_DIR": str(tmp_path / "state")}
    server = ["--llama-server", str(llama_server_binary), "-m", str(swa_model)]
    serve = [sys.executable, "-m", "cacheproxy", "serve", "--port", str(port)]
    with open(tmp_path / "serve.log", "w") as log_file:
        process = subprocess.Popen(
            [*serve, *server, "-np", "2", "-c", "8192"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_for_health(base_url)
        (server_pid,) = child_pids(process.pid)
        assert b"--swa-full" in Path(f"/proc/{server_pid}/cmdline").read_bytes().split(b"\0")
        first = conversation(1)
        answer = _complete(base_url, first)
        for seed in (2, 3):  # both slots taken by others: the first is saved, then restored
            _complete(base_url, conversation(seed))
        again = _complete(base_url, next_turn(first, answer, 1001))
        assert again["timings"]["cache_n"] == HELD
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
