"""Read an upstream's slots, and find out how the server keeps them, for the slot table.

Two server configurations change what the table must follow, and neither shows in /props:
- unified KV with idle-slot caching (llama-server's default: no `-np`): every idle slot is
  emptied into the RAM cache whenever any task starts, and a task pinned to an empty slot never
  loads from that cache. The table follows the clears, and tasks go without `id_slot`, the
  server picking the slot (`UpstreamSlots.clears_idle`).
- a RAM prompt cache answering pinned requests: a slot may come back holding a better entry
  than the table knows, and that entry may be another tenant's. The router then avoids empty
  slots (see the policy), and tenants are refused.
Both are found by a short probe on one idle slot (and a second one, when the server has more,
to see whether idle slots are emptied). It works on slots that already hold something, on any
`-np`, and without `--slot-save-path`: slots are erased afterwards where the server allows it,
and otherwise the table records the probe prompts they hold. When no idle slot is free for the
probe the RAM cache is "unknown", which is treated as on, and the monitor probes again later.
A server that cannot be served at all (its `/slots` turned off) raises `UnsuitableUpstream`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from cacheproxy.upstreams.adapters import Scales, loaded, naming
from cacheproxy.upstreams.connection_pool import UpstreamConnections
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import UpstreamSlots

log = logging.getLogger(__name__)

PROBE_LENGTH = 48
# llama-server's HTTP pool has max(slots + 4, cores - 1) threads that stay (`--threads-http`),
# each serving one connection while it is open: the proxy keeps slots + 2 of them, leaving two
# for its metrics scraper and anyone else (upstreams/connection_pool.py)
KEPT_BEYOND_SLOTS = 2


class UnsuitableUpstream(RuntimeError):
    """The upstream is configured so that the slot table cannot be kept right."""


class UpstreamClient:
    """The few llama-server calls the cache layer makes on its own behalf.

    `connections`: the lean pool they go over to an upstream it carries (http; https given its
    TLS context), the one requests are forwarded over, so that the proxy's connections to a
    server are counted and bounded in one place (`keep_at_most`, set from each `GET /slots`);
    without it, `session`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        headers: dict[str, str],
        timeout_s: float | None = None,
        connections: UpstreamConnections | None = None,
    ) -> None:
        self.session = session
        self.connections = connections
        self.headers = {"Content-Type": "application/json", **headers}
        self.timeout_s = timeout_s
        # each call's own bound; none: the session's (an hour's read timeout, made for tasks)
        self.bound: dict[str, aiohttp.ClientTimeout] = (
            {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
        )

    def with_timeout(self, timeout_s: float) -> UpstreamClient:
        """The same client, each call bounded by `timeout_s`: a stopped server is not waited
        for as long as a generation may take."""
        copy = UpstreamClient(self.session, {}, timeout_s, self.connections)
        copy.headers = self.headers
        return copy

    async def get_json(self, upstream: Upstream, path: str) -> Any:
        status, payload = await self._exchange("GET", upstream.own_url(path), None, 501)
        if status == 501:
            raise UnsuitableUpstream(
                f"{upstream.base_url}{path} is disabled; cacheproxy needs it"
                " (start llama-server without --no-slots)"
            )
        return orjson.loads(payload)

    async def post_json(self, upstream: Upstream, path: str, body: dict) -> Any:
        data = orjson.dumps(upstream.own_body(body))
        _, payload = await self._exchange("POST", upstream.own_url(path), data, None)
        return orjson.loads(payload)

    async def _exchange(
        self, method: str, url: str, data: bytes | None, kept_status: int | None
    ) -> tuple[int, bytes]:
        """The answer's status and body; a failed status (but `kept_status`, left to the
        caller) raises `aiohttp.ClientResponseError`, and every fault aiohttp's errors,
        whichever client carried the call."""
        target = URL(url)
        if self.connections is None or not self.connections.carries(target):
            async with self.session.request(
                method, target, data=data, headers=self.headers, **self.bound
            ) as response:
                if response.status != kept_status:
                    response.raise_for_status()
                return response.status, await response.read()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with await self.connections.send(
                    method, target, self.headers, data
                ) as answer:
                    payload = await answer.read()
        except ConnectionError as exc:  # not an OSError to the caller: no disk is at fault
            raise aiohttp.ClientConnectionError(f"{target}: {exc}") from exc
        if answer.status >= 400 and answer.status != kept_status:
            info = aiohttp.RequestInfo(target, method, CIMultiDictProxy(CIMultiDict()), target)
            raise aiohttp.ClientResponseError(info, (), status=answer.status, message=answer.reason)
        return answer.status, payload

    async def slots(self, upstream: Upstream) -> list[dict]:
        """`GET /slots`; its length also bounds the connections kept open to the server."""
        report = await self.get_json(upstream, "/slots")
        if self.connections is not None and isinstance(report, list) and report:
            self.connections.keep_at_most(
                URL(upstream.transport_base), len(report) + KEPT_BEYOND_SLOTS
            )
        return report

    async def models(self, upstream: Upstream) -> dict:
        """`GET /v1/models` as a server of the upstream's own would answer it: a router lists
        every model it knows, a model instance's entry is its own."""
        answer = await self.get_json(upstream, "/v1/models")
        if upstream.model is None or not isinstance(answer, dict):
            return answer
        own = [entry for entry in answer.get("data") or [] if entry.get("id") == upstream.model]
        return {**answer, "data": own}

    async def complete_on(
        self,
        upstream: Upstream,
        slot_id: int,
        prompt: list[int],
        cache_prompt: bool | None = True,
        lora: Scales | None = None,
    ) -> dict:
        """A one-token completion pinned to `slot_id`; `cache_prompt` None: the field left out
        (the server's own default, false with `--no-cache-prompt`); `lora`: the LoRA scales it
        names (None: none, the server's global ones)."""
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": 1,
            "id_slot": slot_id,
            "temperature": 0,
            "return_tokens": True,
        }
        if cache_prompt is not None:
            body["cache_prompt"] = cache_prompt
        if lora is not None:
            body["lora"] = naming(lora)
        return await self.post_json(upstream, "/completion", body)

    async def erase(self, upstream: Upstream, slot_id: int) -> bool:
        """Empty a slot; False when the server has no slot actions (no --slot-save-path)."""
        try:
            await self.post_json(upstream, f"/slots/{slot_id}?action=erase", {})
        except aiohttp.ClientResponseError as exc:
            if exc.status == 501:
                return False
            raise
        return True


