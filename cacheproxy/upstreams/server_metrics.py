"""The upstreams' own /metrics: one upstream's read when the proxy is asked, several upstreams'
scraped on one fixed schedule and served from a copy.

With one upstream the proxy's /metrics is a drop-in for the server's: its answer as it is (the
same samples, read at the same moment; its 501 when it runs without `--metrics`), the proxy's own
families after it. Reading it costs the server nothing it would not spend on its own scraper: a
metrics task does not reset its idle timer (tools/server/server-queue.cpp,
`task_resets_idle_timer`), and a sleeping server answers from its snapshot.

With several, the samples are labelled with each upstream's URL and merged, which no
llama-server answer looks like. llama-server resets the buckets behind its two throughput gauges
at every scrape: a proxy that scraped several upstreams each time it was itself scraped would
shorten the window every other scraper of those upstreams sees, and two Prometheus servers
scraping the proxy would skew each other. One scrape per upstream per interval, however often
the proxy is asked, keeps it fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from cacheproxy.ops.metrics import merge_upstream_metrics
from cacheproxy.ops.supervise import repeat
from cacheproxy.upstreams.pool import Upstream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveAnswer:
    """One upstream's GET /metrics answer, as it sent it."""

    status: int
    body: bytes
    content_type: str | None
    # its Process-Start-Time-Unix header, as it is (the pinned server's is not Unix seconds)
    process_start: str | None


class UpstreamMetrics:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        upstreams: list[Upstream],
        headers: dict[str, str],
        interval_s: float,
        timeout_s: float = 10.0,
    ) -> None:
        self.session = session
        self.upstreams = upstreams
        self.headers = headers
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        # one upstream: its own answer, read when asked (no schedule)
        self.live = len(upstreams) == 1
        self.scrapes = 0
        self._texts: dict[str, bytes] = {}

    async def read_live(self, query: str = "") -> LiveAnswer:
        """The one upstream's GET /metrics, now, with the client's `query` (a router's
        `?model=`); raises aiohttp's errors when it fails."""
        upstream = self.upstreams[0]
        path = "/metrics" + (f"?{query}" if query else "")
        async with self.session.get(
            upstream.url(path), headers=self.headers, timeout=self.timeout
        ) as response:
            return LiveAnswer(
                response.status,
                await response.read(),
                response.headers.get("Content-Type"),
                response.headers.get("Process-Start-Time-Unix"),
            )

    def exposition(self) -> bytes:
        """The latest copy of every upstream's metrics, labelled with the upstream's URL."""
        copies = [(up.base_url, self._texts.get(up.base_url)) for up in self.upstreams]
        return merge_upstream_metrics([(url, text) for url, text in copies if text is not None])

    async def refresh(self) -> None:
        answers = await asyncio.gather(*(self._scrape(up) for up in self.upstreams))
        self.scrapes += 1
        for upstream, text in zip(self.upstreams, answers, strict=True):
            if text is None:
                self._texts.pop(upstream.base_url, None)  # gone: show nothing rather than old
            else:
                self._texts[upstream.base_url] = text

    async def run(self) -> None:
        await asyncio.sleep(self.interval_s)  # `running` scraped once already
        await repeat("upstream metrics scraper", self.refresh, pause_s=self.interval_s, log=log)

    async def _scrape(self, upstream: Upstream) -> bytes | None:
        try:
            async with self.session.get(upstream.url("/metrics"), headers=self.headers) as response:
                return await response.read() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("could not scrape %s/metrics: %r", upstream.base_url, exc)
            return None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[UpstreamMetrics]:
        if self.live:
            yield self
            return
        await self.refresh()
        task = asyncio.create_task(self.run(), name="upstream-metrics-scraper")
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
