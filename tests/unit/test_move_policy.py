"""When moving a conversation between servers beats prefilling it: the pure cost model."""

from __future__ import annotations

from cacheproxy.disk.policy import MoveCosts, move_pays

COSTS = MoveCosts(
    prefill_ms_per_token=0.5,
    save_bytes_per_ms=100_000.0,
    save_overhead_ms=2.0,
    restore_bytes_per_ms=100_000.0,
    restore_overhead_ms=2.0,
)


def test_a_move_pays_when_save_and_restore_cost_less_than_the_prefill() -> None:
    # 600 tokens of 100 KiB: 2 + 6 + 2 + 6 ms against 300 ms of prefill
    assert move_pays(600, 600 * 1024, COSTS)


def test_a_move_does_not_pay_when_the_file_is_slow_to_write_and_read() -> None:
    slow_disk = MoveCosts(0.5, 1_000.0, 2.0, 1_000.0, 2.0)  # 1 MB/s each way
    assert not move_pays(600, 600 * 1024, slow_disk)


def test_less_than_a_block_never_moves() -> None:
    assert not move_pays(63, 1, COSTS)


def test_the_round_trips_alone_can_outweigh_a_small_gain() -> None:
    far = MoveCosts(0.01, 1e9, 50.0, 1e9, 50.0)  # another host, 50 ms each way
    assert not move_pays(1000, 1024, far)
    assert move_pays(20_000, 1024, far)
