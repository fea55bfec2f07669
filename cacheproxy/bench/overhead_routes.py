"""What the proxy adds on each route, one request at a time and at concurrency 8 and 64, and
where its time goes, stage by stage.

Each route's request is fresh text every time (no memo helps), as a client's next question is:
`/completion` of 8 token ids, a chat of a 200-word system prompt and a new question, and the same
over `/v1/messages`. At each level the arms take turns (`rounds` rounds, the order rotated):
llama-server itself, the bare pass-through, the proxy, and a second proxy with the stage clock
on (`[tracing] stage_clock`, ops/stage_clock.py), whose per-stage counters, read from its
`/metrics` before and after, give the breakdown. The added latency is the untimed proxy's, so
the clock's own few microseconds a stage do not count in it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import aiohttp

from cacheproxy.bench.harness import (
    JSON_HEADERS,
    BenchmarkError,
    fail_on_bad_status,
    process_cpu_s,
    progress,
    rotated,
    table_row,
)
from cacheproxy.bench.run_counters import metric_samples

LEVELS = (1, 8, 64)
SYSTEM_PROMPT = (
    "You are a careful assistant for a small team of engineers. Answer in plain words, keep "
    "every answer short, say when you do not know, and never invent a file, a command or a "
    "figure. When a question is about code, name the function and the module it lives in, and "
    "show the smallest change that would do. When a question is about the weather, the tides, "
    "the trains or the opening hours of the library, say where the answer can be found rather "
    "than guessing it. Prefer lists of a few items to long paragraphs, and give each item one "
    "line. If the question is ambiguous, ask one question back before answering. Keep the "
    "tone friendly and plain, without exclamation marks, and never repeat the question. The "
    "team works in several time zones and reads answers later, so give every answer enough "
    "context to stand on its own, and end with the one thing the reader should do next. "
)
# the stages as the stage clock names them, in the order a request meets them; (name, shown
# as, indent): inclusive times, nested stages indented under the one that holds them
STAGE_ROWS = (
    ("front door", "front door (request - handler)", 0),
    ("auth", "auth", 0),
    ("admit", "admit", 0),
    ("meter", "meter", 0),
    ("mirror", "mirror", 0),
    ("place", "place", 0),
    ("queue wait", "queue wait", 1),
    ("disk", "disk tier", 0),
    ("forward", "forward", 0),
    ("upstream", "upstream exchange", 1),
    ("record", "record", 0),
    ("account", "account", 0),
    ("other", "other (handler - the above)", 0),
    ("request", "whole request", 0),
    ("headers", "rate headers (as the answer is prepared)", 0),
)
TOP_STAGES = ("auth", "admit", "meter", "mirror", "place", "disk", "forward", "record", "account")

RequestMaker = Callable[[int], tuple[str, bytes]]


def _question(index: int) -> str:
    return f"Question {index} at {time.perf_counter_ns()}: what should I check first today?"


def completion_request(index: int) -> tuple[str, bytes]:
    body = {"prompt": [1000, 2345, 4567, 7890, 12000, 15555, 21000, 29000], "n_predict": 1}
    return "/completion", json.dumps({**body, "temperature": 0}).encode()


def chat_request(index: int) -> tuple[str, bytes]:
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": _question(index)},
    ]
    body = {"messages": messages, "n_predict": 1, "temperature": 0}
    return "/v1/chat/completions", json.dumps(body).encode()


def messages_request(index: int) -> tuple[str, bytes]:
    body = {
        "model": "bench",
        "max_tokens": 1,
        "temperature": 0,
        "system": SYSTEM_PROMPT,
        "messages": [{"role": "user", "content": _question(index)}],
    }
    return "/v1/messages", json.dumps(body).encode()


ROUTES: dict[str, RequestMaker] = {
    "/completion": completion_request,
    "/v1/chat/completions": chat_request,
    "/v1/messages": messages_request,
}


@dataclass(frozen=True)
class Arm:
    """One way to the server: its name in the report and the base URL requests go to."""

    name: str
    base_url: str


@dataclass(frozen=True)
class RouteRun:
    """One route at one level: every arm's latencies, its front process's CPU (None: direct),
    and the timed proxy's stage counters over its requests."""

    route: str
    level: int
    latencies_ms: dict[str, list[float]]
    cpu_s: dict[str, float | None]
    stages_wall_s: dict[str, float]
    stages_cpu_s: dict[str, float]

    def p50(self, arm: str) -> float:
        return statistics.median(self.latencies_ms[arm])

    def cpu_us_per_request(self, arm: str) -> float | None:
        cpu = self.cpu_s.get(arm)
        return None if cpu is None else 1e6 * cpu / max(len(self.latencies_ms[arm]), 1)

    def stage_ms(self, stage: str, clock: str = "wall") -> float:
        """A stage's mean milliseconds a request in the timed proxy."""
        figures = self.stages_wall_s if clock == "wall" else self.stages_cpu_s
        return 1000 * figures.get(stage, 0.0) / max(len(self.latencies_ms["timed"]), 1)


