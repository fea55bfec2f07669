"""A llama-server restarted between two health checks, told from its slots' task ids."""

from __future__ import annotations

from cacheproxy.slots.monitor import process_restarted


def slot(slot_id: int, id_task: int | None) -> dict:
    entry: dict = {"id": slot_id, "n_ctx": 4096, "is_processing": False}
    if id_task is not None:
        entry["id_task"] = id_task  # present once the slot has run a task
    return entry


def test_the_same_process_shows_a_task_id_at_least_as_high_as_the_tasks_answered() -> None:
    # 10 tasks answered: the last of them has id 9 or more (other clients' tasks only add)
    assert not process_restarted([slot(0, 9), slot(1, 4)], answered=10)
    assert not process_restarted([slot(0, 250), slot(1, None)], answered=10)


def test_a_new_process_numbers_its_tasks_from_zero_again() -> None:
    assert process_restarted([slot(0, 3), slot(1, None)], answered=10)


def test_a_server_that_shows_no_task_ids_tells_nothing() -> None:
    # none ran yet; the embedded engine shows -1 for every slot
    assert not process_restarted([slot(0, None), slot(1, None)], answered=10)
    assert not process_restarted([slot(0, -1), slot(1, -1)], answered=10)


def test_a_slot_the_proxy_ran_a_task_on_shows_a_task_id_in_the_same_process() -> None:
    # slots 0 and 1 ran the proxy's tasks: the same process shows their ids ever after
    assert not process_restarted([slot(0, 9), slot(1, 4), slot(2, None)], 10, tasked={0, 1})


def test_a_new_process_that_ran_nothing_yet_shows_no_task_id_where_the_proxy_ran_one() -> None:
    # restarted (or woken from sleep: its slots made anew) and no task ran since
    assert process_restarted([slot(0, None), slot(1, None)], answered=10, tasked={1})
    # the embedded engine numbers none, but shows -1: not a new process
    assert not process_restarted([slot(0, -1), slot(1, -1)], answered=10, tasked={0, 1})
