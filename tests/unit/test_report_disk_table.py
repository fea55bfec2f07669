"""`bench report`'s disk-tier table: per proxy arm, the bytes its saves wrote (with blocks, the
server's file and then the blocks its cut added), the bytes the archive folder held at the end
and the answers it mispredicted, read from the proxy's own `/metrics` as a run reads them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from cacheproxy.bench.cache_client import ArmRun
from cacheproxy.bench.cache_config import CacheBenchConfig
from cacheproxy.bench.cache_report import CacheReport, report_as_json
from cacheproxy.bench.harness import table_row
from cacheproxy.bench.report_render import DISK_COLUMNS, disk_table
from cacheproxy.bench.run_counters import disk_tier_counters
from cacheproxy.ops.metrics import ProxyMetrics
from tests.support.local_app import served

MIB = 1024 * 1024


@pytest.fixture
async def proxy_metrics() -> AsyncIterator[tuple[ProxyMetrics, str]]:
    """The proxy's real metrics registry, served as the proxy serves it on 127.0.0.1."""
    metrics = ProxyMetrics()

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    async with served(app) as url:
        yield metrics, url


def proxy_run(disk: dict[str, float]) -> ArmRun:
    return ArmRun(
        workload="W2",
        cache_ram_mib=0,
        arm="proxy",
        completions=(),
        wall_s=1.0,
        restarts=0,
        llama_server_command="llama-server --port 1",
        proxy_command="python -m cacheproxy serve --upstream http://h:1 --port 2",
        server_cache_ram_mib=0,
        disk=disk,
    )


def table_of(disk: dict[str, float], *, blocks: bool) -> list[str]:
    report = CacheReport(
        command="cacheproxy bench report --out x",
        cpu_count=2,
        load_average=(0.0, 0.0, 0.0),
        platform="Linux-test",
        model="tiny.gguf",
        config=CacheBenchConfig(workloads=("W2",), cache_ram_mib=(0,), disk_blocks=blocks),
        runs=[proxy_run(disk)],
    )
    figures = json.loads(json.dumps(report_as_json(report)))  # as figures.json reads back
    return list(disk_table(figures, figures["runs"]))


async def test_a_blocks_arm_counts_the_server_files_and_the_blocks_its_cuts_wrote(
    proxy_metrics: tuple[ProxyMetrics, str],
) -> None:
    metrics, url = proxy_metrics
    metrics.archive_saves.labels("saved").inc(3)
    metrics.archive_saved_bytes.inc(30 * MIB)  # the server's slot files
    metrics.archive_block_bytes.labels("written").inc(12 * MIB)  # what the cuts added
    metrics.archive_block_bytes.labels("shared").inc(18 * MIB)  # already kept
    metrics.archive_restores.labels("restored").inc(2)
    metrics.archive_restored_bytes.inc(8 * MIB)
    metrics.archive_assembled_bytes.inc(8 * MIB)
    metrics.count((metrics.predictions, ("mismatch",), 4), (metrics.predictions, ("match",), 9))
    async with aiohttp.ClientSession() as session:
        disk = await disk_tier_counters(session, url)
    disk |= {"held_bytes": 12.5 * MIB, "held_as_whole_files_bytes": 30.0 * MIB}

    table = table_of(disk, blocks=True)

    assert table[2] == table_row(list(DISK_COLUMNS))
    row = ["0", "blocks", "3", "42.0", "12.0", "2", "8.0", "8.0", "12.5", "30.0", "4"]
    assert table[4] == table_row(row)


async def test_a_whole_files_arm_has_no_block_figures(
    proxy_metrics: tuple[ProxyMetrics, str],
) -> None:
    metrics, url = proxy_metrics
    metrics.archive_saves.labels("saved").inc(2)
    metrics.archive_saved_bytes.inc(20 * MIB)
    async with aiohttp.ClientSession() as session:
        disk = await disk_tier_counters(session, url)
    disk |= {"held_bytes": 20 * MIB, "held_as_whole_files_bytes": 20 * MIB}

    row = table_of(disk, blocks=False)[4]

    assert row == table_row(
        ["0", "whole files", "2", "20.0", "0.0", "0", "0.0", "0.0", "20.0", "20.0", "0"]
    )


def test_figures_from_before_the_block_counters_show_them_unknown() -> None:
    old = {"saves": 1, "save_bytes": MIB, "restores": 0, "restore_bytes": 0}
    row = table_of(old, blocks=False)[4]
    assert row == table_row(["0", "whole files", "1", "1.0", "—", "0", "0.0", "—", "—", "—", "—"])
