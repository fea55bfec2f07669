"""Saved archives cut into blocks in the background (`ArchiveStore.convert`): a save on a
request's path waits for llama-server's write and the index, not for the cut, which writes
and syncs only the blocks the tenant's archives lack. Archives saved before a restart, or
before blocks were on, are cut once the tier attaches its first upstream.
"""

from __future__ import annotations

import contextlib
import logging

from cacheproxy.disk.attached import DiskUnavailable, StoreCall
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.ops.held_tasks import HeldTasks
from cacheproxy.ops.metrics import ProxyMetrics

log = logging.getLogger(__name__)


class Conversions:
    """Named background tasks cutting archives into blocks, one store call each; their store
    calls go through the tier's off-on switch (`guarded`)."""

    def __init__(
        self,
        store: ArchiveStore,
        metrics: ProxyMetrics,
        guarded: StoreCall,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.guarded = guarded
        self._cuts = HeldTasks()
        self._swept = False
        metrics.archive_conversions_pending.set_function(lambda: store.conversions_pending)

    def cut(self, archive_id: str) -> None:
        """Cut a newly saved archive into blocks, after those saved before it."""
        if self.store.cuts_blocks:
            self._cuts.start(self._cut(archive_id), "archive-blocks")

    def sweep_once(self) -> None:
        """Cut every archive still a whole file not looked at (once per process)."""
        if self.store.cuts_blocks and not self._swept:
            self._swept = True
            self._cuts.start(self._sweep(), "archive-blocks-sweep")

    async def wait(self, timeout_s: float | None) -> None:
        """The cuts started so far end, for `timeout_s` at most."""
        await self._cuts.wait(timeout_s)

    async def _sweep(self) -> None:
        with contextlib.suppress(DiskUnavailable):
            for archive_id in await self.guarded(self.store.unconverted()):
                await self._cut(archive_id)

    async def _cut(self, archive_id: str) -> None:
        try:
            conversion = await self.guarded(self.store.convert(archive_id))
        except DiskUnavailable:
            return  # the archive stays a whole file; the next start looks at it again
        if conversion is None:
            return
        if conversion.kept_whole is not None:
            log.info("archive %s stays a whole file: %s", archive_id, conversion.kept_whole)
        self.metrics.child(self.metrics.archive_block_bytes, "written").inc(
            conversion.written_bytes
        )
        self.metrics.child(self.metrics.archive_block_bytes, "shared").inc(conversion.reused_bytes)