@dataclass
class ProbeResult:
    """What the probe found, and what it left in the slots it used."""

    ram_cache: bool | None  # None: no idle slot to probe with
    left: dict[int, list[int]] = field(default_factory=dict)  # slot id -> tokens it now holds
    erased: set[int] = field(default_factory=set)  # slots it wrote and emptied again
    clears_idle: bool = False  # a task's launch emptied the other idle slot
    ran: list[int] = field(default_factory=list)  # slots it ran tasks on, last finished last
    # whether a request that does not say `cache_prompt` reuses the slot (None: not probed)
    reuses_by_default: bool | None = None


async def inspect_upstream(
    client: UpstreamClient, index: int, upstream: Upstream, ram_cache_setting: str
) -> UpstreamSlots:
    """Build the upstream's slot table from its slots and the probe's findings."""
    report = await client.slots(upstream)
    found = await probe_upstream(client, upstream, idle_slots(report))
    if found.left or found.ram_cache is not None:
        report = await client.slots(upstream)
    table = UpstreamSlots.from_slots_report(index, upstream, report)
    take_findings(table, found, ram_cache_setting)
    table.hold_probe_leftovers(found.left, report)
    for slot_id in found.ran:  # the server's least recently used slot is the one it takes
        table.slots[slot_id].last_used = time.monotonic()
    table.n_vocab = await read_n_vocab(client, upstream)
    await read_adapters(client, table)
    return table


def take_findings(table: UpstreamSlots, found: ProbeResult, ram_cache_setting: str) -> None:
    """What the probe found of the server, written into its table: its RAM cache, whether a
    task's launch empties the idle slots, whether a body that does not say is reused."""
    table.set_ram_cache(ram_cache_state(ram_cache_setting, found.ram_cache, table.upstream))
    table.clears_idle = found.clears_idle
    table.reuses_by_default = found.reuses_by_default is not False


