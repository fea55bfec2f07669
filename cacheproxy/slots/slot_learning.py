"""What the slots of an upstream hold when this proxy starts to hold it: at a takeover (the
proxy that held it died or gave it up) and at the proxy's own start in front of a server that
kept running.

`GET /slots` counts each slot's tokens without naming them. The claims its last holder kept
(cluster/slot_claims.py, kept true by slots/claims_keeper.py) say whose text each slot holds:
that tenant's, exactly (a slot its holder was about to give another tenant's text was
disowned first), or nobody's; and the hashes of its ids. The table takes the tenant and keeps
the ids unknown, the hashes as a hint (`SlotState.hint`), until a prompt of that tenant starts
with tokens whose hashes match (`slot_hints.named_by`, asked by the scheduler at placement): the
request's own prompt supplies the ids.

A claim may be stale: a request may have run on the slot after its last write (the proxy died
before writing what it left). Its tenant still holds (nothing of another tenant is sent before
the disowning is committed); its hint may not. One that records more tokens than the server
shows is dropped; one that names a prompt leaves ids that are a guess (`SlotState.hinted`):
they predict the tenant's own reuse, which its next request there measures and corrects, and
never let another tenant share a public prefix there.

The start-up probe (upstreams/client.py) writes into an idle slot, the emptiest; when every
idle slot holds something, that slot is saved first and its content restored after the probe
(with the disk tier only: the file goes into the archive folder), and the file's header names
its ids.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable

import aiohttp

from cacheproxy.disk.slot_file import SlotFileError
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.slots.claims_keeper import SlotClaims
from cacheproxy.slots.slot_hints import decode_hint
from cacheproxy.upstreams.client import UpstreamClient, idle_slots
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import UpstreamSlots

log = logging.getLogger(__name__)


class SlotLearning:
    """Learns what an upstream's slots hold when its table is built afresh (the monitor calls
    `inspect` for the probe and `learn` before the table serves)."""

    def __init__(
        self, claims: SlotClaims, client: UpstreamClient, store: ArchiveStore | None
    ) -> None:
        self.claims = claims
        self.client = client
        self.store = store  # the archive folder, where a probed slot is kept; None: no disk tier
        # per upstream: the ids of a slot kept from the probe and put back, by slot id
        self._put_back: dict[str, dict[int, list[int]]] = {}

    async def inspect(
        self, upstream: Upstream, inspect: Callable[[], Awaitable[UpstreamSlots]]
    ) -> UpstreamSlots:
        """Run the start-up probe (`inspect`) without losing what the slot it takes holds."""
        self._put_back.pop(upstream.base_url, None)
        kept = await self._keep_probed(upstream)
        if kept is None:
            return await inspect()
        slot_id, name = kept
        try:
            table = await inspect()
            if table.slots[slot_id].empty:  # the probe wrote there, and emptied it
                await self._restore(upstream, slot_id, name)
            return table
        finally:
            await self.store.discard(name)  # type: ignore[union-attr]

    async def _keep_probed(self, upstream: Upstream) -> tuple[int, str] | None:
        """Save the slot the probe will write into, if it holds something: (its id, the file)."""
        if self.store is None:
            return None
        try:
            report = await self.client.slots(upstream)
        except (aiohttp.ClientError, TimeoutError):
            return None  # the probe finds out for itself
        idle = idle_slots(report)
        held = {entry["id"]: entry.get("n_prompt_tokens", 0) for entry in report}
        # the probe runs on one slot of one, or on two idle slots of several
        if not idle or not held[idle[0]] or (len(report) > 1 and len(idle) < 2):
            return None
        slot_id, name = idle[0], f"probe_{secrets.token_hex(8)}.slot"
        try:
            await self.client.post_json(
                upstream, f"/slots/{slot_id}?action=save", {"filename": name}
            )
            header = await self.store.slot_file(name)
        except (aiohttp.ClientError, TimeoutError, OSError, SlotFileError) as exc:
            log.info("slot %d of %s not kept from the probe: %r", slot_id, upstream.base_url, exc)
            await self.store.discard(name)
            return None
        if header is None:  # it saves elsewhere than the archive folder
            return None
        tokens = header.tokens.tolist()
        if header.media_positions or -1 in tokens:
            tokens = []  # media chunks: their ids are not named
        self._put_back[upstream.base_url] = {slot_id: tokens}
        return slot_id, name

    async def _restore(self, upstream: Upstream, slot_id: int, name: str) -> None:
        try:
            await self.client.post_json(
                upstream, f"/slots/{slot_id}?action=restore", {"filename": name}
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "slot %d of %s lost its content to the probe: %r", slot_id, upstream.base_url, exc
            )
            self._put_back.pop(upstream.base_url, None)

    async def learn(self, table: UpstreamSlots) -> None:
        """Give each idle slot holding something the tenant its claim names (None: nobody's),
        and the hint of its ids, from what the server shows now."""
        claims = await self.claims.read(table)
        put_back = self._put_back.pop(table.upstream.base_url, {})
        try:
            report = await self.client.slots(table.upstream)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("slots of %s not learnt: %r", table.upstream.base_url, exc)
            report = []
        for entry in report:
            slot = table.slots[entry["id"]]
            if entry.get("is_processing") or slot.busy:
                continue
            n_tokens = entry.get("n_prompt_tokens", 0)
            if not n_tokens:
                continue  # empty, as the table has it
            claim = claims.get(slot.slot_id)
            hint = None if claim is None else decode_hint(claim.hint_tokens, claim.hint)
            if hint is not None and hint.n_tokens > n_tokens:
                hint = None  # it holds less than was recorded: it ran a request since
            tenant = None if claim is None else claim.tenant
            table.learnt(slot.slot_id, n_tokens, tenant, put_back.get(slot.slot_id), hint)
            self.claims.metrics.slots_learnt.labels(
                "unclaimed" if tenant is None else "claimed"
            ).inc()
        self.claims.adopted(table, claims)
        learnt = [slot.slot_id for slot in table.slots if slot.tenant is not None]
        if learnt:
            log.info(
                "upstream %s: slots %s are their claims' tenants'", table.upstream.base_url, learnt
            )
