"""The exact token ids llama-server will cache for a request, obtained from llama-server itself.

- A prompt of token ids is used verbatim (no BOS added).
- A string prompt, or a mixed array starting with a string, is tokenized with BOS added and
  special tokens parsed: `POST /tokenize` with `add_special` and `parse_special`. A string
  that starts with one of the tenant's latest string prompts is tokenized from where that one
  left off, as a chat's head is (resumed_tokens.py).
- A chat body goes through `POST /apply-template` (the same parser chat completions use, so tools
  and template kwargs count), and the templated text is then tokenized as a string prompt
  (from where the conversation's last rendered text left off, as a text prompt is). A
  plain chat (messages of text, nothing else that changes the prompt) is rendered here once the
  server's template has been learnt from its own renderings (chat_template.py), and tokenized
  in segments cut before the joints that start with a special token (template_cuts.py): the
  segments seen before (a system prompt, a conversation's earlier turns) are not sent again.
  A template with no such joints has its prompts tokenized from where an earlier prompt with
  the same head left off, a few tokens back (resumed_tokens.py).
- A Responses body is first converted to the chat body llama-server makes of it
  (cacheproxy/apis/responses.py), then mirrored as chat.
- Text is tokenized in the proxy instead, with the upstream's own model file, once that is
  proven to give the server's ids (local_tokenizer.py); `/tokenize` until then, or for good.

Results are memoised by a hash of what determines them (token_memo.py), so a retried request
costs nothing; the memo is bounded in bytes, and a prompt the server would refuse (over the
context) is not kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Literal

import aiohttp
import orjson
from yarl import URL

from cacheproxy.apis.responses import responses_to_chat
from cacheproxy.errors import ApiError
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.slots.chat_template import LearntTemplate, TemplatesOfUpstreams
from cacheproxy.slots.local_tokenizer import InProcessTokenizers, Verdict, Vocabulary
from cacheproxy.slots.prompt_bounds import exceeds_context, text_token_ceiling
from cacheproxy.slots.resumed_tokens import ResumedTokens
from cacheproxy.slots.template_cuts import learn_cuts
from cacheproxy.slots.token_memo import DEFAULT_MEMO_BYTES, MemoKeys, MemoOfTokens
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.http1 import Answer
from cacheproxy.upstreams.pool import Upstream

RouteKind = Literal["completion", "chat", "responses"]

TOKENIZE_READ_CHUNK = 1 << 16


class NotMirrorable(Exception):
    """The request's tokens cannot be reproduced exactly (a batch of prompts, for example)."""


