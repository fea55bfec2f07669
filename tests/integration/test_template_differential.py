"""The token mirror against llama-server, differentially: every real chat template of the pinned
tree (`models/templates`) served by a real llama-server, conversations made of the pinned tree's
tokenizer test strings (`models/ggml-vocab-*.gguf.inp`: empty and blank texts, runs of spaces,
tabs and newlines, accents, CJK, emoji, code), and for each the ids the mirror makes (a learnt
template's rendering, tokenized in memoised segments cut at its special tokens) must be the ids
the server makes of its own rendering. Where the mirror learns no template it asks the server
(nothing of its own to check); the common concatenative ones must be learnt.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.provision.make_model import ensure_model
from cacheproxy.slots.mirror import TokenMirror
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.pool import Upstream
from tests.support.servers import StartServer
from tests.support.vocab_cases import SOURCE, tokenizer_cases

pytestmark = pytest.mark.integration

TEMPLATES = sorted((SOURCE / "models" / "templates").glob("*.jinja"))
ROLES = ("system", "user", "assistant", "user", "assistant", "user")
# templates the mirror renders itself (ChatML, Phi, Gemma, Granite, Hermes): a change that
# stops it learning them is a loss to see, not a pass with nothing compared
MUST_LEARN = frozenset(
    {
        "Qwen-Qwen2.5-7B-Instruct",
        "microsoft-Phi-3.5-mini-instruct",
        "google-gemma-4-31B-it",
        "ibm-granite-granite-4.0",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    }
)


def conversations(cases: list[str]) -> list[list[dict[str, str]]]:
    """Every case in some conversation, each conversation grown turn by turn (as a client
    sends it): a system prompt, then users and assistants in turn, texts taken in order."""
    texts = itertools.cycle(cases)
    chats = []
    for _ in range(0, len(cases), len(ROLES)):
        messages = [{"role": role, "content": next(texts)} for role in ROLES]
        chats += [messages[:turns] for turns in (2, 4, 6)]
    return chats


def test_the_pinned_tree_has_templates_and_tokenizer_cases() -> None:
    assert len(TEMPLATES) >= 40
    assert MUST_LEARN <= {path.stem for path in TEMPLATES}
    cases = tokenizer_cases()
    assert len(cases) >= 40
    assert "" in cases and any("\n\n" in case for case in cases)


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.stem)
async def test_mirrored_chat_ids_are_the_servers_for_every_real_template(
    template: Path,
    client: aiohttp.ClientSession,
    start_server: StartServer,
) -> None:
    server = start_server(
        model=ensure_model("small", chat_tokens=True),
        parallel=1,
        ctx_size=4096,
        extra_args=("--jinja", "--chat-template-file", str(template)),
    )
    upstream = Upstream(server.url)
    mirror = TokenMirror(client, connections=UpstreamConnections(5.0, 60.0))
    try:
        name = mirror.template_name(upstream)
        first = {"messages": conversations(tokenizer_cases())[0]}
        mirror.templates.render(name, first)  # learning starts
        learnt = await mirror.templates.learnt(name)
        assert learnt is not None or template.stem not in MUST_LEARN
        if learnt is None:
            return  # every chat is the server's to render and tokenize: nothing to compare
        for messages in conversations(tokenizer_cases()):
            body = {"messages": messages}
            try:
                rendered = await mirror._post(upstream, "/apply-template", body)
            except Exception:  # the template refuses this conversation (its roles, a blank)
                continue
            tokenize = {"content": rendered["prompt"], "add_special": True, "parse_special": True}
            expected = (await mirror._post(upstream, "/tokenize", tokenize))["tokens"]
            assert await mirror.prompt_tokens("chat", body, upstream, "t") == expected, messages
        assert mirror.templates.rendered > 0  # the mirror's own renderings were compared
    finally:
        await mirror.aclose()
