"""Prompts tokenized in the proxy, with the upstream's own model file, against real llama-servers:
once proven by the battery, chat, /completion and /v1/messages prompts are tokenized without a
POST /tokenize and every answer's prompt count is the mirror's; a model file the server does not
serve (replaced on disk under it) or one that is gone is refused, and the server tokenizes.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from cacheproxy.http.app_keys import CACHE
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.settings import load_settings
from tests.support.metrics import sample
from tests.support.routers import start_router
from tests.support.servers import StartServer, serving
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

CHAT_MODEL = {"size": "small", "chat_tokens": True}  # <|im_start|>, <|im_end|> as control tokens


async def proxied_requests(client: aiohttp.ClientSession, url: str, turn: int) -> None:
    """A chat, a /v1/messages and a /completion of text never sent before, each answered 200."""
    words = f"turn {turn}: the quick brown fox jumps over {turn * 7} lazy dogs"
    requests = [
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"Chat {words} <|im_end|> ok?"},
                ],
                "max_tokens": 2,
            },
        ),
        (
            "/v1/messages",
            {
                "model": "any",
                "system": "You answer in French.",
                "messages": [{"role": "user", "content": f"Messages {words} 🦙"}],
                "max_tokens": 2,
            },
        ),
        ("/completion", {"prompt": f"Completion {words}\n\n\tcode()", "n_predict": 2}),
    ]
    for path, body in requests:
        async with client.post(url + path, json=body) as response:
            assert response.status == 200, await response.text()


def tokenizing_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("tokenize")]


def counts(app: web.Application, upstream: str) -> dict[str, float]:
    return {
        "proxy": sample(app, "cacheproxy_tokenizations_total", upstream=upstream, where="proxy"),
        "server": sample(app, "cacheproxy_tokenizations_total", upstream=upstream, where="server"),
        "mismatch": sample(app, "cacheproxy_predictions_total", result="mismatch"),
        "mispredicted": sample(
            app, "cacheproxy_tokenizer_verdicts_total", upstream=upstream, verdict="mispredicted"
        ),
    }


async def settled(app: web.Application, client: aiohttp.ClientSession, url: str) -> bool:
    """After a first round of requests (which start the template learning and the tokenizer's
    proof), both have ended; whether the upstream's prompts are tokenized here."""
    await proxied_requests(client, url, 0)
    mirror = app[CACHE].mirror
    upstream = app[CACHE].tables[0].upstream
    await mirror.templates.learnt(mirror.template_name(upstream))
    return await mirror.local.proven(upstream)


