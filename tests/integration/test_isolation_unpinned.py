"""Tenant isolation for the requests llama-server places itself, or that the proxy cannot mirror:
`/infill`, embeddings, rerank, and tasks that run on a whole upstream (several completions).

As in test_isolation.py, each "the other tenant misses" is paired with the owner's hit, so a
proxy that never reused anything could not pass. Embeddings and rerank reuse nothing themselves
(the server runs them stateless); what they must not do is hand the slots they did not write to
their tenant, whose later completions would then reuse another tenant's text.
"""

from __future__ import annotations

import contextlib
import random
import string
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.provision.make_model import ensure_model
from tests.support.servers import LlamaServer, StartServer, serving_tenants

ADMIN_KEY = "admin-key-for-tests-0123456789"


def ids(seed: int, length: int) -> list[int]:
    """Token ids with no BOS and nothing in common with another seed's."""
    rng = random.Random(seed)
    return [rng.randrange(300, 31000) for _ in range(length)]


@dataclass
class Setup:
    url: str
    server: LlamaServer
    keys: dict[str, str]

    async def post(
        self, http: aiohttp.ClientSession, tenant: str, path: str, body: dict
    ) -> dict | list:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        async with http.post(self.url + path, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def cache_n(self, http: aiohttp.ClientSession, tenant: str, path: str, body: dict) -> int:
        """What the server reused for the request (the most, over several completions)."""
        answer = await self.post(http, tenant, path, body)
        answers = answer if isinstance(answer, list) else [answer]
        return max(item["timings"]["cache_n"] for item in answers)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@contextlib.asynccontextmanager
async def started(
    start_server: StartServer,
    tmp_path: Path,
    parallel: int,
    *server_args: str,
    slot_actions: bool = True,
    fim: bool = True,
) -> AsyncIterator[Setup]:
    server = start_server(
        parallel=parallel,
        model=ensure_model("small", fim=fim),
        extra_args=server_args,
        slot_actions=slot_actions,
    )
    async with serving_tenants(server.url, tmp_path, ADMIN_KEY) as (url, registry):
        keys = {name: registry.create(name)[1] for name in ("alice", "bob")}
        yield Setup(url, server, keys)


async def test_infill_reuses_only_its_tenants_slot(
    http: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """One slot: every infill runs where the previous one ran; only the proxy can isolate.
    The pinned request is the request llama-server would have run: the same prompt, answer."""
    async with started(start_server, tmp_path, 1) as setup:
        infill = {
            "input_prefix": "def area(radius):\n    " + "x = 1\n    " * 60,
            "input_suffix": "\n    return x\n",
            "input_extra": [{"filename": "a.py", "text": "y = 2\n"}],
            "n_predict": 4,
            "temperature": 0,
        }
        async with http.post(setup.server.url + "/infill", json=infill) as response:
            direct = await response.json()
        through = await setup.post(http, "alice", "/infill", infill)
        for field in ("content", "tokens", "tokens_evaluated", "prompt", "stop_type"):
            assert through[field] == direct[field], field
        assert await setup.cache_n(http, "alice", "/infill", infill) > 100
        assert await setup.cache_n(http, "bob", "/infill", infill) == 0
        # the other order, on the slot bob left
        assert await setup.cache_n(http, "bob", "/infill", infill) > 100
        assert await setup.cache_n(http, "alice", "/infill", infill) == 0


async def test_an_infill_the_model_cannot_do_is_refused_as_llama_server_does_and_takes_nothing(
    http: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Without FIM tokens llama-server refuses infill: the proxy answers the same, and the slot
    the refused request was pinned to does not become the requester's."""
    async with started(start_server, tmp_path, 1, fim=False) as setup:
        prompt = {"prompt": ids(11, 300), "n_predict": 2, "temperature": 0}
        await setup.post(http, "alice", "/completion", prompt)
        infill = {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 2}
        async with http.post(setup.server.url + "/infill", json=infill) as response:
            direct = (response.status, await response.json())
        headers = {"Authorization": f"Bearer {setup.keys['bob']}"}
        async with http.post(setup.url + "/infill", json=infill, headers=headers) as response:
            assert (response.status, await response.json()) == direct
        assert direct[0] == 501 and "Infill is not supported" in direct[1]["error"]["message"]
        again = {**prompt, "prompt": ids(11, 300) + ids(12, 8)}
        assert await setup.cache_n(http, "bob", "/completion", again) == 0
        assert await setup.cache_n(http, "bob", "/completion", again) >= 300  # now his own


async def test_infill_returns_to_the_slot_holding_its_file(
    http: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Pinned without its ids, an infill still goes back to the slot its file's prompt is in
    (the same extra context and prefix start), not to the slot that costs least to overwrite."""
    async with started(start_server, tmp_path, 3) as setup:

        def infill(name: str, lines: int, at: int) -> dict:
            prefix = f"# {name}\n" + "".join(f"v{i} = {i}\n" for i in range(lines))
            body = {"input_prefix": prefix + f"w = {at}", "input_suffix": "\n", "n_predict": 2}
            return body | {"temperature": 0}

        await setup.post(http, "alice", "/infill", infill("big.py", 120, 0))
        await setup.post(http, "alice", "/infill", infill("small.py", 10, 0))
        await setup.post(http, "alice", "/infill", infill("other.py", 20, 0))
        # every slot is full now; the big file's is the costliest to overwrite
        assert await setup.cache_n(http, "alice", "/infill", infill("big.py", 120, 1)) > 500
        assert await setup.cache_n(http, "bob", "/infill", infill("big.py", 120, 2)) == 0


@pytest.mark.parametrize(
    ("flag", "path", "body"),
    [
        ("--embeddings", "/embedding", lambda prompt: {"content": prompt}),
        ("--embeddings", "/v1/embeddings", lambda prompt: {"input": [prompt], "model": "m"}),
        ("--reranking", "/rerank", lambda prompt: {"query": "a", "documents": ["b c d"]}),
    ],
    ids=["embedding", "oai-embeddings", "rerank"],
)
async def test_embeddings_and_rerank_take_only_the_slot_they_wrote(
    http: aiohttp.ClientSession,
    start_server: StartServer,
    tmp_path: Path,
    flag: str,
    path: str,
    body: Callable[[list[int]], dict],
) -> None:
    """Alice fills both slots; bob's request overwrites one of them (the server picks). The
    other is still alice's: alice reuses it, and then bob must not."""
    pooling = ("--pooling", "mean") if path == "/v1/embeddings" else ()
    async with started(start_server, tmp_path, 2, flag, *pooling) as setup:
        first, second = ids(1, 300), ids(2, 300)
        complete = {"n_predict": 2, "temperature": 0}
        await setup.post(http, "alice", "/completion", {"prompt": first, **complete})
        await setup.post(http, "alice", "/completion", {"prompt": second, **complete})
        # embeddings land on the slot sharing most with their input (`first`), rerank on the
        # least recently used one (`first` too)
        await setup.post(http, "bob", path, body(first[:200]))
        alice_cached = await setup.cache_n(
            http, "alice", "/completion", {"prompt": second + ids(4, 16), **complete}
        )
        bob_cached = await setup.cache_n(
            http, "bob", "/completion", {"prompt": second + ids(3, 16), **complete}
        )
        assert (bob_cached, alice_cached >= 300) == (0, True)


def words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(count))


SYSTEM = words(10, 300)


def several(question: str) -> tuple[str, dict]:
    """Requests the proxy cannot pin to one slot (on this branch or another), all starting
    with the same long system prompt."""
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {
        "n_cmpl": ("/completion", {"prompt": SYSTEM + question, "n_cmpl": 2, "n_predict": 2}),
        "chat-n2": ("/v1/chat/completions", {"messages": chat, "n": 2, "max_tokens": 2}),
        # both prompts the tenant's own text: a tenant held to one slot by its share runs them
        # there one after the other, and the second's text is what its next request finds
        "batch": (
            "/completion",
            {"prompt": [SYSTEM + question, SYSTEM + question + " again"], "n_predict": 2},
        ),
        "messages": (
            "/v1/messages",
            {"model": "m", "system": SYSTEM, "max_tokens": 2, "messages": chat[1:]},
        ),
        "responses": (
            "/v1/responses",
            {"model": "m", "instructions": SYSTEM, "input": question, "max_output_tokens": 2},
        ),
    }


def reused_of_others(answer: object) -> bool:
    """Nothing of the answer's reused what another tenant left: a batch's prompt that ran on a
    slot after another prompt of the same batch (the routing policy may queue it there) may
    reuse that prompt's text, the request's own; every other task must reuse nothing."""
    if not isinstance(answer, list) or not all(isinstance(item, dict) for item in answer):
        return reused(answer) == 0
    slots_run: set[object] = set()
    for item in answer:
        if item.get("id_slot") not in slots_run and reused(item) != 0:
            return False
        slots_run.add(item.get("id_slot"))
    return True


def reused(answer: object) -> int:
    """The most any cache signal in the answer says was reused."""
    if isinstance(answer, list):
        return max((reused(item) for item in answer), default=0)
    if not isinstance(answer, dict):
        return 0
    found = [reused(value) for value in answer.values()]
    for key in ("cache_n", "cached_tokens", "cache_read_input_tokens"):
        if isinstance(answer.get(key), int):
            found.append(answer[key])
    return max(found, default=0)


@pytest.mark.parametrize("shape", ["n_cmpl", "chat-n2", "batch", "messages", "responses"])
async def test_unpinned_requests_never_reuse_another_tenants_text(
    http: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, shape: str
) -> None:
    """Alice's slot holds the system prompt; bob's request, placed by the server itself, must
    not reuse it; bob's next one reuses his own."""
    async with started(start_server, tmp_path, 2) as setup:
        alice_chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        alice = {"messages": alice_chat, "max_tokens": 2, "temperature": 0}
        await setup.post(http, "alice", "/v1/chat/completions", alice)
        await setup.post(http, "alice", "/completion", {"prompt": SYSTEM + " hi", "n_predict": 2})
        path, body = several(" first question")[shape]
        assert reused_of_others(await setup.post(http, "bob", path, {**body, "temperature": 0}))
        path, body = several(" second question")[shape]
        assert reused(await setup.post(http, "bob", path, {**body, "temperature": 0})) > 200


async def test_without_slot_actions_unpinned_requests_reuse_nothing_at_all(
    http: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """Another tenant's slot cannot be erased: the request goes with `cache_prompt: false`
    where the route reads it."""
    async with started(start_server, tmp_path, 2, slot_actions=False) as setup:
        await setup.post(http, "alice", "/completion", {"prompt": SYSTEM + " hi", "n_predict": 2})
        path, body = several(" first question")["n_cmpl"]
        assert reused(await setup.post(http, "bob", path, {**body, "temperature": 0})) == 0
        path, body = several(" second question")["n_cmpl"]
        assert reused(await setup.post(http, "bob", path, {**body, "temperature": 0})) > 200


@pytest.mark.parametrize("path", ["/responses", "/v1/responses"])
async def test_without_slot_actions_every_spelling_of_a_route_goes_without_the_cache(
    http: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, path: str
) -> None:
    """Both spellings of the Responses route copy `cache_prompt` into the task, so both are
    served with it off, not refused."""
    async with started(start_server, tmp_path, 2, slot_actions=False) as setup:
        await setup.post(http, "alice", "/completion", {"prompt": SYSTEM + " hi", "n_predict": 2})
        question = {"model": "m", "instructions": SYSTEM, "input": " a question", "n": 2}
        answer = await setup.post(http, "bob", path, {**question, "max_output_tokens": 2})
        assert reused(answer) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_several_completions_on_a_whole_upstream_are_charged_for_each(
    http: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path, stream: bool
) -> None:
    """An infill of two completions runs on a whole upstream, answered as a list of both (or
    one stream of both): its tenant is charged both tasks' prompts and generated tokens, as
    for two infills of one completion each."""
    async with started(start_server, tmp_path, 2) as setup:
        infill = {
            "input_prefix": "def total(values):\n    return",
            "input_suffix": "\n",
            "n_predict": 10,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
        for tenant, count in (("alice", 1), ("bob", 2)):
            headers = {"Authorization": f"Bearer {setup.keys[tenant]}"}
            body = {**infill, "n_cmpl": count}
            async with http.post(setup.url + "/infill", json=body, headers=headers) as response:
                assert response.status == 200, await response.text()
                await response.read()
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with http.get(setup.url + "/admin/tenants", headers=admin) as response:
            names = {tenant["id"]: tenant["name"] for tenant in (await response.json())["tenants"]}
        query = {"group_by": "tenant"}
        async with http.get(setup.url + "/admin/usage", params=query, headers=admin) as response:
            rows = {names[row["tenant_id"]]: row for row in (await response.json())["rows"]}
    alice, bob = rows["alice"], rows["bob"]
    assert alice["generated_tokens"] == 10
    assert bob["generated_tokens"] == 2 * alice["generated_tokens"]
    assert bob["prompt_tokens"] == 2 * alice["prompt_tokens"]