def idle_slots(report: list[dict]) -> list[int]:
    """The idle slots, the emptiest first: the probe writes into the first (and into the second
    only while it is empty), so it overwrites what a slot holds only when none is empty."""
    idle = [entry for entry in report if not entry.get("is_processing")]
    idle.sort(key=lambda entry: entry.get("n_prompt_tokens") or 0)
    return [entry["id"] for entry in idle]


def ram_cache_state(setting: str, seen: bool | None, upstream: Upstream) -> str:
    """ "on", "off" or "unknown". A declared setting stands where the probe could not run, and
    "on" always stands; a cache the probe saw is never declared away (that would share one
    tenant's state with another)."""
    if seen is None:
        return "unknown" if setting == "auto" else setting
    if setting == "off" and seen:
        log.warning(
            'upstream %s: routing.server_ram_cache is "off" but the probe saw its RAM cache'
            " answer a pinned request: taken as on (start it with --cache-ram 0)",
            upstream.base_url,
        )
    return "on" if seen or setting == "on" else "off"


async def read_n_vocab(client: UpstreamClient, upstream: Upstream) -> int | None:
    """The model's vocabulary size (`/v1/models` meta), to refuse invalid token ids early;
    None when the server does not say (ids are then left for it to check)."""
    try:
        models = await client.models(upstream)
        n_vocab = models["data"][0]["meta"]["n_vocab"]
    except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream, LookupError, TypeError) as exc:
        log.warning("upstream %s: vocabulary size unknown (%r)", upstream.base_url, exc)
        return None
    return n_vocab if isinstance(n_vocab, int) and n_vocab > 0 else None


async def read_adapters(client: UpstreamClient, table: UpstreamSlots) -> None:
    """The global scales of the LoRA adapters the server loaded, and their files (`GET
    /lora-adapters`), into its table; none when it loaded none or does not say (a server that
    does not say is taken to have none: its requests' scales are then not followed, as before
    adapters were)."""
    upstream = table.upstream
    try:
        table.adapters, table.adapter_files = loaded(
            await client.get_json(upstream, "/lora-adapters")
        )
        return
    except aiohttp.ClientResponseError as exc:
        if exc.status != 404:  # a server without the route (the embedded engine) loads none
            log.warning("upstream %s: LoRA adapters unknown (%r)", upstream.base_url, exc)
    except (aiohttp.ClientError, TimeoutError, UnsuitableUpstream, ValueError) as exc:
        log.warning("upstream %s: LoRA adapters unknown (%r)", upstream.base_url, exc)
    table.adapters, table.adapter_files = (), ()


def probe_prompts(base_url: str) -> tuple[list[int], list[int], list[int]]:
    """Three probe prompts from disjoint id ranges: no two share even a first token, so any
    reuse of the first by a slot holding the second can only come from a RAM cache."""
    rng = random.Random(f"{base_url}-probe")
    held, other, witness = (
        [rng.randrange(low, low + 500) for _ in range(PROBE_LENGTH)] for low in (500, 1000, 1500)
    )
    return held, other, witness


