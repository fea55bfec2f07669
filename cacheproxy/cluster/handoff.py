"""A request reaching a proxy that is not its conversation's goes to the one that is.

Design: every proxy of a cluster computes the same owner for a conversation, by rendezvous
hashing of (tenant, conversation key) over the live proxies that hold upstreams, weighted by
how many each holds, read from the lease table. The owner serves every turn, so the
conversation's slot, archive restores and moves all happen in one proxy's slot table, on the
upstreams that proxy holds; any proxy may be called. The receiving proxy forwards the whole
request (body, path, and the client's own key: the owner authenticates it again, meters it and
applies the tenant's limits, shared by every proxy) marked with `X-Cacheproxy-Handoff`, so it
is never handed on twice. If the owner cannot be reached (killed, its lease not yet expired),
the request is served here, on the upstreams this proxy holds, and the owner is not tried for
a lease period.
Hashing rather than a shared record of where each conversation lives: the owner follows from
the request alone (no database write or read per request), and a proxy that joins or leaves
moves only its own share of the conversations.

Isolation holds because a hand-off adds no authority: the owner sees the same request with the
same key, and places it through its own table like any other; every request shape (several
completions, batches, streams, `/v1/messages`, `/v1/responses`) is forwarded whole and split, if
at all, by the owner.

The hand-off header is authenticated: its value is an HMAC-SHA256, under the cluster's secret
(`cluster.secret`, or a random one kept in the shared database), of the request's method,
path and tenant, the sending proxy and the time; a proxy accepts it for
`cluster.handoff_window_s` either way of its own clock. The front door takes the header off every
request before anything reads it (http/front_door.py), so a client's own, forged or replayed
late, is served as if it were absent: handed to the owner like any other, and never sent on to
a server. What the signature does not cover (the body, the other headers) is the client's
own request either way, authenticated again by its key at the owner.

The conversation key is what stays the same across its turns: a client's session header if it
sends one; for chat-like bodies (chat, Anthropic Messages, Responses) the system prompt and the
first other message; for a completion the first `key_prefix_tokens` ids of its prompt (text: 4
characters a token), the first prompt of a batch. A prompt shorter than that on its first turn
is known by a longer prefix on the next, and may change owner once.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from cacheproxy.cluster.keeper import LeaseKeeper, Peer
from cacheproxy.cluster.plan import weighted_score
from cacheproxy.errors import ApiError
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.relay import forward
from cacheproxy.upstreams.spliced_body import FileBody

log = logging.getLogger(__name__)

HANDOFF_HEADER = "X-Cacheproxy-Handoff"
# the header's value on a request that carried one, taken off its headers by the front door
HANDOFF_PROOF = web.RequestKey("handoff_proof", str)
PROOF_VERSION = "v1"
CHARS_PER_TOKEN = 4


def handoff_proof(
    secret: bytes, method: str, path: str, tenant_id: str, sender: str, now: float
) -> str:
    """The hand-off header's value for a request of `tenant_id` sent by proxy `sender`."""
    stamp = str(int(now * 1000))
    return ".".join(
        (PROOF_VERSION, stamp, _mac(secret, method, path, tenant_id, sender, stamp), sender)
    )


def proof_holds(
    secret: bytes,
    proof: str,
    method: str,
    path: str,
    tenant_id: str,
    now: float,
    window_s: float,
) -> bool:
    """Whether `proof` was made with `secret` for this request and tenant, within `window_s`
    of `now` (pure)."""
    version, _, rest = proof.partition(".")
    stamp, _, rest = rest.partition(".")
    mac, _, sender = rest.partition(".")
    if version != PROOF_VERSION or not stamp.isdigit() or not sender:
        return False
    if abs(now - int(stamp) / 1000) > window_s:
        return False
    expected = _mac(secret, method, path, tenant_id, sender, stamp)
    return hmac.compare_digest(mac, expected)


def _mac(secret: bytes, method: str, path: str, tenant_id: str, sender: str, stamp: str) -> str:
    message = "\n".join((method, path, tenant_id, sender, stamp)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _prompt_head(prompt: Any, tokens: int) -> Any:
    """The start of a prompt as it is sent: ids, text, or a batch's first prompt."""
    if isinstance(prompt, str):
        return prompt[: tokens * CHARS_PER_TOKEN]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) for item in prompt[:tokens]):
            return prompt[:tokens]
        return _prompt_head(prompt[0], tokens)  # a batch: it goes whole, by its first prompt
    if isinstance(prompt, dict):  # a multimodal prompt object
        return _prompt_head(prompt.get("prompt_string", prompt.get("prompt")), tokens)
    return prompt


