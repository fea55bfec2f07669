"""What the slot table, the views and the disk tier make of LoRA scales (pure parts): a slot is
reused, and an archive filed and found, only under the scales its text was computed under."""

from __future__ import annotations

from cacheproxy.disk.attached import AttachedUpstream, filed_under
from cacheproxy.disk.restores import scales_to_set
from cacheproxy.slots import slot_records
from cacheproxy.slots.lease_terms import reuse_terms
from cacheproxy.slots.slot_views import foreign_slots, slot_candidates
from cacheproxy.upstreams.adapters import UNREADABLE, requested
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.slot_table import (
    Lease,
    ReuseBounds,
    SlotContent,
    SlotState,
    TaskOutcome,
    UpstreamSlots,
)
from tests.support.asking import Asking

TENANT = "default"
TEXT = list(range(300, 400))
ZERO = requested({"lora": [{"id": 0, "scale": 0.0}]})


def table_holding(
    adapters: tuple[float, ...], slot_scales: tuple[float, ...] | None
) -> UpstreamSlots:
    slot = SlotState(0, 8192)
    slot.hold(list(TEXT))
    slot.tenant, slot.adapters = TENANT, slot_scales
    table = UpstreamSlots(0, Upstream("http://127.0.0.1:1"), [slot])
    table.adapters = adapters
    return table


def reuse(table: UpstreamSlots, lora: object) -> int:
    asking = Asking([*TEXT, 1, 2], TENANT, lora=lora)  # type: ignore[arg-type]
    views, _, _ = slot_candidates([table], asking, {}, TENANT, 0.0)
    return views[0].reuse


def test_a_server_without_adapters_reuses_whatever_a_body_names() -> None:
    table = table_holding((), None)
    assert reuse(table, None) == reuse(table, ZERO) == reuse(table, UNREADABLE) == len(TEXT)
    assert not foreign_slots(table, TENANT, TENANT, ZERO)


def test_a_slot_is_reused_only_under_its_scales() -> None:
    table = table_holding((1.0,), (1.0,))  # computed under the global scale
    assert reuse(table, None) == len(TEXT)
    assert reuse(table, requested({"lora": [{"id": 0, "scale": 1}]})) == len(TEXT)
    assert reuse(table, ZERO) == 0 and reuse(table, UNREADABLE) == 0
    assert foreign_slots(table, TENANT, TENANT, ZERO) == table.slots
    assert reuse(table_holding((1.0,), None), None) == 0  # scales not known: reused by nobody


def test_own_text_under_other_scales_is_isolated() -> None:
    slot = table_holding((1.0,), (0.0,)).slots[0]
    assert reuse_terms(slot, ReuseBounds(0, 0), TENANT, TENANT, False, same_scales=False)[1]
    assert not reuse_terms(slot, ReuseBounds(0, 0), TENANT, TENANT, False)[1]


def test_archives_are_filed_under_their_adapters_and_scales() -> None:
    attached = AttachedUpstream("model")
    assert filed_under(attached, table_holding((), None), None) == "model"
    with_adapters = table_holding((1.0, 0.5), None)
    with_adapters.adapter_files = ("a.gguf", "b.gguf")
    filed = filed_under(attached, with_adapters, (1.0, 0.5))
    assert filed is not None and filed.startswith("model+lora:")
    assert filed_under(attached, with_adapters, (0.0, 0.5)) != filed
    assert filed_under(attached, with_adapters, None) is None
    other_files = table_holding((1.0, 0.5), None)
    other_files.adapter_files = ("a.gguf", "c.gguf")
    assert filed_under(attached, other_files, (1.0, 0.5)) != filed


def lease_on(table: UpstreamSlots, adapters: tuple[float, ...], names: bool) -> Lease:
    slot = table.slots[0]
    previous = slot.content(TENANT)
    return Lease(
        table, slot, [1, *TEXT], ReuseBounds(0, 0), 0.0, True, previous,
        adapters=adapters, names_scales=names,
    )  # fmt: skip


def test_a_slot_is_given_the_scales_a_restore_needs() -> None:
    table = table_holding((1.0,), (1.0,))
    assert scales_to_set(lease_on(table, (0.0,), names=True)) == (0.0,)
    assert scales_to_set(lease_on(table, (1.0,), names=True)) is None  # its last task's
    assert scales_to_set(lease_on(table, (1.0,), names=False)) is None  # kept whatever they are
    assert scales_to_set(lease_on(table_holding((), None), (), names=True)) is None


def test_a_released_slot_holds_text_under_the_requests_scales() -> None:
    table = table_holding((1.0,), (1.0,))
    lease = lease_on(table, (0.0,), names=True)  # isolated: computed afresh
    done = TaskOutcome(ok=True, cache_n=0, prompt_n=101, tokens_cached=101)
    slot_records.released(lease, done, 1.0)
    assert table.slots[0].adapters == (0.0,)
    # failed on a slot it was isolated from: what the slot holds now is not known
    table = table_holding((1.0,), (1.0,))
    slot_records.released(lease_on(table, (0.0,), names=True), TaskOutcome(ok=False), 1.0)
    assert table.slots[0].adapters is None
    assert SlotContent([], 0, None).adapters is None