async def test_prompts_are_tokenized_in_the_proxy_once_proven_and_predicted_exactly(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(model=ensure_model(**CHAT_MODEL), parallel=2)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        assert await settled(app, client, url)
        assert sample(
            app, "cacheproxy_tokenizer_verdicts_total", upstream=server.url, verdict="proven"
        )
        before = counts(app, server.url)
        for turn in range(1, 4):
            await proxied_requests(client, url, turn)
        after = counts(app, server.url)
        assert not tokenizing_threads()  # short texts are tokenized inline
        long_prompt = "".join(f"Line {n}: naïve café, 東京, {n * 37} ✓\n" for n in range(150))
        body = {"prompt": long_prompt, "n_predict": 1}
        async with client.post(url + "/completion", json=body) as response:
            assert response.status == 200, await response.text()
        after_long = counts(app, server.url)
        assert tokenizing_threads()  # a long one off the event loop
    assert after["proxy"] > before["proxy"]  # every route's prompt text tokenized here
    assert after["server"] == before["server"]  # and none of it sent to /tokenize
    assert after["mismatch"] == before["mismatch"] == 0  # each answer's cache_n as predicted
    assert after["mispredicted"] == 0  # each answer's prompt count the mirror's
    assert after_long["proxy"] == after["proxy"] + 1
    assert after_long["server"] == after["server"]
    assert after_long["mismatch"] == 0 and after_long["mispredicted"] == 0


async def test_the_setting_off_keeps_every_tokenization_on_the_server(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(model=ensure_model(**CHAT_MODEL), parallel=2)
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        routing={"tokenize_in_process": False},
    )
    async with serving(settings) as (url, app):
        assert not await settled(app, client, url)
        await proxied_requests(client, url, 1)
        after = counts(app, server.url)
    assert after["proxy"] == 0 and after["server"] > 0
    assert after["mismatch"] == 0


@pytest.mark.parametrize("fault", ["replaced", "removed"])
async def test_a_model_file_not_the_servers_is_refused_and_the_server_tokenizes(
    fault: str, client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """The file at the server's model_path is, after it started, another model's (the same
    vocabulary without the chat markers as control tokens: only the battery tells them apart)
    or no file at all: the proxy refuses it, and its answers stay exact."""
    served = tmp_path / "model.gguf"
    shutil.copyfile(ensure_model(**CHAT_MODEL), served)
    server = start_server(model=served, parallel=2)
    if fault == "replaced":
        replacement = tmp_path / "replacement.gguf"
        shutil.copyfile(ensure_model("small"), replacement)
        replacement.replace(served)  # the server keeps the file it opened
    else:
        served.unlink()
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        assert not await settled(app, client, url)
        refused = sample(
            app, "cacheproxy_tokenizer_verdicts_total", upstream=server.url, verdict="refused"
        )
        before = counts(app, server.url)
        for turn in range(1, 3):
            await proxied_requests(client, url, turn)
        after = counts(app, server.url)
    assert refused == 1
    assert after["proxy"] == 0  # nothing tokenized with the wrong vocabulary
    assert after["server"] > before["server"]
    assert after["mismatch"] == 0 and after["mispredicted"] == 0


async def test_an_answer_counted_otherwise_sends_the_model_back_to_the_server(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Proven, then the server restarts on the same address with a model whose vocabulary does
    not hold the chat markers as control tokens: the first answer whose prompt count is not the
    mirror's sends that upstream back to /tokenize, and later predictions are exact again."""
    server = start_server(model=ensure_model(**CHAT_MODEL), parallel=1)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        assert await settled(app, client, url)
        server.stop()
        start_server(model=ensure_model("small"), parallel=1, port=server.port)
        mispredicted = 0.0
        for turn in range(1, 8):  # the first answers after the restart may find the table stale
            body = {"prompt": f"<|im_start|>user\nturn {turn}<|im_end|>\n", "n_predict": 1}
            async with client.post(url + "/completion", json=body) as response:
                assert response.status == 200, await response.text()
            mispredicted = counts(app, server.url)["mispredicted"]
            if mispredicted:
                break
        assert mispredicted == 1
        before = counts(app, server.url)
        for turn in range(8, 11):
            body = {"prompt": f"<|im_start|>user\nturn {turn}<|im_end|>\n", "n_predict": 1}
            async with client.post(url + "/completion", json=body) as response:
                assert response.status == 200, await response.text()
        after = counts(app, server.url)
    assert after["proxy"] == before["proxy"]  # no longer tokenized here
    assert after["server"] == before["server"] + 3
    assert after["mismatch"] == before["mismatch"]  # the server's ids predicted exactly
    assert after["mispredicted"] == 1


async def test_each_model_of_a_router_is_tokenized_with_its_own_file(
    client: aiohttp.ClientSession, llama_server_binary: Path, tmp_path: Path
) -> None:
    """A router-mode server names each model instance's file in its `/props?model=`: each is
    proven on its own, and its text prompts are tokenized here, exactly."""
    router = start_router(llama_server_binary, tmp_path, models=("alpha", "beta"))
    try:
        settings = load_settings(upstreams=[router.url], state_dir=tmp_path / "state")
        async with serving(settings) as (url, app):

            async def complete_text(model: str, turn: int) -> None:
                body = {"model": model, "prompt": f"{model} says {turn} times ✓", "n_predict": 1}
                async with client.post(url + "/completion", json=body) as response:
                    assert response.status == 200, await response.text()

            for model in ("alpha", "beta"):
                await complete_text(model, 0)  # loads the model; the proxy reads its instance
            await wait_for(lambda: len([t for t in app[CACHE].tables if not t.router]) == 2)
            instances = [t.upstream for t in app[CACHE].tables if not t.router]
            for model in ("alpha", "beta"):
                await complete_text(model, 1)  # starts its proof
            mirror = app[CACHE].mirror
            assert [await mirror.local.proven(instance) for instance in instances] == [True] * 2
            before = {i.name: counts(app, i.name) for i in instances}
            for turn in range(2, 5):
                for model in ("alpha", "beta"):
                    await complete_text(model, turn)
            after = {i.name: counts(app, i.name) for i in instances}
    finally:
        router.stop()
    assert sorted(after) == sorted(f"{router.url} [{model}]" for model in ("alpha", "beta"))
    for name in after:
        assert after[name]["proxy"] == before[name]["proxy"] + 3, name
        assert after[name]["server"] == before[name]["server"], name
        assert after[name]["mismatch"] == 0 and after[name]["mispredicted"] == 0
