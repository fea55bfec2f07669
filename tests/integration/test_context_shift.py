"""A server started with `--context-shift` drops part of a slot's text once a generation fills
its context: the table must not claim to know what the slot holds then."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import load_settings
from tests.support.metrics import sample
from tests.support.servers import StartServer, serving


@pytest.mark.parametrize(
    ("path", "stream"), [("/completion", False), ("/completion", True), ("/v1/completions", True)]
)
async def test_a_shifted_context_is_not_taken_for_the_text_sent(
    client: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    path: str,
    stream: bool,
) -> None:
    """The native answer says `truncated`; an OpenAI stream does not, but its prompt and
    generated tokens filled the slot's context."""
    server = start_server(parallel=1, ctx_size=512, extra_args=("--context-shift",))
    prompt = [random.Random(7).randrange(300, 31000) for _ in range(400)]
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app):
        body = {
            "prompt": prompt,
            "n_predict": 200,
            "max_tokens": 200,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
        async with client.post(url + path, json=body) as response:
            assert response.status == 200
            await response.read()
        [slot] = app[CACHE].tables[0].slots
        # what it holds past the part it kept is not known: nothing is claimed exactly
        assert slot.unknown_tail != 0
        # the conversation's next turn: what the server reuses is within what was predicted
        follow = {**body, "n_predict": 2, "max_tokens": 2, "stream": False}
        async with client.post(url + path, json=follow) as response:
            assert response.status == 200
        assert sample(app, "cacheproxy_predictions_total", result="mismatch") == 0
