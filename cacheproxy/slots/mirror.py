"""The exact token ids llama-server will cache for a request, obtained from llama-server itself.

- A prompt of token ids is used verbatim (no BOS added).
- A string prompt, or a mixed array starting with a string, is tokenized with BOS added and
  special tokens parsed: `POST /tokenize` with `add_special` and `parse_special`.
- A chat body goes through `POST /apply-template` (the same parser chat completions use, so tools
  and template kwargs count), and the templated text is then tokenized as a string prompt.

Results are memoised by a hash of what determines them, so a retried request costs nothing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Literal

import aiohttp
import orjson

from cacheproxy.http.errors import ProxyError

RouteKind = Literal["completion", "chat"]


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
    def __init__(
        self,
        session: aiohttp.ClientSession,
        upstream_headers: dict[str, str] | None = None,
        memo_size: int = 4096,
    ) -> None:
        self.session = session
        self.headers = {"Content-Type": "application/json", **(upstream_headers or {})}
        self.memo_size = memo_size
        self._memo: OrderedDict[bytes, list[int]] = OrderedDict()
        self.lookups = 0
        self.memo_hits = 0

    async def prompt_tokens(
        self, kind: RouteKind, body: dict, base_url: str, tenant: str
    ) -> list[int]:
        """The ids the server at `base_url` will hold for this request's prompt.

        The memo is per tenant: a hit skips two round trips, and one tenant must not be able
        to time whether another sent the same text.
        """
        if kind == "completion":
            prompt = body.get("prompt")
            if prompt_shape(prompt) == "ids":
                return list(prompt)
            return await self._memoised(
                (tenant, "text", prompt), lambda: self._tokenize(prompt, base_url)
            )
        return await self._memoised(
            (tenant, "chat", body), lambda: self._chat_tokens(body, base_url)
        )

    async def _memoised(self, key_source: Any, compute: Any) -> list[int]:
        self.lookups += 1
        key = hashlib.blake2b(orjson.dumps(key_source, option=orjson.OPT_SORT_KEYS)).digest()
        cached = self._memo.get(key)
        if cached is not None:
            self.memo_hits += 1
            self._memo.move_to_end(key)
            return cached
        tokens = await compute()
        self._memo[key] = tokens
        if len(self._memo) > self.memo_size:
            self._memo.popitem(last=False)
        return tokens

    async def _chat_tokens(self, body: dict, base_url: str) -> list[int]:
        templated = await self._post(base_url, "/apply-template", body)
        return await self._tokenize(templated["prompt"], base_url)

    async def _tokenize(self, content: Any, base_url: str) -> list[int]:
        request = {"content": content, "add_special": True, "parse_special": True}
        return (await self._post(base_url, "/tokenize", request))["tokens"]

    async def _post(self, base_url: str, path: str, body: dict) -> dict:
        data = orjson.dumps(body)
        async with self.session.post(base_url + path, data=data, headers=self.headers) as response:
            payload = await response.read()
            if response.status != 200:
                # the request itself would fail the same way: hand the server's error over
                raise ProxyError(response.status, _error_message(payload))
        return orjson.loads(payload)


def _error_message(payload: bytes) -> str:
    try:
        return orjson.loads(payload)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return payload.decode(errors="replace")[:500]
