"""The disk tier's pure decisions: what is worth archiving, and when a restore pays."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cacheproxy.disk.archive_types import Archive
from cacheproxy.disk.attached import AttachedUpstream
from cacheproxy.disk.blocks import BLOCK_TOKENS
from cacheproxy.disk.policy import (
    BRANCHED,
    BRANCHES_TO_JUDGE,
    CARRIED,
    LOST,
    RESTORES_TO_JUDGE,
    SAVE,
    DiskRates,
    Evicted,
    RestoreCosts,
    RestoreOutcome,
    RestoreYield,
    SaveCandidate,
    SaveModel,
    decide_save,
    restore_is_whole,
    restore_pays,
    restore_seen,
    restores_carry,
    return_chance,
    worth_saving,
    write_beside_lookup,
)
from cacheproxy.disk.restores import restored_bytes
from cacheproxy.disk.save_costs import SaveCosts
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.settings import DiskTierSettings
from cacheproxy.upstreams.slot_table import SlotContent

MIN_TOKENS = 256


@pytest.mark.parametrize(
    ("evicted", "expected"),
    [
        (Evicted(n_tokens=1000, kept=0, owner="t"), True),
        # too short to be worth a file
        (Evicted(n_tokens=MIN_TOKENS - 1, kept=0, owner="t"), False),
        (Evicted(n_tokens=MIN_TOKENS, kept=0, owner="t"), True),
        # the new request keeps all but part of a block: the slot itself still holds the rest
        (Evicted(n_tokens=1000, kept=1000 - BLOCK_TOKENS + 1, owner="t"), False),
        (Evicted(n_tokens=1000, kept=1000 - BLOCK_TOKENS, owner="t"), True),
        # whose text it is is unknown: archiving it under anyone's name could leak it
        (Evicted(n_tokens=1000, kept=0, owner=None), False),
    ],
)
def test_worth_saving(evicted: Evicted, expected: bool) -> None:
    assert worth_saving(evicted, MIN_TOKENS) is expected


COSTS = RestoreCosts(
    prefill_ms_per_token=0.05, restore_bytes_per_ms=1_000_000, restore_overhead_ms=2.0
)


def test_restore_pays_when_reading_beats_prefilling() -> None:
    # 1000 tokens: 50 ms of prefill against 2 ms + 1 ms of reading
    assert restore_pays(1000, 1_000_000, COSTS)
    # the same gain from a file 100x larger (a big model's KV): 102 ms of reading loses
    assert not restore_pays(1000, 100_000_000, COSTS)


def test_restore_never_pays_below_one_block() -> None:
    free_reading = RestoreCosts(
        prefill_ms_per_token=1000.0, restore_bytes_per_ms=1e12, restore_overhead_ms=0.0
    )
    assert not restore_pays(BLOCK_TOKENS - 1, 1, free_reading)
    assert restore_pays(BLOCK_TOKENS, 1, free_reading)


def test_restore_overhead_counts() -> None:
    # 100 tokens save 5 ms of prefill; a 4 ms round trip plus 0.1 ms of reading still pays,
    # a 5 ms one does not
    fast = RestoreCosts(0.05, 1_000_000, 4.0)
    slow = RestoreCosts(0.05, 1_000_000, 5.0)
    assert restore_pays(100, 100_000, fast)
    assert not restore_pays(100, 100_000, slow)


# a 4k-token conversation of an 8B f16 model: 128 KiB per token, 512 MiB in all
BIG = SaveCandidate(
    evicted=Evicted(n_tokens=4096, kept=0, owner="t"),
    bytes=4096 * 128 * 1024,
    idle_s=0.0,
    turns=3,
    quota_headroom_bytes=None,
    ahead=False,
)
MODEL = SaveModel(min_tokens=MIN_TOKENS, return_half_life_s=600.0)
# a GPU and an NVMe drive: 8k tokens/s prefill, 2.5 GB/s writes, 3 GB/s reads
NVME = DiskRates(
    prefill_ms_per_token=0.125,
    save_bytes_per_ms=2_500_000,
    restore_bytes_per_ms=3_000_000,
    restore_overhead_ms=2.0,
)


def test_saving_pays_on_a_fast_disk_for_a_conversation_likely_to_return() -> None:
    # 512 ms of prefill spared by a 181 ms restore, for a 215 ms write
    assert decide_save(BIG, NVME, MODEL) == SAVE


def test_slow_disk_flips_saving_off() -> None:
    # 50 MB/s: reading it back (10.7 s) costs more than prefilling it (0.5 s)
    slow = replace(NVME, save_bytes_per_ms=50_000, restore_bytes_per_ms=50_000)
    assert decide_save(BIG, slow, MODEL) == "restore_loses"
    # fast reads, slow writes: a restore would pay, but not enough to cover the write
    slow_writes = replace(NVME, save_bytes_per_ms=500_000)
    assert decide_save(BIG, slow_writes, MODEL) == "not_worth"


def test_expected_reuse_weighs_recency_and_turns() -> None:
    assert return_chance(0, 1, 600) == pytest.approx(2 / 3)
    assert return_chance(600, 1, 600) == pytest.approx(1 / 3)
    assert return_chance(0, 10, 600) > return_chance(0, 1, 600)
    # idle for an hour, the same conversation is no longer worth its write
    stale = replace(BIG, idle_s=3600.0)
    assert decide_save(stale, NVME, MODEL) == "not_worth"


def test_an_ahead_save_never_pushes_out_the_tenants_archives() -> None:
    ahead = replace(BIG, ahead=True, quota_headroom_bytes=BIG.bytes - 1)
    assert decide_save(ahead, NVME, MODEL) == "no_room"
    assert decide_save(replace(ahead, quota_headroom_bytes=BIG.bytes), NVME, MODEL) == SAVE
    # at eviction the store makes room by its eviction policy, as before
    assert decide_save(replace(ahead, ahead=False), NVME, MODEL) == SAVE


def test_the_structural_rules_come_first() -> None:
    assert decide_save(replace(BIG, evicted=Evicted(4096, 0, None)), NVME, MODEL) == "nobody"
    short = replace(BIG, evicted=Evicted(MIN_TOKENS - 1, 0, "t"))
    assert decide_save(short, NVME, MODEL) == "too_short"


def test_only_what_no_archive_holds_is_at_stake() -> None:
    # 4096 tokens, 4000 of them archived: a save would spare prefilling 96 tokens (12 ms),
    # not worth a 215 ms write; with none archived it is (above)
    grown = replace(BIG, archived_tokens=4000)
    assert decide_save(grown, NVME, MODEL) == "not_worth"
    half = replace(BIG, archived_tokens=2048)
    assert decide_save(half, replace(NVME, prefill_ms_per_token=1.0), MODEL) == SAVE


def test_a_copy_in_the_servers_ram_cache_weighs_by_its_chance_of_loss() -> None:
    # 512 ms spared by a 181 ms restore, at 0.8 return chance: 265 ms against a 215 ms write
    assert decide_save(replace(BIG, loss_chance=1.0), NVME, MODEL) == SAVE
    assert decide_save(replace(BIG, loss_chance=0.5), NVME, MODEL) == "not_worth"
    assert decide_save(replace(BIG, loss_chance=0.0), NVME, MODEL) == "not_worth"


def test_another_tenants_request_never_waits_for_a_save() -> None:
    timed = replace(BIG, timed_by_other_tenant=True)
    assert decide_save(BIG, NVME, MODEL) == SAVE
    assert decide_save(timed, NVME, MODEL) == "other_tenant"
    # in the background nobody waits: the cost model decides as for anyone
    assert decide_save(replace(timed, ahead=True), NVME, MODEL) == SAVE


def test_before_any_prefill_is_measured_the_only_copy_is_saved() -> None:
    # prefill priced by a guess (a tenth of what it costs here): the write looks dearer than
    # what a restore spares, yet the state has no other copy and nothing measured says so
    guessed = replace(NVME, prefill_ms_per_token=0.0125, prefill_measured=False)
    assert decide_save(BIG, replace(guessed, prefill_measured=True), MODEL) != SAVE
    assert decide_save(BIG, guessed, MODEL) == SAVE
    # a copy elsewhere, or a save nobody waits for, is still weighed by the cost model
    assert decide_save(replace(BIG, loss_chance=0.5), guessed, MODEL) != SAVE
    assert decide_save(replace(BIG, ahead=True), guessed, MODEL) != SAVE
    # and the structural rules hold all the same
    short = replace(BIG, evicted=Evicted(MIN_TOKENS - 1, 0, "t"))
    assert decide_save(short, guessed, MODEL) == "too_short"


def test_before_saves_have_measured_the_disk_the_only_copy_is_saved() -> None:
    # the first evictions of a run: the write is priced at a guess, or at one first write ten
    # times slower than this disk's, three slots wait for it, and the cost model would drop
    # the only copy
    guessed = replace(NVME, save_bytes_per_ms=250_000, busy_slots=3, save_measured=False)
    assert decide_save(BIG, replace(guessed, save_measured=True), MODEL) != SAVE
    assert decide_save(BIG, guessed, MODEL) == SAVE
    # a copy in the server's RAM cache, or a save in the background, is weighed as ever
    assert decide_save(replace(BIG, loss_chance=0.5), guessed, MODEL) != SAVE
    assert decide_save(replace(BIG, ahead=True), guessed, MODEL) != SAVE


def test_of_a_branching_text_only_its_branch_point_is_at_stake() -> None:
    # 4096 tokens held, but its request reused the first 3072 (a document) and asked its own
    # question after it, as its tenant's requests do: a return would reuse the document, not
    # the last question
    branching = replace(BIG, returns_with=3072, continues=0.0)
    slow_prefill = replace(NVME, prefill_ms_per_token=1.0)  # a larger model
    assert decide_save(branching, slow_prefill, MODEL) == SAVE
    # a return reads the whole file for 3072 tokens: on the GPU, not worth its write
    assert decide_save(BIG, NVME, MODEL) == SAVE
    assert decide_save(branching, NVME, MODEL) == "not_worth"
    # once an archive holds the document, saving the last question spares nothing, however
    # little is measured yet
    archived = replace(branching, archived_tokens=3072)
    assert decide_save(archived, slow_prefill, MODEL) == "archived"
    assert decide_save(archived, replace(slow_prefill, save_measured=False), MODEL) == "archived"
    # a conversation's next turn would reuse all of it: the 1024 tokens after the archive count
    assert decide_save(replace(BIG, archived_tokens=3072), slow_prefill, MODEL) == SAVE
    # and so do they, in part, for a tenant whose requests also continue what they reuse
    mixed = replace(archived, continues=0.5)
    assert decide_save(mixed, slow_prefill, MODEL) == SAVE
    assert decide_save(replace(mixed, continues=0.05), slow_prefill, MODEL) == "not_worth"


# The kv-heavy test model on this kind of 2-core CPU: a 512-token conversation is 32 MiB; the
# server computes 2,000 prompt tokens a second across its batches, writes 600 MiB/s and reads
# 4 GB/s inside its main loop; a save or restore on a request's path adds a 20 ms round trip
KV_HEAVY = SaveCandidate(
    evicted=Evicted(n_tokens=512, kept=0, owner="t"),
    bytes=512 * 64 * 1024,
    idle_s=0.0,
    turns=1,
    quota_headroom_bytes=None,
    ahead=False,
)
CPU = DiskRates(
    prefill_ms_per_token=0.5,
    save_bytes_per_ms=600 * 1024 * 1024 / 1000,
    restore_bytes_per_ms=4_000_000,
    restore_overhead_ms=20.0,
    save_overhead_ms=20.0,
)


def test_a_save_is_priced_by_every_slot_it_stalls() -> None:
    # a 53 ms write; a return would prefill 256 ms or restore in 28 ms, at 2/3 chance: 152 ms
    # spared. Alone, the save costs its 53 ms and the round trip: worth it; with three other
    # slots decoding, each of them waits the 53 ms too
    assert decide_save(KV_HEAVY, CPU, MODEL) == SAVE
    assert decide_save(KV_HEAVY, replace(CPU, busy_slots=3), MODEL) == "busy"


def test_the_prefill_a_return_would_need_stalls_the_slots_busy_then() -> None:
    # the same three busy slots when the conversation comes back would wait for its prefill
    loaded = replace(CPU, busy_slots=3, busy_at_return=3.0)
    assert decide_save(KV_HEAVY, loaded, MODEL) == SAVE


def test_a_background_save_waits_for_a_quiet_server() -> None:
    ahead = replace(KV_HEAVY, ahead=True)
    assert decide_save(ahead, replace(CPU, busy_slots=3), MODEL) == "busy"
    # with no slot busy nobody waits for it: only the disk bandwidth budget limits it
    assert decide_save(ahead, CPU, MODEL) == SAVE


def test_the_evicting_request_waits_for_the_round_trip() -> None:
    # a save on a request's path adds its round trip (200 ms here, a distant server) to that
    # request: it pays it, a background save does not
    slow_turn = replace(CPU, save_overhead_ms=200.0)
    assert decide_save(KV_HEAVY, slow_turn, MODEL) == "not_worth"
    assert decide_save(replace(KV_HEAVY, ahead=True), slow_turn, MODEL) == SAVE


def test_a_restore_stalls_every_busy_slot_and_delays_its_own_request_only() -> None:
    # 200 tokens: 100 ms of the server's prefill, against an 8 ms read and a 100 ms wait that
    # only the request itself sees; with three other slots busy, each waits for the prefill,
    # and for the read
    costs = RestoreCosts(0.5, 4_000_000, 100.0)
    state = 512 * 64 * 1024
    assert not restore_pays(200, state, costs)
    assert restore_pays(200, state, replace(costs, busy_slots=3))
    assert restore_pays(300, state, costs)


def test_beside_busy_slots_a_save_on_the_path_sends_its_request_a_batch_later() -> None:
    # the save of KV_HEAVY pays beside three busy slots when a return would stall them too
    # (647 ms spared, against 232 ms). With 400 ms batches, the request behind the save and
    # the returning one behind its restore each go out a batch later: 380 ms spared, against
    # 632 ms
    loaded = replace(CPU, busy_slots=3, busy_at_return=3.0)
    assert decide_save(KV_HEAVY, loaded, MODEL) == SAVE
    long_batches = replace(loaded, batch_wait_ms=400.0)
    assert decide_save(KV_HEAVY, long_batches, MODEL) == "not_worth"
    # a background save has no request behind it, and a quiet server no batch under way
    assert (
        decide_save(replace(KV_HEAVY, ahead=True), replace(long_batches, busy_slots=0), MODEL)
        == SAVE
    )
    assert decide_save(KV_HEAVY, replace(CPU, batch_wait_ms=400.0), MODEL) == SAVE


def test_beside_busy_slots_a_restore_sends_its_request_a_batch_later() -> None:
    # 300 tokens: 150 ms of prefill against an 8 ms read and a 100 ms round trip: it pays, and
    # beside three busy slots (each waiting for the prefill) it pays even more, unless the
    # prompt, sent after the read, waits a long batch of theirs again
    costs = RestoreCosts(0.5, 4_000_000, 100.0, batch_wait_ms=1000.0)
    state = 512 * 64 * 1024
    assert restore_pays(300, state, costs)  # alone: no batch under way
    assert restore_pays(300, state, replace(costs, busy_slots=3, batch_wait_ms=200.0))
    assert not restore_pays(300, state, replace(costs, busy_slots=3))


def test_a_whole_copy_is_read_where_it_costs_less_than_putting_the_prefix_together() -> None:
    fields = {
        "id": "ar_0", "tenant_id": "t", "file_name": "a.slot", "path": Path("a.slot"),
        "fingerprint": "f", "n_tokens": 1000, "bytes": 100_000, "created": 0.0,
        "last_used": 0.0, "hits": 0,
    }  # fmt: skip
    whole, blocks = Archive(**fields), Archive(**fields, blocks=True)
    copied = Archive(**fields, blocks=True, whole_copy=True)
    # the server reads 1000 bytes a ms, the proxy puts files together at 1000 bytes a ms too:
    # the copy (100 ms) pays from half of the archive on (50 ms read + 50 ms put together)
    costs = RestoreCosts(
        prefill_ms_per_token=1.0, restore_bytes_per_ms=1000.0, restore_overhead_ms=2.0,
        assemble_bytes_per_ms=1000.0,
    )  # fmt: skip
    assert restored_bytes(whole, 100, costs) == (100_000, False)  # a whole file is read whole
    assert restored_bytes(blocks, 100, costs) == (10_000, True)
    assert restored_bytes(blocks, 1000, costs) == (100_000, True)
    assert restored_bytes(copied, 500, costs) == (50_000, True)  # as dear: the prefix
    assert restored_bytes(copied, 501, costs) == (100_000, False)
    assert restored_bytes(copied, 1000, costs) == (100_000, False)
    # where putting a file together costs nothing, the prefix is put together
    free = replace(costs, assemble_bytes_per_ms=float("inf"))
    assert restored_bytes(copied, 1000, free) == (100_000, True)
    # busy slots wait for the server's read, not for the proxy's: the copy pays later
    busy = replace(costs, busy_slots=1.0)
    assert restored_bytes(copied, 666, busy) == (66_600, True)
    assert restored_bytes(copied, 667, busy) == (100_000, False)


def test_a_save_prices_the_return_as_read_from_its_whole_copy_where_copies_are_kept() -> None:
    # putting 512 MiB together at 1 GB/s (537 ms) on top of the read (179 ms) costs more than
    # the prefill it spares (512 ms); the return reads the whole copy instead where one is kept
    with_blocks = replace(NVME, assemble_bytes_per_ms=1_000_000)
    assert decide_save(BIG, with_blocks, MODEL) == "restore_loses"
    assert decide_save(BIG, replace(with_blocks, whole_copies=True), MODEL) == SAVE


def test_a_write_begins_beside_the_lookup_only_where_losing_it_costs_less_than_it_spares() -> None:
    # 2.5 MB written at 2.5 GB/s: 1 ms of the server's loop; room for it, a cut and two restores
    state, room = 2_500_000, 10_000_000
    assert write_beside_lookup(SAVE, state, NVME, 1.0, room)
    assert not write_beside_lookup(SAVE, state, NVME, 0.99, room)
    # every busy slot waits for a write the lookup may turn down
    busy = replace(NVME, busy_slots=3)
    assert not write_beside_lookup(SAVE, state, busy, 3.9, room)
    assert write_beside_lookup(SAVE, state, busy, 4.0, room)
    # a save the model would not make with nothing archived is not begun early
    for decision in ("not_worth", "other_tenant", "busy", "restore_loses", "too_short"):
        assert not write_beside_lookup(decision, state, NVME, 1000.0, room)
    # no lookup measured yet
    assert not write_beside_lookup(SAVE, 1, NVME, 0.0, room)
    # a file system without that room, or whose room is not known yet
    assert not write_beside_lookup(SAVE, state, NVME, 1000.0, room - 1)
    assert not write_beside_lookup(SAVE, state, NVME, 1000.0, None)


def test_archiving_is_given_up_only_when_no_restore_was_ever_reused() -> None:
    def seen(*outcomes: RestoreOutcome) -> RestoreYield:
        state = RestoreYield()
        for outcome in outcomes:
            state = restore_seen(state, outcome)
        return state

    assert restores_carry(seen())
    assert restores_carry(seen(LOST))  # one could be a fault
    assert not restores_carry(seen(*[LOST] * RESTORES_TO_JUDGE))
    assert restores_carry(seen(*[BRANCHED] * (BRANCHES_TO_JUDGE - 2), LOST))
    assert not restores_carry(seen(*[BRANCHED] * (BRANCHES_TO_JUDGE - 1), LOST))
    assert not restores_carry(seen(*[BRANCHED] * BRANCHES_TO_JUDGE))
    # a server that reused one restore reuses restores: the others met faults or branched
    assert restores_carry(seen(CARRIED, LOST, LOST, *[BRANCHED] * BRANCHES_TO_JUDGE))


def test_a_state_beyond_the_kv_cache_is_restored_only_for_a_request_continuing_all_of_it() -> None:
    assert restore_is_whole(0, state_after_kv=True)
    assert restore_is_whole(1, state_after_kv=True)  # its window all in the file still
    assert not restore_is_whole(2, state_after_kv=True)
    assert not restore_is_whole(300, state_after_kv=True)
    # a KV cache alone: the server drops what the request does not reuse, exactly
    assert restore_is_whole(300, state_after_kv=False)


def test_a_state_restored_whole_only_is_priced_by_the_turns_that_continue_it_to_its_end() -> None:
    """On a server whose state goes on after its KV cache, a return that branches off an
    archive gets nothing of it: the save is weighed by the tenant's turns that continue their
    text to its very end, not by those that continue it within the slack."""
    costs = SaveCosts(DiskTierSettings(), ProxyMetrics())
    content = SlotContent(tuple(range(4096)), 0, "t", turns=3, continues=1.0, continues_exactly=0.0)
    plain, windowed = AttachedUpstream("fp"), AttachedUpstream("fp", state_after_kv=True)
    assert costs.save_candidate(content, 0, plain, ahead=False).continues == 1.0
    candidate = costs.save_candidate(content, 0, windowed, ahead=False)
    assert (candidate.returns_with, candidate.continues) == (0, 0.0)
    assert decide_save(candidate, NVME, MODEL) == "archived"  # a return would reuse nothing
    assert decide_save(costs.save_candidate(content, 0, plain, ahead=False), NVME, MODEL) == SAVE
