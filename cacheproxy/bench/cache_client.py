"""How `cacheproxy bench cache` talks to llama-server (directly or through the proxy): the
completion bodies, the streamed answers, and what each completion and each arm measured."""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from cacheproxy.bench.harness import STREAM_HEADERS, BenchmarkError, fail_on_bad_status, progress
from cacheproxy.bench.workloads import Exchange, Request, Tokens, oracle

# The llama-spm vocabulary's byte-fallback tokens <0x00>..<0xFF> are ids 3..258. llama-server
# streams no chunk (so no id) for a token that leaves incomplete UTF-8, and random weights pick
# byte tokens often: they are forbidden, so every generated id arrives in the stream.
BYTE_TOKEN_FIRST_ID = 3
BYTE_TOKEN_COUNT = 256
PROGRESS_EVERY = 16


def tenant_key(tenant: str) -> str:
    """The API key a tenant's client would hold; a proxy with tenants tells them apart by it."""
    return f"key-{tenant}"


def byte_token_ids() -> tuple[int, ...]:
    return tuple(range(BYTE_TOKEN_FIRST_ID, BYTE_TOKEN_FIRST_ID + BYTE_TOKEN_COUNT))


async def post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, data=orjson.dumps(body), headers=STREAM_HEADERS) as response:
        await fail_on_bad_status(response)
        return await response.json()


async def check_byte_tokens(
    session: aiohttp.ClientSession, base_url: str, model: str | None = None
) -> None:
    """The model's ids 3..258 must be the byte tokens <0x00>..<0xFF>: detokenizing the printable
    ASCII ones (the others are not valid UTF-8 on their own) must give those characters back.
    `model`: the one to ask a router-mode server for."""
    printable = range(0x21, 0x7F)
    ids = [BYTE_TOKEN_FIRST_ID + byte for byte in printable]
    body: dict[str, Any] = {"tokens": ids, **({"model": model} if model else {})}
    answer = await post_json(session, base_url + "/detokenize", body)
    expected = bytes(printable).decode("ascii")
    if answer.get("content") != expected:
        raise BenchmarkError(
            f"this model's ids {BYTE_TOKEN_FIRST_ID}..{BYTE_TOKEN_FIRST_ID + BYTE_TOKEN_COUNT - 1}"
            f" are not the byte tokens <0x00>..<0xFF> of the llama-spm vocab: ids {ids[:3]}... "
            f"detokenize to {answer.get('content', '')[:40]!r}, not {expected[:3]!r}..."
        )


async def slot_context_of(
    session: aiohttp.ClientSession, base_url: str, model: str | None = None
) -> int:
    query = f"?model={model}" if model else ""
    async with session.get(base_url + "/props" + query) as response:
        await fail_on_bad_status(response)
        props = await response.json()
    return int(props["default_generation_settings"]["n_ctx"])


def completion_body(request: Request, banned_tokens: Sequence[int]) -> bytes:
    body = {
        "prompt": request.prompt,
        "n_predict": request.n_predict,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": True,
        "logit_bias": [[token, False] for token in banned_tokens],
    }
    if request.model is not None:
        body["model"] = request.model
    return orjson.dumps(body)


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Each `data:` JSON object of the stream; pings and comments skipped.

    Events are split by hand rather than by line: the final event carries the whole prompt as
    text and can be longer than aiohttp's line limit.
    """
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        *complete, buffer = buffer.split(b"\n\n")
        for event in complete:
            for payload in data_payloads(event):
                yield payload
    for payload in data_payloads(buffer):
        yield payload


def data_payloads(event: bytes) -> Iterator[dict[str, Any]]:
    for line in event.splitlines():
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            yield orjson.loads(line[6:])


@dataclass(frozen=True)
class Completion:
    """One request as it happened, with the server's own accounting."""

    request: Request
    issue_index: int
    output: Tokens
    prompt_n: int
    cache_n: int
    ttft_s: float
    total_s: float

    @property
    def exchange(self) -> Exchange:
        return Exchange(self.request.prompt, self.output)

    @property
    def accounted(self) -> bool:
        """Whether cached + decoded tokens add up to the prompt, as they should."""
        return self.cache_n + self.prompt_n == len(self.request.prompt)


