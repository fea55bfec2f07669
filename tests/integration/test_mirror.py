"""The token mirror: the ids llama-server will hold, asked of llama-server, memoised per tenant."""

from __future__ import annotations

import aiohttp
import pytest

from cacheproxy.slots.mirror import NotMirrorable, TokenMirror, prompt_shape
from cacheproxy.upstreams.pool import Upstream
from tests.support.servers import LlamaServer

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "n_predict": 1}


async def test_mirrored_tokens_are_what_the_server_caches(
    client: aiohttp.ClientSession, llama_server: LlamaServer
) -> None:
    mirror = TokenMirror(client)
    for kind, body in (("completion", {"prompt": "The sky is"}), ("chat", CHAT)):
        tokens = await mirror.prompt_tokens(kind, body, Upstream(llama_server.url), "t")
        route = "/completion" if kind == "completion" else "/v1/chat/completions"
        answer_body = {**body, "n_predict": 1, "cache_prompt": False, "verbose": True}
        async with client.post(llama_server.url + route, json=answer_body) as response:
            answer = await response.json()
        assert answer.get("__verbose", answer)["tokens_evaluated"] == len(tokens)
        assert tokens[0] == 1  # BOS is added, as the server adds it
    assert await mirror.prompt_tokens(
        "completion", {"prompt": [5, 6]}, Upstream(llama_server.url), "t"
    ) == [
        5,
        6,
    ]


async def test_memo_is_per_tenant(client: aiohttp.ClientSession, llama_server: LlamaServer) -> None:
    mirror = TokenMirror(client)
    first = await mirror.prompt_tokens("chat", CHAT, Upstream(llama_server.url), "a")
    assert await mirror.prompt_tokens("chat", CHAT, Upstream(llama_server.url), "a") == first
    assert mirror.memo_hits == 1
    assert await mirror.prompt_tokens("chat", CHAT, Upstream(llama_server.url), "b") == first
    assert mirror.memo_hits == 1  # another tenant's identical text is looked up afresh


@pytest.mark.parametrize(
    ("prompt", "shape"),
    [([1, 2, 3], "ids"), ("text", "text"), (["text"], "text"), (["text", 5, 6], "text")],
)
def test_prompt_shapes(prompt: object, shape: str) -> None:
    assert prompt_shape(prompt) == shape


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]], [True, 1], [], None, [{"x": 1}]])
def test_batches_and_odd_prompts_are_not_mirrored(prompt: object) -> None:
    with pytest.raises(NotMirrorable):
        prompt_shape(prompt)