async def _timed_request(
    session: aiohttp.ClientSession, base_url: str, path: str, body: bytes
) -> float:
    started = time.perf_counter()
    async with session.post(base_url + path, data=body, headers=JSON_HEADERS) as response:
        await fail_on_bad_status(response)
        await response.read()
    return 1000 * (time.perf_counter() - started)


async def _closed_loop(
    session: aiohttp.ClientSession, arm: Arm, make: RequestMaker, level: int, count: int
) -> list[float]:
    """`count` requests from `level` clients, each sending its next as its last is answered."""
    latencies: list[float] = []
    issued = [0]

    async def client() -> None:
        while issued[0] < count:
            issued[0] += 1
            path, body = make(issued[0])
            latencies.append(await _timed_request(session, arm.base_url, path, body))

    try:
        await asyncio.gather(*(client() for _ in range(level)))
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchmarkError(f"{arm.name} arm ({arm.base_url}) failed: {exc!r}") from exc
    return latencies


def _stage_seconds(samples: dict[str, float], clock: str) -> dict[str, float]:
    prefix = "cacheproxy_stage_seconds_total{"
    figures = {}
    for name, value in samples.items():
        if name.startswith(prefix) and f'clock="{clock}"' in name:
            stage = name.split('stage="', 1)[1].split('"', 1)[0]
            figures[stage] = value
    figures["queue wait"] = samples.get("cacheproxy_queue_wait_seconds_sum", 0.0)
    return figures


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


