"""GET /metrics: the proxy's own figures, and several upstreams' from one scheduled scrape (one
upstream's are its own answer, read when asked: see test_drop_in.py)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import aiohttp

from cacheproxy.http.app_keys import UPSTREAM_METRICS
from cacheproxy.ops.metrics import label_upstream, merge_upstream_metrics
from cacheproxy.settings import load_settings
from cacheproxy.upstreams.pool import Upstream
from cacheproxy.upstreams.server_metrics import UpstreamMetrics
from tests.support.servers import LlamaServer, StartServer, serving

UPSTREAM_TEXT = b"""# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
llamacpp:requests_processing{slot="1"} 0
"""


def test_upstream_samples_are_labelled_and_families_merged() -> None:
    labelled = label_upstream(UPSTREAM_TEXT, "http://a:1")
    assert b'llamacpp:prompt_tokens_total{upstream="http://a:1"} 12' in labelled
    assert b'llamacpp:requests_processing{slot="1",upstream="http://a:1"} 0' in labelled
    merged = merge_upstream_metrics([("http://a:1", UPSTREAM_TEXT), ("http://b:2", UPSTREAM_TEXT)])
    lines = merged.decode().splitlines()
    assert (
        lines.count("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.") == 1
    )
    family = [line for line in lines if line.startswith("llamacpp:prompt_tokens_total")]
    assert len(family) == 2  # both upstreams' samples, together under one HELP and TYPE


def test_a_label_value_may_hold_a_brace_and_a_line_that_is_no_sample_is_left_out() -> None:
    text = b'cacheproxy_x{path="/a}b",why="say \\"hi\\""} 1\n{not a sample} 2\n'
    labelled = label_upstream(text, "http://a:1")
    assert b'cacheproxy_x{path="/a}b",why="say \\"hi\\"",upstream="http://a:1"} 1' in labelled
    merged = merge_upstream_metrics([("http://a:1", text)]).decode()
    assert merged.splitlines() == [
        'cacheproxy_x{path="/a}b",why="say \\"hi\\"",upstream="http://a:1"} 1'
    ]


async def proxy_metrics(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url + "/metrics") as response:
        assert response.status == 200
        return await response.text()


def upstream_part(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("llamacpp:")]


async def test_upstreams_are_scraped_on_a_schedule_not_on_demand(
    client: aiohttp.ClientSession,
    llama_server: LlamaServer,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """llama-server resets its throughput gauges at each scrape: scraping several upstreams
    every time the proxy is scraped would skew every other scraper's window."""
    other = start_server(parallel=1)
    settings = load_settings(
        upstreams=[llama_server.url, other.url], state_dir=tmp_path, upstream_metrics_interval_s=60
    )
    async with serving(settings) as (url, app):
        scraper = app[UPSTREAM_METRICS]
        before = scraper.scrapes
        first = await proxy_metrics(client, url)
        async with client.post(url + "/completion", json={"prompt": [1, 5, 9], "n_predict": 2}):
            pass
        second = await proxy_metrics(client, url)
        assert scraper.scrapes == before  # two scrapes of the proxy, none of the upstream
        assert upstream_part(first) == upstream_part(second)
        await scraper.refresh()  # what the schedule does every interval
        third = await proxy_metrics(client, url)
    assert upstream_part(third) != upstream_part(second)  # the completion shows after the scrape
    assert any(f'upstream="{llama_server.url}"' in line for line in upstream_part(third))


async def test_the_schedule_runs(client: aiohttp.ClientSession, llama_server: LlamaServer) -> None:
    upstreams = [Upstream(llama_server.url), Upstream(llama_server.url)]  # scheduled: several
    scraper = UpstreamMetrics(client, upstreams, {}, interval_s=0.05)
    async with scraper.running():
        await asyncio.sleep(0.5)
    assert scraper.scrapes >= 3
    assert b"llamacpp:prompt_tokens_total" in scraper.exposition()


async def test_request_latency_is_timed_by_route(
    client: aiohttp.ClientSession, llama_server: LlamaServer, tmp_path: Path
) -> None:
    settings = load_settings(upstreams=[llama_server.url], state_dir=tmp_path)
    async with serving(settings) as (url, _):
        async with client.post(url + "/completion", json={"prompt": [1, 5], "n_predict": 1}):
            pass
        async with client.get(url + "/props"):
            pass
        text = await proxy_metrics(client, url)
    counts = dict(re.findall(r'cacheproxy_request_seconds_count\{route="([^"]+)"\} (\S+)', text))
    assert float(counts["/completion"]) == 1
    assert float(counts["other"]) == 1


async def test_metrics_say_when_the_process_started_as_llama_servers_do(
    client: aiohttp.ClientSession,
    llama_server: LlamaServer,
    start_server: StartServer,
    tmp_path: Path,
) -> None:
    """llama-server sends `Process-Start-Time-Unix` with its metrics (server-context.cpp, the
    metrics route); scrapers read it to tell a restart. With several upstreams (whose samples
    are labelled) the header gives the proxy's start, the same on every scrape."""
    before = int(time.time())
    other = start_server(parallel=1)
    settings = load_settings(upstreams=[llama_server.url, other.url], state_dir=tmp_path)
    async with serving(settings) as (url, _):
        starts = []
        for _ in range(2):
            async with client.get(url + "/metrics") as response:
                assert response.status == 200
                starts.append(response.headers["Process-Start-Time-Unix"])
            await asyncio.sleep(1.1)
    assert starts[0] == starts[1]
    assert before <= int(starts[0]) <= int(time.time())
