"""The token mirror: the ids llama-server will hold, asked of llama-server, memoised per tenant."""

from __future__ import annotations

import aiohttp
import pytest

from cacheproxy.provision.make_model import ensure_model
from cacheproxy.slots.mirror import NotMirrorable, TokenMirror, prompt_shape
from cacheproxy.slots.prompt_bounds import RequestRejected, text_token_ceiling
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.pool import Upstream
from tests.support.servers import LlamaServer, StartServer

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


LEARNT_BODIES = [
    {"messages": [{"role": "user", "content": "Hello there"}], "n_predict": 1},
    {
        "messages": [
            {"role": "system", "content": "Be brief.\n"},
            {"role": "user", "content": "  What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3, in 日本語?"},
        ],
        "temperature": 0,
    },
]


async def test_a_learnt_template_gives_the_servers_own_tokens(
    client: aiohttp.ClientSession, llama_server: LlamaServer
) -> None:
    mirror = TokenMirror(client, connections=UpstreamConnections(5.0, 60.0))
    url, upstream = llama_server.url, Upstream(llama_server.url)
    name = mirror.template_name(upstream)
    assert mirror.templates.render(name, LEARNT_BODIES[0]) is None  # learning starts
    assert await mirror.templates.learnt(name) is not None
    for body in LEARNT_BODIES:
        served = await mirror._post(upstream, "/apply-template", body)
        assert mirror.templates.render(name, body) == served["prompt"]
        tokens = await mirror.prompt_tokens("chat", body, upstream, "t")
        answer_body = {**body, "n_predict": 1, "cache_prompt": False, "verbose": True}
        async with client.post(url + "/v1/chat/completions", json=answer_body) as response:
            answer = await response.json()
        assert answer["__verbose"]["tokens_evaluated"] == len(tokens)
    assert mirror.templates.rendered >= len(LEARNT_BODIES)
    # what else changes the text is the server's to render
    kwargs = {**LEARNT_BODIES[0], "chat_template_kwargs": {"x": 1}}
    assert mirror.templates.render(name, kwargs) is None
    await mirror.aclose()


CUT_CONVERSATION = [
    ("system", "You are a careful assistant.\nAnswer briefly, in plain words."),
    ("user", "  What is 2 + 2?  "),
    ("assistant", "\nIt is 4.\n"),
    ("user", "And in Ελληνικά, 日本語 — please?\n\n"),
    ("assistant", "Τέσσερα. 四。"),
    ("user", "third question, { braces } and 'quotes' \"too\" <| and |>"),
]


# a slot's context as the proxy passes it: every turn fits, though four ids a character (the
# bound that needs no tokenizing) would not
N_CTX = 512


async def mirror_the_conversation(
    mirror: TokenMirror,
    client: aiohttp.ClientSession,
    upstream: Upstream,
    tenant: str,
    fields: dict | None = None,
) -> None:
    """`tenant` sends `CUT_CONVERSATION` turn by turn (each body with `fields` too): each
    prompt the mirror makes must be the server's `/tokenize` of its `/apply-template`, and as
    long as the server counts it."""
    for turns in range(2, len(CUT_CONVERSATION) + 1, 2):
        messages = [{"role": role, "content": text} for role, text in CUT_CONVERSATION[:turns]]
        body = {"messages": messages, "temperature": 0, **(fields or {})}
        tokens = await mirror.prompt_tokens("chat", body, upstream, tenant, N_CTX)
        text = (await mirror._post(upstream, "/apply-template", body))["prompt"]
        assert len(tokens) < N_CTX
        if turns > 2:
            assert text_token_ceiling(text) > N_CTX  # the bound alone would not have done
        request = {"content": text, "add_special": True, "parse_special": True}
        assert tokens == (await mirror._post(upstream, "/tokenize", request))["tokens"]
        answer_body = {**body, "n_predict": 1, "cache_prompt": False, "verbose": True}
        route = upstream.base_url + "/v1/chat/completions"
        async with client.post(route, json=answer_body) as response:
            answer = await response.json()
        assert answer["__verbose"]["tokens_evaluated"] == len(tokens)


async def refuse_a_turn_over_the_context(
    mirror: TokenMirror, upstream: Upstream, tenant: str, fields: dict | None = None
) -> None:
    """A next turn of the conversation (each body with `fields` too) too long for the slot:
    refused as llama-server refuses it (its count the server's), though what comes before it
    is remembered, and nothing of it is remembered."""
    messages = [{"role": role, "content": text} for role, text in CUT_CONVERSATION]
    messages.append({"role": "assistant", "content": "Fine."})
    messages.append({"role": "user", "content": " ".join(["many words"] * N_CTX)})
    body = {"messages": messages, **(fields or {})}
    remembered = len(mirror.memo)
    with pytest.raises(RequestRejected) as refused:
        await mirror.prompt_tokens("chat", body, upstream, tenant, N_CTX)
    text = (await mirror._post(upstream, "/apply-template", body))["prompt"]
    request = {"content": text, "add_special": True, "parse_special": True}
    counted = len((await mirror._post(upstream, "/tokenize", request))["tokens"])
    assert counted >= N_CTX
    assert refused.value.fields == {"n_prompt_tokens": counted, "n_ctx": N_CTX}
    assert len(mirror.memo) == remembered