async def probe_upstream(
    client: UpstreamClient, upstream: Upstream, candidates: list[int]
) -> ProbeResult:
    """Probe on the idle slots `candidates` (the caller keeps them free meanwhile).

    With more than one slot, two idle ones are needed: the second one (the witness) must still
    hold its tokens after a task ran on the first, or the server empties idle slots.
    """
    report = {entry["id"]: entry for entry in await client.slots(upstream)}
    candidates = [slot for slot in candidates if not report[slot].get("is_processing")]
    if not candidates or (len(report) > 1 and len(candidates) < 2):
        return ProbeResult(ram_cache=None)
    probed = candidates[0]
    witness = candidates[1] if len(candidates) > 1 else None
    held, other, witness_prompt = probe_prompts(upstream.base_url)
    written: dict[int, list[int]] = {}
    erased: set[int] = set()
    clears_idle = False
    ran = [probed]
    try:
        if witness is not None and not report[witness].get("n_prompt_tokens"):
            written[witness] = await _complete_and_keep(client, upstream, witness, witness_prompt)
            ran.insert(0, witness)
        ram_cache = await _probe_ram_cache(client, upstream, probed, held, other, written)
        reuses = await _probe_default_reuse(client, upstream, probed, written)
        if witness is not None:
            after = {entry["id"]: entry for entry in await client.slots(upstream)}
            # unified KV with --cache-idle-slots (the default when -np is not given): the
            # witness went into the RAM cache when the probed slot's task started
            clears_idle = not after[witness].get("n_prompt_tokens")
            if clears_idle:  # it holds nothing now: nothing to erase
                written.pop(witness, None)
                erased.add(witness)
                # idle slots are emptied into a RAM cache (--cache-idle-slots needs one): it is
                # there, whatever the pinned requests saw (with -sps 0 they never load from it,
                # but a task without `id_slot` does; and a slot emptied under the probe by a
                # task launched beside it hides it from them)
                ram_cache = True
    finally:
        # empty what the probe wrote; a server without slot actions keeps it, and says so
        for slot in list(written):
            if await client.erase(upstream, slot):
                del written[slot]
                erased.add(slot)
    return ProbeResult(ram_cache, written, erased, clears_idle, ran, reuses)


async def _probe_ram_cache(
    client: UpstreamClient,
    upstream: Upstream,
    slot: int,
    held: list[int],
    other: list[int],
    written: dict[int, list[int]],
) -> bool:
    """Whether pinned requests are served from a RAM cache, found on one slot.

    `held`, then `other`, then `held` + 1 token, all pinned to `slot`. In llama-server's
    get_available_slot (tools/server/server-context.cpp:1680-1793) a pinned idle slot whose
    tokens share at most `-sps` (0.10) of the prompt gets f_keep = 0 < 0.5 (1730-1742), so
    `update_cache` is set and, with a RAM cache, prompt_save copies the slot's state to RAM
    and prompt_load brings back the entry that keeps more (1769-1790; server-task.cpp:1804-1834).
    The second request therefore saves `held`, and the third loads it back: cache_n ~ len(held).
    Without a RAM cache the third starts from `other`, which shares no token: cache_n = 0. A
    slot that already held something is fine: the first request only moves it to RAM. (An
    *empty* pinned slot skips the cache, f_keep = 0/0: hence `held` first.)
    """
    written[slot] = await _complete_and_keep(client, upstream, slot, held)
    written[slot] = await _complete_and_keep(client, upstream, slot, other)
    answer = await client.complete_on(upstream, slot, [*held, 1000])
    written[slot] = _slot_tokens([*held, 1000], answer)
    return answer["timings"]["cache_n"] >= PROBE_LENGTH // 2


async def _probe_default_reuse(
    client: UpstreamClient, upstream: Upstream, slot: int, written: dict[int, list[int]]
) -> bool:
    """Whether a request that does not say `cache_prompt` reuses what its slot holds: the
    server's default, which `--no-cache-prompt` turns off (server-schema.cpp: the field's
    default is the server's `cache_prompt`). The slot's text and one token more: reused whole,
    or not at all. (The probe's other requests say `cache_prompt: true`: a RAM cache is found
    whatever that default, as a request that asks for reuse would find it.)"""
    prompt = [*written[slot], 1001]
    answer = await client.complete_on(upstream, slot, prompt, cache_prompt=None)
    written[slot] = _slot_tokens(prompt, answer)
    return answer["timings"]["cache_n"] >= PROBE_LENGTH // 2


async def _complete_and_keep(
    client: UpstreamClient, upstream: Upstream, slot: int, prompt: list[int]
) -> list[int]:
    return _slot_tokens(prompt, await client.complete_on(upstream, slot, prompt))


def _slot_tokens(prompt: list[int], answer: dict) -> list[int]:
    """What the slot holds after a one-token completion: (prompt + generated)[:tokens_cached]."""
    return [*prompt, *answer.get("tokens", [])][: answer.get("tokens_cached", len(prompt))]