async def measure_routes(
    session: aiohttp.ClientSession,
    arms: Sequence[Arm],
    pids: dict[str, int],
    admin_headers: dict[str, str],
    requests: int,
    rounds: int,
) -> list[RouteRun]:
    """Every route at every level, the arms (direct, bare, proxy, timed) in turns."""
    timed = next(arm for arm in arms if arm.name == "timed")
    runs = []
    for level in LEVELS:
        per_round = max(requests // rounds, 2 * level)
        for route, make in ROUTES.items():
            progress(f"routes: {route} at concurrency {level}, {rounds} x {per_round} per arm")
            await _closed_loop(session, timed, make, level, level)  # connections opened
            latencies: dict[str, list[float]] = {arm.name: [] for arm in arms}
            cpu: dict[str, float | None] = {arm.name: None for arm in arms}
            before = await _samples(session, timed, admin_headers)
            for round_index in range(rounds):
                for arm in rotated(arms, round_index):
                    pid = pids.get(arm.name)
                    cpu_before = process_cpu_s(pid) if pid is not None else 0.0
                    latencies[arm.name] += await _closed_loop(session, arm, make, level, per_round)
                    if pid is not None:
                        cpu[arm.name] = (cpu[arm.name] or 0.0) + process_cpu_s(pid) - cpu_before
            after = await _samples(session, timed, admin_headers)
            runs.append(
                RouteRun(
                    route,
                    level,
                    latencies,
                    cpu,
                    _delta(_stage_seconds(after, "wall"), _stage_seconds(before, "wall")),
                    _delta(_stage_seconds(after, "cpu"), _stage_seconds(before, "cpu")),
                )
            )
    return runs


async def _samples(
    session: aiohttp.ClientSession, arm: Arm, headers: dict[str, str]
) -> dict[str, float]:
    return await metric_samples(session, arm.base_url, headers)


# --- the report ---------------------------------------------------------------------------


def added_latency_rows(runs: Sequence[RouteRun]) -> Iterator[str]:
    yield table_row(
        [
            "route",
            "concurrency",
            "direct p50",
            "bare p50",
            "proxy p50",
            "proxy - bare",
            "bare - direct",
            "bare CPU us/req",
            "proxy CPU us/req",
        ]
    )
    yield table_row(["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"])
    for run in runs:
        direct, bare, proxy = run.p50("direct"), run.p50("bare"), run.p50("proxy")
        yield table_row(
            [
                f"`{run.route}`",
                str(run.level),
                f"{direct:.3f}",
                f"{bare:.3f}",
                f"{proxy:.3f}",
                f"{proxy - bare:+.3f}",
                f"{bare - direct:+.3f}",
                _us(run.cpu_us_per_request("bare")),
                _us(run.cpu_us_per_request("proxy")),
            ]
        )


def stage_rows(runs: Sequence[RouteRun], route: str) -> Iterator[str]:
    """A route's stages (rows) at each level (columns): mean ms a request, inclusive; the
    loop's CPU one request at a time beside the wall clock."""
    chosen = [run for run in runs if run.route == route]
    header = ["stage"]
    for run in chosen:
        header.append(f"wall c{run.level}")
        if run.level == 1:
            header.append("CPU c1")
    yield table_row(header)
    yield table_row(["---"] + ["---:"] * (len(header) - 1))
    for stage, shown, indent in STAGE_ROWS:
        cells = ["&nbsp;&nbsp;" * indent + shown]
        for run in chosen:
            cells.append(f"{_stage_figure(run, stage, 'wall'):.3f}")
            if run.level == 1:
                cells.append(
                    "—" if stage == "queue wait" else f"{_stage_figure(run, stage, 'cpu'):.3f}"
                )
        yield table_row(cells)


def _stage_figure(run: RouteRun, stage: str, clock: str) -> float:
    if stage == "front door":
        return run.stage_ms("request", clock) - run.stage_ms("handler", clock)
    if stage == "other":
        inside = sum(run.stage_ms(name, clock) for name in TOP_STAGES)
        return run.stage_ms("handler", clock) - inside
    return run.stage_ms(stage, clock)


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def routes_markdown(runs: Sequence[RouteRun], rounds: int) -> list[str]:
    if not runs:
        return []
    lines = [
        f"## Added latency by route, ms ({rounds} rounds per arm and level, arms alternated,"
        " closed loop; every request fresh text)",
        "",
        "proxy - bare: what the proxy adds over the bare relay (targets at concurrency 1 and 8:"
        " /completion at most 1.0, chat and /v1/messages at most 1.5). CPU us/req: the front"
        " process's CPU over its runs, per request.",
        "",
        *added_latency_rows(runs),
        "",
        "## Where the proxy's time goes, ms a request (the stage-clock proxy; inclusive times,"
        " nested stages indented)",
    ]
    for route in ROUTES:
        lines += ["", f"### `{route}`", "", *stage_rows(runs, route)]
    return lines


def routes_as_json(runs: Sequence[RouteRun]) -> list[dict]:
    return [
        {
            "route": run.route,
            "concurrency": run.level,
            "p50_ms": {arm: run.p50(arm) for arm in run.latencies_ms},
            "requests": {arm: len(values) for arm, values in run.latencies_ms.items()},
            "cpu_us_per_request": {arm: run.cpu_us_per_request(arm) for arm in run.cpu_s},
            "stages_ms": {
                stage: {
                    "wall": _stage_figure(run, stage, "wall"),
                    "cpu": _stage_figure(run, stage, "cpu"),
                }
                for stage, _, _ in STAGE_ROWS
            },
        }
        for run in runs
    ]
