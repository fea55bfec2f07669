"""The cache report's per-run notes: what the disk tier did, and what the proxy's loop waited."""

from __future__ import annotations

from cacheproxy.bench.cache_report import disk_line

MIB = 1024 * 1024
DISK = {
    "saves": 2,
    "save_bytes": 3 * MIB,
    "save_s": 0.25,
    "restores": 1,
    "restore_bytes": 1.5 * MIB,
    "restore_s": 0.125,
    "failed_restores": 0,
    "queued": 4,
    "queue_wait_s": 0.5,
}


def test_the_disk_line_gives_saves_restores_and_the_wait_for_a_slot() -> None:
    assert disk_line(DISK) == (
        "disk tier: 2 saves (3.0 MiB, 250 ms), 1 restores (1.5 MiB, 125 ms), 0 failed restores,"
        " 4 requests waited 0.50 s for a slot in all"
    )


def test_with_the_proxy_process_measured_it_adds_its_cpu_and_its_wait_for_a_cpu() -> None:
    line = disk_line({**DISK, "proxy_cpu_s": 1.3, "proxy_waiting_s": 0.7})
    assert line.endswith("; the proxy's CPU 1.3 s, its loop waited 0.7 s for a CPU")


def test_the_servers_answers_to_saves_and_restores_are_averaged_with_its_own_part() -> None:
    line = disk_line(
        {
            **DISK,
            "save_round_trip_s": 0.03,
            "save_round_trips": 4,
            "save_stall_s": 0.002,
            "restore_round_trip_s": 0.012,
            "restore_round_trips": 2,
            "restore_stall_s": 0.001,
        }
    )
    assert line.endswith(
        "; the server answered a save after 7.5 ms (0.50 ms of it the write) and a restore"
        " after 6.0 ms (0.50 ms of it the read) on average"
    )
    # none answered (no disk tier, or figures from before): nothing said
    assert disk_line({**DISK, "save_round_trips": 0.0}) == disk_line(DISK)


def test_the_wait_for_a_slot_is_split_by_what_the_requests_still_waited_for() -> None:
    line = disk_line({**DISK, "wait_slots_busy": 0.125, "wait_busy_slot_chosen": 0.375})
    assert line.endswith(
        " 4 requests waited 0.50 s for a slot in all (busy_slot_chosen 0.38 s, slots_busy 0.12 s)"
    )


def test_a_servers_ram_cache_is_given_as_the_proxy_follows_it() -> None:
    """The shadow's budget and how much of it the server has shown it keeps: what the proxy
    counts on (a budget taken as a fact: all of it); no RAM cache, nothing said."""
    learnt = {**DISK, "ram_cache_budget_bytes": 8192 * MIB, "ram_cache_shown_bytes": 0.0}
    assert disk_line(learnt).endswith(
        "; the server's RAM cache followed at a budget of 8192 MiB, 0.0 MiB of it shown kept"
        " (counted on that far)"
    )
    shown = {**learnt, "ram_cache_budget_bytes": 64 * MIB, "ram_cache_shown_bytes": 12.5 * MIB}
    assert disk_line(shown).endswith(
        "budget of 64 MiB, 12.5 MiB of it shown kept (counted on that far)"
    )
    fact = {**learnt, "ram_cache_shown_bytes": -1.0}
    assert disk_line(fact).endswith("budget of 8192 MiB, taken as a fact")
    assert "RAM cache" not in disk_line(DISK)
