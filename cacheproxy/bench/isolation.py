"""W4, the timing audit: can a tenant tell, by its own first-token latency, that another tenant
primed the prefix it sends?

Two tenants, one llama-server slot (so a primed prefix sits exactly where the request will run),
the proxy in front as a separate process. Each trial draws a fresh 1024-token prefix and, at
random, one of two conditions: "primed" (tenant A sends prefix + its question first) or "cold"
(nobody does). Then tenant B sends prefix + its own question and its time to first streamed token
is recorded. A two-sample Kolmogorov-Smirnov test compares the two distributions; with
isolation intact they cannot be told apart (p > 0.01). A control run lets B prime for itself, to
show the test does see a cache hit when there is one.

`cacheproxy bench isolation [--trials 200]`
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp
import orjson

from cacheproxy.bench.harness import (
    HOST,
    BenchmarkError,
    ProcessSet,
    fail_on_bad_status,
    invoked_command,
    progress,
    proxy_command,
    run_with_processes,
    wait_healthy,
)
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.tenancy.registry import TenantRegistry
from cacheproxy.upstreams.managed import free_port, llama_server_args

PREFIX_TOKENS = 1024
QUESTION_TOKENS = 16
SIGNIFICANCE = 0.01


def ks_two_sample(first: list[float], second: list[float]) -> tuple[float, float]:
    """The Kolmogorov-Smirnov statistic D of two samples and its asymptotic p-value.

    p comes from the Kolmogorov distribution with Stephens' small-sample correction
    (Numerical Recipes, `kstwo`): accurate to a few percent for samples of this size.
    """
    a, b = sorted(first), sorted(second)
    i = j = 0
    distance = 0.0
    while i < len(a) and j < len(b):
        value = min(a[i], b[j])
        while i < len(a) and a[i] == value:
            i += 1
        while j < len(b) and b[j] == value:
            j += 1
        distance = max(distance, abs(i / len(a) - j / len(b)))
    effective = math.sqrt(len(a) * len(b) / (len(a) + len(b)))
    lam = (effective + 0.12 + 0.11 / effective) * distance
    return distance, kolmogorov_survival(lam)


def kolmogorov_survival(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution: 2 * sum (-1)^(k-1) exp(-2 k^2 lam^2)."""
    if lam < 0.2:
        return 1.0
    total, sign = 0.0, 1.0
    for k in range(1, 101):
        term = sign * math.exp(-2.0 * k * k * lam * lam)
        total += term
        if abs(term) < 1e-12:
            break
        sign = -sign
    return min(max(2.0 * total, 0.0), 1.0)


@dataclass
class Trial:
    condition: str
    ttft_ms: float
    cache_n: int


