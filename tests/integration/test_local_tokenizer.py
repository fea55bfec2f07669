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
from tests.support.servers import LlamaServer, StartServer, serving
from tests.support.vocab_cases import SOURCE
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


def proven(app: web.Application, upstream: str) -> float:
    """How many times `upstream`'s model was proven (once a process)."""
    return sample(app, "cacheproxy_tokenizer_verdicts_total", upstream=upstream, verdict="proven")


async def test_a_server_back_with_another_model_is_proven_afresh(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Proven, then the server restarts on the same address with a model whose vocabulary does
    not hold the chat markers as control tokens: the restart is seen, that model's own file is
    proven anew, and no prompt is made with the vocabulary of the model before (no answer
    counted otherwise, none sent back to /tokenize for good)."""
    server = start_server(model=ensure_model(**CHAT_MODEL), parallel=1)
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        assert await settled(app, client, url)
        server.stop()
        start_server(model=ensure_model("small"), parallel=1, port=server.port)
        # the first request finds the restart (`routing.recheck_idle_s`) before it is mirrored
        await proxied_requests(client, url, 1)
        await wait_for(lambda: proven(app, server.url) == 2, "the new process proven")
        before = counts(app, server.url)
        for turn in range(2, 5):
            body = {"prompt": f"<|im_start|>user\nturn {turn}<|im_end|>\n", "n_predict": 1}
            async with client.post(url + "/completion", json=body) as response:
                assert response.status == 200, await response.text()
        after = counts(app, server.url)
        mirror = app[CACHE].mirror
    assert after["proxy"] == before["proxy"] + 3  # tokenized here, with the new model's file
    assert after["mispredicted"] == 0
    assert mirror.count_mismatches == 0  # every prompt counted as the proxy made it


async def test_a_server_back_with_another_chat_template_has_it_learnt_afresh(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """The template learnt from a server serving Phi-3.5's is not used for the process that
    comes back at its address serving Qwen2.5's (two of the pinned tree's templates the proxy
    renders itself): every chat's prompt is counted as the proxy made it, and the new template
    is learnt and rendered here."""

    def serving_template(stem: str, port: int | None = None) -> LlamaServer:
        template = SOURCE / "models" / "templates" / f"{stem}.jinja"
        args = ("--jinja", "--chat-template-file", str(template))
        return start_server(parallel=1, extra_args=args, port=port)

    server = serving_template("microsoft-Phi-3.5-mini-instruct")
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        mirror = app[CACHE].mirror
        await settled(app, client, url)
        name = mirror.template_name(app[CACHE].tables[0].upstream)
        assert await mirror.templates.learnt(name) is not None
        server.stop()
        serving_template("Qwen-Qwen2.5-7B-Instruct", server.port)
        rendered = mirror.templates.rendered
        # the first request finds the restart (`routing.recheck_idle_s`) before it is mirrored
        for turn in range(1, 5):
            await proxied_requests(client, url, turn)
            assert await mirror.templates.learnt(name) is not None
    assert mirror.count_mismatches == 0
    assert mirror.templates.rendered > rendered  # the new template, learnt


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


async def test_a_server_back_with_another_model_gets_its_texts_tokenized_afresh(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """The server tokenizes (the proxy's own tokenizer off), then restarts on the same address
    with a model that tokenizes the chat markers otherwise: a text sent before the restart is
    not given its memoised ids again, so after the first answer the predictions are exact."""
    server = start_server(model=ensure_model(**CHAT_MODEL), parallel=1)
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        routing={"tokenize_in_process": False},
    )
    body = {"prompt": "<|im_start|>user\nthe same text every time<|im_end|>\n", "n_predict": 1}
    async with serving(settings) as (url, app):
        for _ in range(2):
            async with client.post(url + "/completion", json=body) as response:
                assert response.status == 200, await response.text()
        server.stop()
        start_server(model=ensure_model("small"), parallel=1, port=server.port)
        before = counts(app, server.url)
        for _ in range(4):
            async with client.post(url + "/completion", json=body) as response:
                assert response.status == 200, await response.text()
        after = counts(app, server.url)
    # the first answer may find the memo and the table stale; none after it
    assert after["mismatch"] - before["mismatch"] <= 1