def _first_messages(messages: Any) -> Any:
    """The system messages and the first other one: the same on every turn."""
    if not isinstance(messages, list):
        return messages
    head = []
    for message in messages:
        head.append(message)
        if not (isinstance(message, dict) and message.get("role") in ("system", "developer")):
            break
    return head


def conversation_key(
    tenant_id: str, document: dict, session: str | None, prefix_tokens: int
) -> str:
    """What names the conversation a request continues, for one tenant (pure)."""
    if session:
        part: Any = {"session": session}
    elif "messages" in document:  # chat, Anthropic Messages (its system prompt apart)
        part = [document.get("system"), _first_messages(document.get("messages"))]
    elif "input" in document and ("instructions" in document or "model" in document):
        # Responses (and OAI embeddings, whose input is a prompt)
        given = document.get("input")
        head = (
            _first_messages(given)
            if isinstance(given, list) and given and isinstance(given[0], dict)
            else _prompt_head(given, prefix_tokens)
        )
        part = [document.get("instructions"), head]
    elif "input_prefix" in document or "input_extra" in document:  # infill
        part = [
            document.get("input_extra"),
            _prompt_head(document.get("input_prefix"), prefix_tokens),
        ]
    else:
        given = next(
            (document[name] for name in ("prompt", "input", "content") if name in document), None
        )
        part = _prompt_head(given, prefix_tokens)
    encoded = orjson.dumps([tenant_id, part], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(encoded).hexdigest()


def owner_of(key: str, peers: list[Peer]) -> Peer | None:
    """The proxy that serves the conversation `key`: highest rendezvous score, weighted by the
    upstreams each holds (pure)."""
    return max(
        peers, key=lambda peer: weighted_score(peer.proxy_id, key, peer.upstreams), default=None
    )


class HandOff:
    """Sends a request to its conversation's owner; None when this proxy serves it."""

    def __init__(
        self,
        keeper: LeaseKeeper,
        session: aiohttp.ClientSession,
        prefix_tokens: int,
        metrics: ProxyMetrics,
        secret: bytes,
        window_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keeper = keeper
        self.metrics = metrics
        self.session = session  # connects within the hand-off timeout
        self.prefix_tokens = prefix_tokens
        self.secret = secret  # the cluster's: hand-offs are signed and checked with it
        self.window_s = window_s
        self.clock = clock  # wall-clock: the proxies' clocks agree (NTP)
        self._unreachable: dict[str, float] = {}  # proxy id -> until when it is not tried

    def accepts(self, request: web.Request, tenant_id: str) -> bool:
        """Whether the request was handed here by another proxy of the cluster (its header
        signed for this request and tenant, not stale): it is then served here."""
        proof = request.get(HANDOFF_PROOF)
        if proof is None:
            return False
        now = self.clock()
        if proof_holds(
            self.secret, proof, request.method, request.path, tenant_id, now, self.window_s
        ):
            return True
        self.metrics.handoffs.labels("invalid").inc()
        return False

    def owner(self, tenant_id: str, document: dict, session: str | None) -> Peer | None:
        """The owner when it is another proxy that may be tried, else None."""
        now = time.monotonic()
        peers = [
            peer
            for peer in self.keeper.peers
            if peer.proxy_id == self.keeper.proxy_id
            or self._unreachable.get(peer.proxy_id, 0.0) <= now
        ]
        key = conversation_key(tenant_id, document, session, self.prefix_tokens)
        owner = owner_of(key, peers)
        return None if owner is None or owner.proxy_id == self.keeper.proxy_id else owner

    async def send(
        self, request: web.Request, body: bytes | FileBody, owner: Peer, tenant_id: str
    ) -> web.StreamResponse | None:
        """Forward the whole request to `owner`, signed, and relay its answer; None if it
        could not be reached (the request never got there: serve it here)."""
        proof = handoff_proof(
            self.secret,
            request.method,
            request.path,
            tenant_id,
            self.keeper.proxy_id,
            self.clock(),
        )
        try:
            answer = await forward(
                request,
                self.session,
                Upstream(owner.address),
                body,
                forward_client_key=True,
                extra_headers={HANDOFF_HEADER: proof},
            )
        except ApiError as exc:
            cause = exc.__cause__
            if isinstance(cause, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
                log.warning(
                    "cluster: proxy %s unreachable (%s); serving here", owner.address, cause
                )
                self._unreachable[owner.proxy_id] = time.monotonic() + self.keeper.ttl_s
                self.metrics.handoffs.labels("unreachable").inc()
                return None
            raise
        self.metrics.handoffs.labels("sent").inc()
        return answer