@dataclass
class StreamedAnswer:
    """What a completion stream has delivered so far."""

    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    final: dict[str, Any] | None = None

    def take(self, event: dict[str, Any]) -> None:
        if "error" in event:
            raise BenchmarkError(f"the stream ended with an error: {event['error']}")
        if event.get("stop"):
            self.final = event
        elif "prompt_progress" not in event:  # progress chunks carry a fake token id 0
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.tokens.extend(event.get("tokens", ()))

    def timings(self, where: str) -> dict[str, Any]:
        """The final chunk's timings, once checked against the tokens the stream delivered."""
        if self.final is None or "timings" not in self.final:
            raise BenchmarkError(f"{where}: the stream ended without a final chunk with timings")
        timings = self.final["timings"]
        if len(self.tokens) != timings["predicted_n"]:
            raise BenchmarkError(
                f"{where}: the stream delivered {len(self.tokens)} token ids but the server"
                f" generated {timings['predicted_n']}: some ids were not streamed"
            )
        return timings


@dataclass
class CompletionClient:
    """Sends workload requests to one arm, numbering them in the order they are sent."""

    session: aiohttp.ClientSession
    arm: str
    base_url: str
    banned_tokens: tuple[int, ...]
    completions: list[Completion] = field(default_factory=list)
    _issued: Iterator[int] = field(default_factory=itertools.count)
    # each tenant's API key where the proxy has them registered (else `tenant_key`)
    keys: dict[str, str] = field(default_factory=dict)

    async def complete(self, request: Request) -> Completion:
        issue_index = next(self._issued)
        where = f"{self.arm} arm, request {issue_index} ({request.conversation})"
        key = self.keys.get(request.tenant) or tenant_key(request.tenant)
        headers = {**STREAM_HEADERS, "Authorization": f"Bearer {key}"}
        answer = StreamedAnswer()
        started = time.perf_counter()
        try:
            async with self.session.post(
                self.base_url + "/completion",
                data=completion_body(request, self.banned_tokens),
                headers=headers,
            ) as response:
                await fail_on_bad_status(response)
                async for event in sse_events(response):
                    answer.take(event)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchmarkError(f"{where} ({self.base_url}) failed: {exc!r}") from exc
        finished = time.perf_counter()
        timings = answer.timings(where)
        completion = Completion(
            request=request,
            issue_index=issue_index,
            output=tuple(answer.tokens),
            prompt_n=timings["prompt_n"],
            cache_n=timings["cache_n"],
            ttft_s=(answer.first_token_at or finished) - started,
            total_s=finished - started,
        )
        self.completions.append(completion)
        if len(self.completions) % PROGRESS_EVERY == 0:
            progress(f"  {self.arm}: {len(self.completions)} requests done")
        return completion


@dataclass(frozen=True)
class ArmRun:
    workload: str
    cache_ram_mib: int
    arm: str
    completions: tuple[Completion, ...]
    wall_s: float
    restarts: int
    llama_server_command: str
    proxy_command: str | None
    server_cache_ram_mib: int  # what this arm's llama-server ran with
    disk: dict[str, float] = field(default_factory=dict)  # the proxy's disk-tier counters
    # llama-server's own counters and the CPU seconds of its processes (`cache_bench`)
    server: dict[str, float] = field(default_factory=dict)
    repetition: int = 0  # which of `--repeat` runs of its row (0: the first)
    order: int = 0  # its place among every run of the benchmark
    load_average: tuple[float, float, float] | None = None  # the machine's, as it started

    @property
    def in_issue_order(self) -> list[Completion]:
        return sorted(self.completions, key=lambda completion: completion.issue_index)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(completion.request.prompt) for completion in self.completions)

    @property
    def decoded(self) -> int:
        return sum(completion.prompt_n for completion in self.completions)

    @property
    def cached(self) -> int:
        return sum(completion.cache_n for completion in self.completions)

    @functools.cached_property
    def oracle(self) -> int:
        """Per model (no state is shared between two models), summed."""
        by_model: dict[str | None, list[Completion]] = {}
        for completion in self.in_issue_order:
            by_model.setdefault(completion.request.model, []).append(completion)
        return sum(
            sum(oracle(completion.exchange for completion in completions))
            for completions in by_model.values()
        )

    @property
    def unaccounted(self) -> int:
        """Requests whose cache_n + prompt_n is not their prompt length (expected: none)."""
        return sum(not completion.accounted for completion in self.completions)

    def ttft_ms(self, quantile: int) -> float:
        """TTFT percentile `quantile` (1..99) in ms, inclusive method."""
        samples = [completion.ttft_s * 1000 for completion in self.completions]
        if len(samples) < 2:
            return samples[0] if samples else float("nan")
        return statistics.quantiles(samples, n=100, method="inclusive")[quantile - 1]