class Audit:
    def __init__(
        self, session: aiohttp.ClientSession, proxy_url: str, keys: dict[str, str]
    ) -> None:
        self.session = session
        self.proxy_url = proxy_url
        self.keys = keys

    async def first_token_ms(self, tenant: str, prompt: list[int]) -> tuple[float, int]:
        body = orjson.dumps({"prompt": prompt, "n_predict": 4, "stream": True, "temperature": 0})
        headers = {
            "Authorization": f"Bearer {self.keys[tenant]}",
            "Content-Type": "application/json",
        }
        started = time.perf_counter()
        first = None
        cache_n = -1
        async with self.session.post(
            self.proxy_url + "/completion", data=body, headers=headers
        ) as response:
            await fail_on_bad_status(response)
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if first is None:
                    first = time.perf_counter()
                event = orjson.loads(line[6:])
                if event.get("stop"):
                    cache_n = event["timings"]["cache_n"]
        if first is None:
            raise BenchmarkError("a stream ended without any event")
        return (first - started) * 1000, cache_n

    async def trial(self, rng: random.Random, condition: str) -> Trial:
        prefix = [rng.randrange(300, 31000) for _ in range(PREFIX_TOKENS)]

        def question() -> list[int]:
            return [rng.randrange(300, 31000) for _ in range(QUESTION_TOKENS)]

        if condition == "primed":
            await self.first_token_ms("a", prefix + question())
        elif condition == "self-primed":
            await self.first_token_ms("b", prefix + question())
        else:  # cold: keep the machine's recent work alike, on an unrelated prompt
            await self.first_token_ms("a", question() * (PREFIX_TOKENS // QUESTION_TOKENS + 1))
        ttft, cache_n = await self.first_token_ms("b", prefix + question())
        return Trial(condition, ttft, cache_n)


def start_servers(processes: ProcessSet) -> tuple[str, str, dict[str, str]]:
    """llama-server with one slot and no RAM cache, and the proxy with two tenants."""
    port = free_port(HOST)
    (processes.workdir / "slots").mkdir()
    args = llama_server_args(
        ensure_llama_server(),
        ensure_model("small"),
        host=HOST,
        port=port,
        parallel=1,
        ctx_size=4096,
        cache_ram_mib=0,
        slot_save_path=processes.workdir / "slots",
        extra_args=("--threads", "1"),
    )
    processes.start("llama-server", args)
    database = processes.workdir / "tenants.db"
    with TenantRegistry(database) as registry:
        keys = {name: registry.create(name)[1] for name in ("a", "b")}
    proxy_port = free_port(HOST)
    env = {
        **os.environ,
        "CACHEPROXY_STATE_DIR": str(processes.workdir / "state"),
        "CACHEPROXY_TENANTS__DATABASE": str(database),
        # the disk tier on, as deployed: B's request archives A's slot before overwriting it
        "CACHEPROXY_DISK__DIRECTORY": str(processes.workdir / "slots"),
    }
    upstream = f"http://{HOST}:{port}"
    processes.start("proxy", proxy_command(upstream, proxy_port), env=env)
    return upstream, f"http://{HOST}:{proxy_port}", keys


async def audit(processes: ProcessSet, trials: int, seed: int) -> dict[str, list[Trial]]:
    upstream, proxy_url, keys = start_servers(processes)
    async with aiohttp.ClientSession() as session:
        await wait_healthy(session, processes.find("llama-server"), upstream)
        await wait_healthy(session, processes.find("proxy"), proxy_url)
        runner = Audit(session, proxy_url, keys)
        rng = random.Random(seed)
        conditions = ["primed"] * trials + ["cold"] * trials + ["self-primed"] * (trials // 4)
        rng.shuffle(conditions)
        for _ in range(5):  # warm-up, not counted
            await runner.trial(rng, "cold")
        results: dict[str, list[Trial]] = {"primed": [], "cold": [], "self-primed": []}
        for done, condition in enumerate(conditions, 1):
            results[condition].append(await runner.trial(rng, condition))
            if done % 50 == 0:
                progress(f"{done}/{len(conditions)} trials")
    return results


def render(results: dict[str, list[Trial]], command: str) -> str:
    ttft = {name: [t.ttft_ms for t in trials] for name, trials in results.items()}
    d_iso, p_iso = ks_two_sample(ttft["primed"], ttft["cold"])
    d_ctl, p_ctl = ks_two_sample(ttft["self-primed"], ttft["cold"])
    lines = [
        "# cacheproxy isolation timing audit (W4)",
        "",
        f"- command: `{command}`",
        f"- machine: {os.cpu_count()} CPUs; one llama-server slot, --cache-ram 0, two tenants;"
        f" prefix {PREFIX_TOKENS} tokens (fresh each trial), question {QUESTION_TOKENS}",
        "",
        "| B's first token after | trials | p50 ms | p90 ms | mean ms | B's cache_n (max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, trials in results.items():
        values = ttft[name]
        deciles = statistics.quantiles(values, n=10)
        lines.append(
            f"| {name} | {len(values)} | {statistics.median(values):.2f} | {deciles[8]:.2f} |"
            f" {statistics.fmean(values):.2f} | {max(t.cache_n for t in trials)} |"
        )
    verdict = "cannot be told apart" if p_iso > SIGNIFICANCE else "DIFFER: isolation leaks"
    lines += [
        "",
        f"- other tenant primed vs nobody primed: KS D = {d_iso:.3f}, p = {p_iso:.3g}:"
        f" {verdict} (threshold p > {SIGNIFICANCE})",
        f"- control, B primed it itself vs nobody: KS D = {d_ctl:.3f}, p = {p_ctl:.3g}"
        " (a real cache hit must show here)",
    ]
    return "\n".join(lines)


def run_isolation_audit(trials: int, seed: int) -> int:
    command = invoked_command()
    code, results = run_with_processes(
        "cacheproxy-audit-", lambda processes: audit(processes, trials, seed)
    )
    if results is None:
        return code
    print(render(results, command))
    return 0
