"""The per-tenant archive gauges in /metrics: bytes held, archives, bytes shared with other
archives, bytes deduplicated, bytes of whole copies; a tenant whose archives are all gone is
set back to 0.

Read from the index when /metrics is asked (`refresh`), not after every change: a save on a
request's path would otherwise wait for two more reads in the store's one worker, and other
proxies sharing the index change it too.
"""

from __future__ import annotations

import logging

from cacheproxy.db.connection import DATABASE_ERRORS
from cacheproxy.disk.archive_types import Sharing, Usage
from cacheproxy.disk.store import ArchiveStore
from cacheproxy.ops.metrics import ProxyMetrics

log = logging.getLogger(__name__)


class UsageGauges:
    def __init__(self, metrics: ProxyMetrics, store: ArchiveStore) -> None:
        self.metrics = metrics
        self.store = store
        self._published: set[str] = set()  # tenants whose gauges are set

    async def refresh(self) -> None:
        """The gauges set from the index as it is now; as they were if it cannot be read (the
        disk tier says why, and turns itself off, when a request meets the fault)."""
        try:
            usage, sharing = await self.store.usage_and_sharing()
        except (OSError, *DATABASE_ERRORS) as exc:
            log.debug("archive gauges not refreshed: %r", exc)
            return
        self.publish(usage, sharing)

    def publish(self, usage: dict[str, Usage], sharing: dict[str, Sharing]) -> None:
        """The gauges set from the store's figures by tenant."""
        metrics = self.metrics
        gauges = (
            metrics.archive_bytes,
            metrics.archive_count,
            metrics.archive_shared_bytes,
            metrics.archive_deduplicated_bytes,
            metrics.archive_copy_bytes,
        )
        for tenant_id in self._published - usage.keys():
            for gauge in gauges:
                gauge.labels(tenant_id).set(0)
        for tenant_id, (bytes_used, count) in usage.items():
            shares = sharing.get(tenant_id, Sharing(bytes_used, 0))
            metrics.child(metrics.archive_bytes, tenant_id).set(bytes_used)
            metrics.child(metrics.archive_count, tenant_id).set(count)
            metrics.child(metrics.archive_shared_bytes, tenant_id).set(shares.shared_bytes)
            metrics.child(metrics.archive_deduplicated_bytes, tenant_id).set(
                shares.whole_bytes - bytes_used
            )
            metrics.child(metrics.archive_copy_bytes, tenant_id).set(shares.copy_bytes)
        self._published = set(usage)