def prompt_shape(prompt: Any) -> Literal["ids", "text"]:
    """Classify a completion `prompt` as llama-server's tokenize_input_prompts would read it."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, list) and prompt:
        if set(map(type, prompt)) == {int}:  # C-speed over long prompts; bool is not int here
            return "ids"
        if isinstance(prompt[0], str) and all(
            isinstance(item, int | str) and not isinstance(item, bool) for item in prompt
        ):
            if len(prompt) == 1 or any(isinstance(item, int) for item in prompt):
                return "text"  # a single string, or a mixed array: one prompt
    raise NotMirrorable("a batch of prompts, or a prompt of an unknown shape")


class TokenMirror:
    """`connections`: the lean client the mirror's round trips go over (a plain-http upstream);
    without it, or for https, aiohttp's `session` (twice the CPU a round trip).
    `tokenize_in_process`: text is tokenized here where proven identical (local_tokenizer.py).
    `metrics`: where tokenizations (here or by the server) and the tokenizers' verdicts count."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        upstream_headers: dict[str, str] | None = None,
        memo_bytes: int = DEFAULT_MEMO_BYTES,
        connections: UpstreamConnections | None = None,
        tokenize_in_process: bool = True,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.session = session
        self.connections = connections
        self.headers = {"Content-Type": "application/json", **(upstream_headers or {})}
        self._urls: dict[tuple[str, str], URL] = {}  # parsed once per upstream and route
        self._upstreams: dict[str, Upstream] = {}  # by name, as the templates know them
        self.templates = TemplatesOfUpstreams(
            lambda name: self._request(self._upstreams[name], "GET", "/props", None),
            lambda name, body: self._post(self._upstreams[name], "/apply-template", body),
            self._with_cuts,
        )
        self.metrics = metrics
        self.local = InProcessTokenizers(
            tokenize_in_process,
            lambda upstream: self._request(upstream, "GET", "/props", None),
            self._server_tokenize_text,
            self._count_verdict,
        )
        self.tokenized_here = 0  # texts tokenized in the proxy
        self.tokenized_by_server = 0  # texts sent to the server's /tokenize
        self.memo = MemoOfTokens(memo_bytes)
        self.resumed = ResumedTokens(self.memo)
        self.memo_keys = MemoKeys()
        self.lookups = 0
        self.memo_hits = 0
        self.count_mismatches = 0  # answers whose prompt length was not the mirrored one
        # segments of chats cut where they tokenize apart: sent to the server, found in the memo
        self.segments_tokenized = 0
        self.segments_reused = 0
        # server processes seen at each upstream, and its name in the memo's keys once it has
        # restarted: ids made for a process that is gone are not found for the next
        self._processes_seen: dict[str, int] = {}
        self._process_names: dict[str, str] = {}

    async def prompt_tokens(
        self, kind: RouteKind, body: dict, upstream: Upstream, tenant: str, n_ctx: int | None = None
    ) -> list[int]:
        """The ids `upstream` will hold for this request's prompt (each model tokenizes its
        own way: the memo keeps them apart).

        The memo is per tenant: a hit skips two round trips, and one tenant must not be able
        to time whether another sent the same text. A prompt of `n_ctx` tokens or more raises
        RequestRejected (llama-server's exceed_context_size_error) and is not memoised.
        """
        if kind == "completion":
            prompt = body.get("prompt")
            if prompt_shape(prompt) == "ids":
                return list(prompt)
            return await self._memoised(
                (tenant, self._process_name(upstream), "text", prompt),
                lambda: self._text_tokens(prompt, upstream, tenant, n_ctx),
            )
        if kind == "responses":
            # the chat body llama-server runs it as; raises its 400 for what it refuses
            body = responses_to_chat(body)
        return await self._memoised(
            (tenant, self._process_name(upstream), "chat", body),
            lambda: self._chat_tokens(body, upstream, tenant, n_ctx),
        )

    async def mixed_tokens(
        self, content: Any, upstream: Upstream, tenant: str, n_ctx: int | None = None
    ) -> list[int]:
        """The ids of `content` (a string, or an array of strings and ids) as llama-server's
        tokenize_mixed makes them for a prompt: BOS when it starts with a string. Memoised as
        `prompt_tokens` memoises text."""
        if isinstance(content, list) and set(map(type, content)) <= {int}:
            return list(content)  # ids are taken as they are (checked with the body)
        return await self._memoised(
            (tenant, self._process_name(upstream), "text", content),
            lambda: self._tokenize(content, upstream, n_ctx),
        )

    async def _memoised(self, key_source: Any, compute: Any) -> list[int]:
        self.lookups += 1
        key = await self.memo_keys.key(key_source)
        cached = self.memo.get(key)
        if cached is not None:
            self.memo_hits += 1
            return cached
        tokens = await compute()  # raises for a prompt the server would refuse: nothing stored
        self.memo.put(key, tokens)
        return tokens

    def answered(self, upstream: Upstream, prompt_length: int, server_count: int) -> bool:
        """`upstream` counted `server_count` prompt tokens (cache_n + prompt_n) for a prompt
        mirrored as `prompt_length`: where they differ (False), what the mirror makes itself is
        not trusted for that upstream (its template is learnt again, its text is tokenized by
        the server)."""
        if server_count == prompt_length:
            return True
        self.count_mismatches += 1
        self.templates.forget(upstream.name)
        if self.local.distrust(upstream):
            # ids made here may be memoised: none of them is trusted any more
            self.memo.clear()
        return False

    def upstream_started(self, upstream: Upstream) -> None:
        """A server process first seen at `upstream` (the monitor's: at start, after a
        restart). It may run another model than the one before: its prompts are tokenized
        afresh (the ids made for the one before are not found for it), its template is learnt
        again, and the proxy's own tokenizer proven again; proven now, before requests come."""
        name = upstream.name
        seen = self._processes_seen.get(name, 0)
        self._processes_seen[name] = seen + 1
        if seen:
            self._process_names[name] = f"{name}\n{seen}"
            self.templates.restarted(self.template_name(upstream))
            self.local.restarted(upstream)
        self.local.vocabulary(upstream)

    def _process_name(self, upstream: Upstream) -> str:
        """How the memo's keys name `upstream`: after a restart, with the restart's count."""
        return self._process_names.get(upstream.name, upstream.name)

    def template_name(self, upstream: Upstream) -> str:
        """How `self.templates` knows `upstream` (by name: a router's models share its URL)."""
        self._upstreams[upstream.name] = upstream
        return upstream.name

    async def aclose(self) -> None:
        await self.templates.aclose()
        await self.local.aclose()

    async def _text_tokens(
        self,
        prompt: Any,
        upstream: Upstream,
        tenant: str,
        n_ctx: int | None,
        kind: Literal["text", "rendered"] = "text",
    ) -> list[int]:
        """A text prompt (a completion's, or a chat the server rendered: `kind`): where the
        proxy tokenizes, taken up from the end of an earlier text of the tenant and kind it
        starts with (a conversation grows its one text turn by turn), else whole."""
        vocabulary = self.local.vocabulary(upstream)
        if vocabulary is None or not isinstance(prompt, str):
            return await self._tokenize(prompt, upstream, n_ctx)
        scope = orjson.dumps([tenant, self._process_name(upstream), kind])
        try:
            parts = self.resumed.text_parts(scope, prompt)
            tokens = await self._taken_up(vocabulary, scope, parts, prompt, upstream, n_ctx)
        except UnicodeEncodeError:  # a lone surrogate: the server's to make sense of
            return await self._tokenize(prompt, upstream, n_ctx)
        self.resumed.text_seen(scope, prompt)
        return tokens

    async def _taken_up(
        self,
        vocabulary: Vocabulary,
        scope: bytes,
        parts: list[str],
        text: str,
        upstream: Upstream,
        n_ctx: int | None,
    ) -> list[int]:
        """`text` (as `parts` spell it) taken up from a head of `scope` remembered, where one
        agrees, else tokenized whole; refused when it does not fit `n_ctx`."""
        tokens = await self.resumed.tokens(
            vocabulary,
            scope,
            parts,
            lambda again: self._tokenized_here(upstream, again, False, True),
            lambda: self._tokenize(text, upstream, n_ctx),
            n_ctx,
        )
        _refuse_over(len(tokens), n_ctx)
        return tokens

    async def _chat_tokens(
        self, body: dict, upstream: Upstream, tenant: str, n_ctx: int | None
    ) -> list[int]:
        rendered = self.templates.render_parts(self.template_name(upstream), body)
        if rendered is None:
            # the server renders it (tools, say): its text grows turn by turn all the same,
            # and is taken up from the end of the conversation's last one
            text = (await self._post(upstream, "/apply-template", body))["prompt"]
            return await self._text_tokens(text, upstream, tenant, n_ctx, "rendered")
        parts, segments = rendered
        # only what is new is tokenized, and the count checked after; where the server
        # tokenizes, a text that might not fit (by a loose bound: four ids a character) is
        # counted as its ids arrive, so that a prompt over the context is never held whole
        if len(segments) > 1:
            return await self._segment_tokens(segments, upstream, tenant, n_ctx)
        text = "".join(segments)
        vocabulary = self.local.vocabulary(upstream)
        if vocabulary is None:
            return await self._tokenize(text, upstream, n_ctx)
        # a template with no cuts: taken up from a remembered head where one is known
        scope = orjson.dumps([tenant, self._process_name(upstream), "head"])
        return await self._taken_up(vocabulary, scope, parts, text, upstream, n_ctx)

    async def _segment_tokens(
        self,
        segments: list[str],
        upstream: Upstream,
        tenant: str,
        n_ctx: int | None,
    ) -> list[int]:
        """The ids of a prompt cut where it tokenizes apart: each segment's ids memoised per
        tenant and model, so a conversation's next turn, or a chat with a system prompt seen
        before, has only its new segments tokenized (at once). A prompt of `n_ctx` ids or more
        is refused (`exceed_context_size_error`), and its segments are not memoised."""
        keys = [
            await self.memo_keys.key(
                (tenant, self._process_name(upstream), "segment", index == 0, segment)
            )
            for index, segment in enumerate(segments)
        ]
        found = [self.memo.get(key) for key in keys]
        missing = [index for index, ids in enumerate(found) if ids is None]
        self.segments_tokenized += len(missing)
        self.segments_reused += len(segments) - len(missing)
        known = sum(len(ids) for ids in found if ids)
        # what the new segments may take (where the server tokenizes, one that might take it
        # all is only counted): the context less the known segments' ids
        room = None if n_ctx is None else n_ctx - known

        def ask(index: int) -> Awaitable[list[int] | int]:
            return self._segment_ids(upstream, segments[index], index == 0, room)

        if len(missing) == 1:  # a fresh question after a known system prompt: no task to make
            asked = [await ask(missing[0])]
        else:
            asked = await asyncio.gather(*map(ask, missing))
        if n_ctx is not None and any(isinstance(ids, int) for ids in asked):
            counts = (ids if isinstance(ids, int) else len(ids) for ids in asked)
            raise exceeds_context(known + sum(counts), n_ctx)
        for index, ids in zip(missing, asked, strict=True):
            found[index] = ids  # type: ignore[assignment]
        tokens = list(itertools.chain.from_iterable(found))  # type: ignore[arg-type]
        _refuse_over(len(tokens), n_ctx)
        for index in missing:
            self.memo.put(keys[index], found[index])  # type: ignore[arg-type]
        return tokens

    async def _segment_ids(
        self, upstream: Upstream, segment: str, first: bool, room: int | None
    ) -> list[int] | int:
        """A segment's ids; or, where the server tokenizes one that might take all the `room`
        left, their count once they do (`_counted_tokens`)."""
        tokens = await self._tokenized_here(upstream, segment, first, True)
        if tokens is not None:
            return tokens
        self._count_sent(upstream)
        if room is None or not _may_exceed(segment, room):
            return await self._server_tokenize_text(upstream, segment, first)
        request = {"content": segment, "add_special": first, "parse_special": True}
        # (two at least: the count of an empty list, `[]`, is not told apart from one id's)
        return await self._counted_tokens(upstream, request, max(room, 2))

    async def _tokenize_text(
        self, upstream: Upstream, text: str, add_special: bool, parse_special: bool = True
    ) -> list[int]:
        tokens = await self._tokenized_here(upstream, text, add_special, parse_special)
        if tokens is not None:
            return tokens
        self._count_sent(upstream)
        return await self._server_tokenize_text(upstream, text, add_special, parse_special)

    async def _tokenized_here(
        self, upstream: Upstream, text: Any, add_special: bool, parse_special: bool
    ) -> list[int] | None:
        """`text`'s ids made here, where `upstream`'s vocabulary is proven (None: ask it)."""
        vocabulary = self.local.vocabulary(upstream)
        if vocabulary is None or not isinstance(text, str):
            return None  # a mixed array of text and ids: the server's tokenize_mixed
        try:
            tokens = await self.local.tokenize(vocabulary, text, add_special, parse_special)
        except UnicodeEncodeError:  # a lone surrogate: what the server makes of it is its own
            return None
        self.tokenized_here += 1
        if self.metrics is not None:
            self.metrics.count((self.metrics.tokenizations, (upstream.name, "proxy"), 1))
        return tokens

    def _count_sent(self, upstream: Upstream) -> None:
        self.tokenized_by_server += 1
        if self.metrics is not None:
            self.metrics.count((self.metrics.tokenizations, (upstream.name, "server"), 1))

    def _count_verdict(self, name: str, verdict: Verdict) -> None:
        if self.metrics is not None:
            self.metrics.count((self.metrics.tokenizer_verdicts, (name, verdict), 1))

    async def _server_tokenize_text(
        self, upstream: Upstream, text: str, add_special: bool, parse_special: bool = True
    ) -> list[int]:
        request = {"content": text, "add_special": add_special, "parse_special": parse_special}
        return (await self._post(upstream, "/tokenize", request))["tokens"]

    async def _with_cuts(self, name: str, template: LearntTemplate) -> LearntTemplate:
        """The upstream's learnt template with the joints its prompts may be cut at."""
        tokenize = functools.partial(self._tokenize_text, self._upstreams[name])
        return dataclasses.replace(template, cuts=await learn_cuts(template, tokenize))

    async def _tokenize(self, content: Any, upstream: Upstream, n_ctx: int | None) -> list[int]:
        tokens = await self._tokenized_here(upstream, content, True, True)
        if tokens is not None:
            _refuse_over(len(tokens), n_ctx)
            return tokens
        self._count_sent(upstream)
        request = {"content": content, "add_special": True, "parse_special": True}
        if n_ctx is None or not _may_exceed(content, n_ctx):
            return (await self._post(upstream, "/tokenize", request))["tokens"]
        counted = await self._counted_tokens(upstream, request, n_ctx)
        if isinstance(counted, int):  # counted only: as many as the context, or more
            raise exceeds_context(counted, n_ctx)
        _refuse_over(len(counted), n_ctx)
        return counted

    async def _counted_tokens(
        self, upstream: Upstream, request: dict, limit: int
    ) -> list[int] | int:
        """The server's ids of the text `request` asks it to tokenize; or, once they reach
        `limit`, only their count: they are counted as they arrive, never held in full."""
        data = orjson.dumps(upstream.own_body(request))
        async with await self._send(upstream, "/tokenize", data) as response:
            if response.status != 200:
                raise ApiError(response.status, _error_message(await response.read()))
            kept: list[bytes] | None = []
            commas = 0
            async for chunk in _pieces(response):
                commas += chunk.count(b",")
                if kept is not None:
                    kept.append(chunk)
                    if commas + 1 >= limit:
                        kept = None  # too many whatever follows: stop keeping them
        if kept is None:
            return commas + 1  # {"tokens":[a,b,...]}: one comma fewer
        return orjson.loads(b"".join(kept))["tokens"]

    async def _post(self, upstream: Upstream, path: str, body: dict) -> dict:
        return await self._request(upstream, "POST", path, orjson.dumps(upstream.own_body(body)))

    async def _request(
        self, upstream: Upstream, method: str, path: str, data: bytes | None
    ) -> dict:
        async with await self._send(upstream, path, data, method) as response:
            payload = await response.read()
            if response.status != 200:
                # the request itself would fail the same way: hand the server's error over
                raise ApiError(response.status, _error_message(payload))
        return orjson.loads(payload)

    async def _send(
        self, upstream: Upstream, path: str, data: bytes | None, method: str = "POST"
    ) -> Answer | aiohttp.ClientResponse:
        """Send `data` to the upstream's `path` (on a router's instance, naming its model): the
        answer, its head read."""
        url = self._urls.get((upstream.name, path))
        if url is None:
            url = self._urls[(upstream.name, path)] = URL(upstream.own_url(path))
        if self.connections is not None and self.connections.carries(url):
            return await self.connections.send(method, url, self.headers, data)
        return await self.session.request(method, url, data=data, headers=self.headers)


def _pieces(response: Answer | aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The answer's body as it arrives."""
    if isinstance(response, Answer):
        return response.iter_any()
    return response.content.iter_chunked(TOKENIZE_READ_CHUNK)


def _refuse_over(count: int, n_ctx: int | None) -> None:
    """llama-server's refusal of a prompt of `count` ids that does not fit a slot of `n_ctx`."""
    if n_ctx is not None and count >= n_ctx:
        raise exceeds_context(count, n_ctx)


def _may_exceed(content: Any, n_ctx: int) -> bool:
    """Whether the text could tokenize to `n_ctx` tokens or more (a cheap upper bound)."""
    if isinstance(content, str):
        return text_token_ceiling(content) >= n_ctx
    return True  # a mixed array: rare, counted as it comes


def _error_message(payload: bytes) -> str:
    try:
        return orjson.loads(payload)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return payload.decode(errors="replace")[:500]
