"""How each task route is placed on a slot: which routes are mirrored and how, the agent APIs run
as the chat request llama-server converts them to, the routes answered in a shape of their own,
and the routes pinned without known prompt ids."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from cacheproxy.apis import anthropic_answers
from cacheproxy.apis.observe import ShownReuse, TaskObserver
from cacheproxy.apis.responses_answer import ResponsesObserver
from cacheproxy.slots.mirror import RouteKind
from cacheproxy.upstreams.relay import ResponseObserver

# How much of an infill's prefix text its affinity key covers: the FIM layout starts with the
# extra chunks and then the prefix (format_prompt_infill), so two requests that agree on both
# share their first tokens, as an editor's requests on one file do while the user types.
INFILL_KEY_CHARS = 256

# route -> (how its tokens are mirrored, whether its answer is in OpenAI form)
MIRRORED_ROUTES: dict[str, tuple[RouteKind, bool]] = {
    "/completion": ("completion", False),
    "/completions": ("completion", False),
    "/v1/completions": ("completion", True),
    "/chat/completions": ("chat", True),
    "/v1/chat/completions": ("chat", True),
    "/v1/messages": ("chat", True),  # run as its chat request: see AGENT_APIS
    "/responses": ("responses", True),
    "/v1/responses": ("responses", True),
}
CHAT_ROUTE = "/v1/chat/completions"
# routes whose answers have a shape of their own, and what reads it (default: TaskObserver)
ANSWER_OBSERVERS: dict[str, type[TaskObserver]] = {
    "/responses": ResponsesObserver,
    "/v1/responses": ResponsesObserver,
}


@dataclass(frozen=True)
class AgentApi:
    """A route llama-server serves by converting its body to a chat request: the proxy converts
    it the same way, runs the chat request on a pinned slot like any other, and shows the chat
    answer in the route's own form (cacheproxy/apis/)."""

    chat_request: Callable[[dict], dict]  # raises ApiError where the server refuses the body
    # (the chat observer, whether cache signals are hidden, how they are shown otherwise)
    observer: Callable[[TaskObserver, bool, ShownReuse | None], ResponseObserver]


AGENT_APIS: dict[str, AgentApi] = {
    "/v1/messages": AgentApi(
        anthropic_answers.chat_request_to_render, anthropic_answers.AnthropicObserver
    ),
}
# Routes pinned to one slot although their prompt ids are not mirrored: llama-server lays out
# the prompt itself (`/infill`: format_prompt_infill, with FIM token ids the proxy cannot read
# over HTTP) but reads `id_slot` (handle_completions_impl). The slot is recorded as the tenant's,
# holding as many unnamed tokens as the server reports.
OPAQUE_ROUTES = frozenset({"/infill"})


# Routes whose body reaches the task's parameters whole, `cache_prompt` included
# (handle_completions_impl; the Responses converter copies every field, server-chat.cpp): the
# mirrored ones llama-server does not rebuild from a converted body, and the opaque ones.
CACHE_PROMPT_ROUTES = frozenset(MIRRORED_ROUTES.keys() - AGENT_APIS.keys()) | OPAQUE_ROUTES


def infill_affinity_key(document: dict) -> str:
    """A key of how an infill prompt starts: its extra context and the start of its prefix."""
    start = orjson.dumps(
        [document.get("input_extra"), str(document.get("input_prefix", ""))[:INFILL_KEY_CHARS]]
    )
    return "infill:" + hashlib.blake2b(start, digest_size=12).hexdigest()


# Routes whose tasks reuse no cached prefix at all (server-context.cpp `is_stateless_task`).
STATELESS_ROUTES = frozenset(
    {
        "/embedding",
        "/embeddings",
        "/v1/embeddings",
        "/rerank",
        "/reranking",
        "/v1/rerank",
        "/v1/reranking",
    }
)
