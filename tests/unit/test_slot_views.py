"""The slots as the policy sees them on a server that picks the slot itself (llama-server's
default topology: idle slots emptied into its RAM cache at every launch)."""

from __future__ import annotations

import random

from cacheproxy.slots.slot_views import slot_candidates
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.ram_shadow import RamCacheShadow, ShadowSlot
from cacheproxy.upstreams.slot_table import SlotState, UpstreamSlots
from tests.support.asking import Asking
from tests.support.ram_reference import BYTES_PER_TOKEN, ram_cache

TENANT = "default"


def busy_beside_a_cached_prefix(running: list[int], cached: list[int]) -> UpstreamSlots:
    """Slot 0 runs a task with `running`; the RAM cache holds `cached`; slots 1 and 2 idle,
    emptied."""
    slots = [SlotState(slot_id, 8192) for slot_id in range(3)]
    table = UpstreamSlots(0, Upstream("http://127.0.0.1:1"), slots, ram_cache=True)
    table.clears_idle = True
    shadow = RamCacheShadow(ram_cache(8192), lambda: BYTES_PER_TOKEN)
    shadow.dispatched(
        [ShadowSlot(0, cached, False), ShadowSlot(1, [], False), ShadowSlot(2, [], False)],
        0,
        cached,
        [7] * 10,
    )
    table.ram_shadow = shadow
    slots[0].hold(running)
    slots[0].tenant, slots[0].busy = TENANT, True
    return table


def shown(table: UpstreamSlots, prompt: list[int]) -> dict[int, tuple[bool, int]]:
    views, _, _ = slot_candidates([table], Asking(prompt, TENANT), {}, TENANT, 0.0)
    return {view.slot_id: (view.busy, view.reuse) for view in views}


def test_a_busy_slot_is_waited_for_only_for_more_than_the_servers_pick_brings() -> None:
    """The RAM cache brings the prefix the busy slot shares with the prompt: running at once
    finds it there, so the busy slot is shown as worth nothing; a busy slot holding more of
    the prompt than the pick brings back is shown with what it holds."""
    rng = random.Random(2)
    prefix = [rng.randrange(300, 20000) for _ in range(400)]
    tail = [rng.randrange(300, 20000) for _ in range(100)]
    prompt = [*prefix, *[rng.randrange(300, 20000) for _ in range(50)]]
    sharing = shown(busy_beside_a_cached_prefix([*prefix, *tail], prefix), prompt)
    assert sharing[0] == (True, 0)
    assert [reuse for busy, reuse in sharing.values() if not busy] == [len(prefix)]
    longer = [*prefix, *tail]
    holding_more = shown(busy_beside_a_cached_prefix(longer, prefix), [*longer, 1, 2])
    assert holding_more[0] == (True, len(longer))