@pytest.mark.parametrize("in_process", [True, False], ids=["proxy-tokenizes", "server-tokenizes"])
async def test_a_chat_cut_at_its_special_tokens_gives_the_servers_own_ids(
    client: aiohttp.ClientSession, start_server: StartServer, in_process: bool
) -> None:
    server = start_server(model=ensure_model("small", chat_tokens=True))
    mirror = TokenMirror(
        client, connections=UpstreamConnections(5.0, 60.0), tokenize_in_process=in_process
    )
    upstream = Upstream(server.url)
    name = mirror.template_name(upstream)
    assert mirror.templates.render(name, LEARNT_BODIES[0]) is None  # learning starts
    template = await mirror.templates.learnt(name)
    assert template is not None and template.cuts  # its markers are control tokens
    assert await mirror.local.proven(upstream) == in_process
    for tenant in ("a", "b"):
        await mirror_the_conversation(mirror, client, upstream, tenant)
        if tenant == "a":
            # each turn tokenized only its new segments: the system's and the end's came back
            assert mirror.segments_reused >= 4
            reused = mirror.segments_reused
    # another tenant's segments were tokenized afresh: it found none of the first one's
    assert mirror.segments_reused - reused == reused
    assert (mirror.tokenized_here > 0) == in_process
    await refuse_a_turn_over_the_context(mirror, upstream, "a")
    await mirror.aclose()


async def test_a_chat_with_no_cuts_is_tokenized_from_its_remembered_head(
    client: aiohttp.ClientSession, llama_server: LlamaServer
) -> None:
    """The default test model has no chat markers among its tokens: its template cannot be cut,
    so each turn is tokenized from where the last one left off (resumed_tokens.py), and must
    still be the server's own ids."""
    mirror = TokenMirror(client, connections=UpstreamConnections(5.0, 60.0))
    upstream = Upstream(llama_server.url)
    name = mirror.template_name(upstream)
    assert mirror.templates.render(name, LEARNT_BODIES[0]) is None  # learning starts
    template = await mirror.templates.learnt(name)
    assert template is not None and not template.cuts
    assert await mirror.local.proven(upstream)
    for tenant in ("a", "b"):
        resumed_before = mirror.resumed.resumed
        await mirror_the_conversation(mirror, client, upstream, tenant)
        # the first turn is tokenized whole, each later one from the turn before (a tenant
        # finds nothing another one left)
        assert mirror.resumed.resumed - resumed_before == len(CUT_CONVERSATION) // 2 - 1
    assert mirror.resumed.declined == 0
    resumed = mirror.resumed.resumed
    await refuse_a_turn_over_the_context(mirror, upstream, "a")
    assert mirror.resumed.resumed == resumed + 1  # taken up from its head, then refused
    await mirror.aclose()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read one file of the project.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


async def test_a_chat_the_server_renders_is_tokenized_from_where_its_last_turn_left_off(
    client: aiohttp.ClientSession, llama_server: LlamaServer
) -> None:
    """A chat with tools is rendered by the server (no learnt template renders tools), but its
    text grows turn by turn all the same: each turn is tokenized from where the one before left
    off (per tenant), and must still be the server's own ids."""
    mirror = TokenMirror(client, connections=UpstreamConnections(5.0, 60.0))
    upstream = Upstream(llama_server.url)
    assert await mirror.local.proven(upstream)
    for tenant in ("a", "b"):
        resumed_before = mirror.resumed.resumed
        await mirror_the_conversation(mirror, client, upstream, tenant, {"tools": TOOLS})
        # the first turn tokenized whole, each later one from the turn before (a tenant finds
        # nothing another one left)
        assert mirror.resumed.resumed - resumed_before == len(CUT_CONVERSATION) // 2 - 1
    assert mirror.resumed.declined == 0
    assert mirror.templates.rendered == 0  # every turn was the server's to render
    resumed = mirror.resumed.resumed
    await refuse_a_turn_over_the_context(mirror, upstream, "a", {"tools": TOOLS})
    assert mirror.resumed.resumed == resumed + 1  # taken up from the last turn, then refused
    await mirror.aclose()


async def test_a_growing_text_prompt_is_tokenized_from_where_the_last_one_left_off(
    client: aiohttp.ClientSession, llama_server: LlamaServer
) -> None:
    """A conversation a client templates itself grows one text prompt turn by turn: each is
    taken up from the end of the one before (per tenant), and must still be the server's ids."""
    mirror = TokenMirror(client, connections=UpstreamConnections(5.0, 60.0))
    upstream = Upstream(llama_server.url)
    assert await mirror.local.proven(upstream)
    for tenant in ("a", "b"):
        resumed_before = mirror.resumed.resumed
        text = ""
        for role, words in CUT_CONVERSATION:
            text += f"{role}: {words}\n"
            tokens = await mirror.prompt_tokens(
                "completion", {"prompt": text}, upstream, tenant, N_CTX
            )
            request = {"content": text, "add_special": True, "parse_special": True}
            assert tokens == (await mirror._post(upstream, "/tokenize", request))["tokens"]
        # the first turn tokenized whole, each later one from the turn before (a tenant finds
        # nothing another one left)
        assert mirror.resumed.resumed - resumed_before == len(CUT_CONVERSATION) - 1
    assert mirror.resumed.declined == 0
    # a text over the context, though it starts with a remembered one: refused, not remembered
    remembered = len(mirror.memo)
    with pytest.raises(RequestRejected):
        long_text = text + " ".join(["many words"] * N_CTX)
        await mirror.prompt_tokens("completion", {"prompt": long_text}, upstream, "a", N_CTX)
    assert len(mirror.memo) == remembered
    await mirror.aclose()
