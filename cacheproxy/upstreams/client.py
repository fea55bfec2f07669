"""Read an upstream's slots, and check that it keeps them the way the slot table assumes.

Two server configurations would make the table wrong, and neither shows in /props:
- unified KV with idle-slot caching (llama-server's automatic `-np`): every idle slot is emptied
  into the RAM cache whenever any task starts. Such a server is refused, with the fix.
- a RAM prompt cache answering pinned requests: a slot may come back holding a better entry
  than the table knows. That is allowed; the router then avoids empty slots (see the policy).
Both are found by a short probe on two empty slots, which are erased again afterwards.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import aiohttp
import orjson

from cacheproxy.slots.table import UpstreamSlots
from cacheproxy.upstreams.pool import Upstream

log = logging.getLogger(__name__)

PROBE_LENGTH = 48


class UnsuitableUpstream(RuntimeError):
    """The upstream is configured so that the slot table cannot be kept right."""


class UpstreamClient:
    """The few llama-server calls the cache layer makes on its own behalf."""

    def __init__(self, session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        self.session = session
        self.headers = {"Content-Type": "application/json", **headers}

    async def get_json(self, upstream: Upstream, path: str) -> Any:
        async with self.session.get(upstream.url(path), headers=self.headers) as response:
            if response.status == 501:
                raise UnsuitableUpstream(
                    f"{upstream.base_url}{path} is disabled; cacheproxy needs it"
                    " (start llama-server without --no-slots)"
                )
            response.raise_for_status()
            return orjson.loads(await response.read())

    async def post_json(self, upstream: Upstream, path: str, body: dict) -> Any:
        data = orjson.dumps(body)
        async with self.session.post(
            upstream.url(path), data=data, headers=self.headers
        ) as response:
            response.raise_for_status()
            return orjson.loads(await response.read())

    async def slots(self, upstream: Upstream) -> list[dict]:
        return await self.get_json(upstream, "/slots")

    async def complete_on(self, upstream: Upstream, slot_id: int, prompt: list[int]) -> dict:
        body = {"prompt": prompt, "n_predict": 1, "id_slot": slot_id, "temperature": 0}
        return await self.post_json(upstream, "/completion", body)

    async def erase(self, upstream: Upstream, slot_id: int) -> None:
        """Empty a slot; a server without --slot-save-path has no slot actions (501, even for
        erase), and its slot then keeps what it holds, which the slot table counts as unknown."""
        url = upstream.url(f"/slots/{slot_id}?action=erase")
        async with self.session.post(url, data=b"{}", headers=self.headers) as response:
            if response.status != 501:
                response.raise_for_status()


async def inspect_upstream(
    client: UpstreamClient, index: int, upstream: Upstream, ram_cache_setting: str
) -> UpstreamSlots:
    """Build the upstream's slot table; refuse a server that clears idle slots."""
    report = await client.slots(upstream)
    empty = [entry["id"] for entry in report if not entry.get("n_prompt_tokens")]
    ram_cache = ram_cache_setting == "on"
    if len(empty) >= 2 and not any(entry.get("is_processing") for entry in report):
        ram_cache_seen = await _probe(client, upstream, empty[-1], empty[-2])
        if ram_cache_setting == "auto":
            ram_cache = ram_cache_seen
        report = await client.slots(upstream)
    table = UpstreamSlots.from_slots_report(index, upstream, report, ram_cache)
    table.n_vocab = await read_n_vocab(client, upstream)
    return table


async def read_n_vocab(client: UpstreamClient, upstream: Upstream) -> int | None:
    """The model's vocabulary size (`/v1/models` meta), to refuse invalid token ids early;
    None when the server does not say (ids are then left for it to check)."""
    try:
        models = await client.get_json(upstream, "/v1/models")
        n_vocab = models["data"][0]["meta"]["n_vocab"]
    except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream, LookupError, TypeError) as exc:
        log.warning("upstream %s: vocabulary size unknown (%r)", upstream.base_url, exc)
        return None
    return n_vocab if isinstance(n_vocab, int) and n_vocab > 0 else None


def probe_prompts(base_url: str) -> tuple[list[int], list[int], list[int]]:
    """Three probe prompts from disjoint id ranges: no two share even a first token, so any
    reuse of the first by a slot holding the second can only come from a RAM cache."""
    rng = random.Random(f"{base_url}-probe")
    held, other, overwrite = (
        [rng.randrange(low, low + 500) for _ in range(PROBE_LENGTH)] for low in (500, 1000, 1500)
    )
    return held, other, overwrite


async def _probe(client: UpstreamClient, upstream: Upstream, first: int, second: int) -> bool:
    """Return whether pinned requests are served from the RAM cache; raise if idle slots clear."""
    held, other, overwrite = probe_prompts(upstream.base_url)
    try:
        await client.complete_on(upstream, first, held)
        await client.complete_on(upstream, second, other)
        after = {entry["id"]: entry for entry in await client.slots(upstream)}
        if not after[first].get("n_prompt_tokens"):
            raise UnsuitableUpstream(
                f"{upstream.base_url} empties idle slots whenever a task starts (unified KV with"
                " --cache-idle-slots, the default when -np is not given): start it with an"
                " explicit -np N (without -kvu), or with --no-cache-idle-slots or --cache-ram 0"
            )
        # `held` leaves slot `first`; a RAM cache keeps it and hands it to slot `second`
        await client.complete_on(upstream, first, overwrite)
        answer = await client.complete_on(upstream, second, [*held, 1000])
        return answer["timings"]["cache_n"] >= PROBE_LENGTH // 2
    finally:
        await client.erase(upstream, first)
        await client.erase(upstream, second)
