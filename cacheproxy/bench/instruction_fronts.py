"""The fronts `bench instructions` counts, what they are counted in front of, how a request is
sent to one, and the run of counting windows both counters make (the instructions' here,
the bytecodes' in bytecodes.py)."""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from cacheproxy.bench.harness import (
    JSON_HEADERS,
    ProcessSet,
    fail_on_bad_status,
    progress,
    wait_healthy,
)
from cacheproxy.bench.overhead_bed import proxy_env
from cacheproxy.bench.overhead_routes import ROUTES


@dataclass(frozen=True)
class Front:
    """A front process measured: its name, what it is, and how its environment differs from
    the proxy's as `bench overhead` runs it (None: the bare pass-through)."""

    name: str
    description: str
    env_changes: dict[str, str | None] | None  # a value of None: the variable is unset
    tenant: bool = True  # its requests carry the tenant's key


FRONTS = (
    Front("bare", "the bare aiohttp pass-through", None),
    Front("proxy", "the proxy, every feature on (as `bench overhead`)", {}),
    Front("no-limits", "the proxy without rate limits and budgets", {"CACHEPROXY_LIMITS__": None}),
    Front("no-disk", "the proxy without the disk tier", {"CACHEPROXY_DISK__ENABLED": "false"}),
    Front("no-tenants", "the proxy in single-user mode (no registry)", {}, tenant=False),
    Front(
        "core",
        "the proxy with none of the three (its request path alone)",
        {"CACHEPROXY_LIMITS__": None, "CACHEPROXY_DISK__ENABLED": "false"},
        tenant=False,
    ),
)
FRONT_NAMES = tuple(front.name for front in FRONTS)

# The proxy's timers spaced out past a run, so that what is counted is the requests' work: a
# health check every 2 s (or the archive-ahead round, the ledger's flush, the upstream metrics'
# read) falls in a window as often as the machine is slow to run it under callgrind, and its
# instructions then moved the figure by more than what the fronts differ in
QUIET_TIMERS = {
    "CACHEPROXY_ROUTING__HEALTH_INTERVAL_S": "3600",
    "CACHEPROXY_ROUTING__RECONCILE_INTERVAL_S": "3600",
    "CACHEPROXY_DISK__AHEAD_INTERVAL_S": "3600",
    "CACHEPROXY_USAGE__FLUSH_INTERVAL_S": "3600",
    "CACHEPROXY_UPSTREAM_METRICS_INTERVAL_S": "3600",
}

# Counts are taken in windows until two in a row agree within this share: a front's one-time
# work (the proxy proving its in-process tokenizer in the background) is then over
STEADY_SHARE = 0.02
MAX_WINDOWS = 8


def steady(counts: Sequence[float]) -> bool:
    """Whether the last two windows' counts a request agree within `STEADY_SHARE`."""
    return len(counts) >= 2 and abs(counts[-1] - counts[-2]) <= STEADY_SHARE * counts[-2]


def front_env(processes: ProcessSet, front: Front) -> dict[str, str]:
    """The proxy's environment as `bench overhead` gives it, its timers quiet (`QUIET_TIMERS`),
    with the front's changes (a name ending in "__" unsets every variable it starts); a state
    and an archive folder of its own."""
    env = {**proxy_env(processes), **QUIET_TIMERS}
    for name, value in (front.env_changes or {}).items():
        if value is not None:
            env[name] = value
        else:
            env = {key: kept for key, kept in env.items() if not key.startswith(name)}
    state = processes.workdir / f"state-{front.name}"
    archives = processes.workdir / "slots" / front.name  # llama-server writes below its path
    archives.mkdir(parents=True, exist_ok=True)
    if front.tenant:  # the registry the run's tenant was created in, copied
        state.mkdir(exist_ok=True)
        for registry_file in (processes.workdir / "proxy-state").glob("cacheproxy.db*"):
            shutil.copy(registry_file, state / registry_file.name)  # with its WAL, if any
    env["CACHEPROXY_STATE_DIR"] = str(state)
    env["CACHEPROXY_DISK__DIRECTORY"] = str(archives)
    return env


async def send(
    session: aiohttp.ClientSession, url: str, route: str, index: int, key: str | None
) -> None:
    path, body = ROUTES[route](index)
    headers = {**JSON_HEADERS, **({"Authorization": f"Bearer {key}"} if key else {})}
    async with session.post(url + path, data=body, headers=headers) as response:
        await fail_on_bad_status(response)
        await response.read()


@dataclass(frozen=True)
class CountingBed:
    """What every front is counted in front of: the run's processes, a client session, the
    llama-server, the tenant's key, and the requests sent to each route."""

    processes: ProcessSet
    session: aiohttp.ClientSession
    upstream: str
    api_key: str
    routes: Sequence[str]
    requests: int
    warmup: int


def window_size(requests: int) -> int:
    """Requests a counting window holds: half of `requests` (two windows must agree)."""
    return max(requests // 2, 1)


WindowCount = TypeVar("WindowCount")
# (process id, route, the window's request numbers, the tenant's key or None) -> the count
CountWindow = Callable[[int, str, range, str | None], Awaitable[WindowCount]]


async def count_windows(
    bed: CountingBed,
    front: Front,
    name: str,
    args: Sequence[str],
    env: dict[str, str] | None,
    url: str,
    count: CountWindow[WindowCount],
    per_request: Callable[[WindowCount], float],
) -> dict[str, list[WindowCount]]:
    """Start `args` as process `name` (healthy at `url`), then per route `bed.warmup`
    requests uncounted and windows of half `bed.requests` requests, each counted by `count`,
    until two in a row agree (`steady`, on `per_request` of each) or `MAX_WINDOWS` were
    counted; route -> its windows. The process is stopped after."""
    bed.processes.start(name, args, env=env)
    await wait_healthy(bed.session, bed.processes.find(name), url)
    pid = bed.processes.find(name).process.pid
    key = bed.api_key if front.tenant else None
    window = window_size(bed.requests)
    windows: dict[str, list[WindowCount]] = {}
    sent = 0
    for route in bed.routes:
        for _ in range(bed.warmup):
            sent += 1
            await send(bed.session, url, route, sent, key)
        counted = windows[route] = []
        while not steady([per_request(c) for c in counted]) and len(counted) < MAX_WINDOWS:
            counted.append(await count(pid, route, range(sent + 1, sent + window + 1), key))
            sent += window
        progress(f"{name} {route}: {per_request(counted[-1]):,.0f} a request (last window)")
    bed.processes.stop_named(name)
    return windows
