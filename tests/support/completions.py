"""Requests a test client sends: a greedy completion of token ids, and a tenant's key; and what
of two answers is compared."""

from __future__ import annotations

from typing import Any

import aiohttp


def without(document: Any, keys: frozenset[str]) -> Any:
    """`document` with `keys` taken out at every depth (what two answers may differ in)."""
    if isinstance(document, dict):
        return {key: without(value, keys) for key, value in document.items() if key not in keys}
    if isinstance(document, list):
        return [without(item, keys) for item in document]
    return document


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def complete(
    client: aiohttp.ClientSession,
    url: str,
    prompt: Any,
    headers: dict[str, str] | None = None,
    *,
    path: str = "/completion",
    status: int = 200,
    **fields: Any,
) -> dict[str, Any]:
    """A greedy `/completion` of 4 tokens with their ids back (`return_tokens`), so that a next
    turn can continue it; `fields` add to or replace those of the body. Asserts the status."""
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "return_tokens": True, **fields}
    async with client.post(url + path, json=body, headers=headers) as response:
        answer = await response.json(content_type=None)
        assert response.status == status, answer
    return answer
