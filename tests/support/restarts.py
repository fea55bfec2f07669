"""A server restart the proxy finds while a request already runs on the new process: the case
where the upstream stays in service and its table is emptied in place (slots/monitor.py)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from cacheproxy.http.app_keys import CACHE
from tests.support.waiting import wait_for


async def found_under_a_request(app: web.Application, long_answer: asyncio.Future) -> None:
    """After a restart of the first upstream's server, with `long_answer` (a request sent
    since) running on the new process: once it holds a slot, the monitor checks the slots now
    (as after an answer that shows less cached than predicted), and finds the task ids begun
    again with that slot busy. `long_answer` must still run then, or the restart was found
    another way (a rebuild, not in place)."""
    cache = app[CACHE]
    table = cache.tables[0]
    assert table.tasks_answered >= 3, "too few tasks counted to tell a restart by"
    await wait_for(lambda: any(slot.busy for slot in table.slots), "the long answer placed")
    cache.monitor.wake()
    await wait_for(lambda: table.tasks_answered == 0, "the restart found in place")
    assert not long_answer.done(), "the long answer ended too soon"
