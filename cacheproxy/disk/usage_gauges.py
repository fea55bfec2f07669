"""The per-tenant archive gauges in /metrics: bytes held, archives, bytes shared with other
archives, bytes deduplicated; a tenant whose archives are all gone is set back to 0."""

from __future__ import annotations

from cacheproxy.disk.archive_types import Sharing, Usage
from cacheproxy.ops.metrics import ProxyMetrics


class UsageGauges:
    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics
        self._published: set[str] = set()  # tenants whose gauges are set

    def publish(self, usage: dict[str, Usage], sharing: dict[str, Sharing]) -> None:
        """The gauges set from the store's figures by tenant."""
        metrics = self.metrics
        gauges = (
            metrics.archive_bytes,
            metrics.archive_count,
            metrics.archive_shared_bytes,
            metrics.archive_deduplicated_bytes,
        )
        for tenant_id in self._published - usage.keys():
            for gauge in gauges:
                gauge.labels(tenant_id).set(0)
        for tenant_id, (bytes_used, count) in usage.items():
            whole_bytes, shared_bytes = sharing.get(tenant_id, (bytes_used, 0))
            metrics.archive_bytes.labels(tenant_id).set(bytes_used)
            metrics.archive_count.labels(tenant_id).set(count)
            metrics.archive_shared_bytes.labels(tenant_id).set(shared_bytes)
            metrics.archive_deduplicated_bytes.labels(tenant_id).set(whole_bytes - bytes_used)
        self._published = set(usage)
