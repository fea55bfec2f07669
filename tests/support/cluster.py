"""Two proxies, as processes (`cacheproxy serve`), in front of two llama-servers, sharing one
registry database (the leases and the shared limits are there: a SQLite file in the state
folder, or the test's PostgreSQL database under `--database postgresql`), one archive index and
one archive folder."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from cacheproxy.tenancy.registry import TenantRegistry
from tests.support import databases
from tests.support.serve_process import ServeProcess, start_serve
from tests.support.servers import LlamaServer, StartServer

TTL_S = 3.0
RENEWAL_S = 1.0
TAKEOVER_BOUND_S = TTL_S + RENEWAL_S
TWO_SLOTS = {"parallel": 2, "ctx_size": 8192}
ADMIN_KEY = "admin-key-of-the-cluster-test"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class Cluster:
    state: Path
    servers: list[LlamaServer]
    proxies: list[ServeProcess]
    key: str  # a tenant's key: a hand-off must carry it to the owner
    other_key: str  # another tenant's
    tenant_id: str = ""
    env: dict[str, str] = field(default_factory=dict)  # settings of every proxy beyond these

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def registry(self) -> databases.DatabaseTarget:
        return databases.chosen(self.state / "cacheproxy.db")

    def leases(self) -> dict[str, str]:
        """upstream -> holder's address, of leases alive now (read from the shared database)."""
        rows = databases.query(
            self.registry,
            "SELECT upstream, holder_address FROM upstream_leases WHERE expires_at >= ?",
            (time.time(),),
        )
        return dict(rows)

    async def start_proxy(self, tmp_path: Path) -> ServeProcess:
        upstreams = [flag for server in self.servers for flag in ("--upstream", server.url)]
        return await start_serve(
            tmp_path,
            *upstreams,
            env={
                "CACHEPROXY_STATE_DIR": str(self.state),
                "CACHEPROXY_CLUSTER__ENABLED": "true",
                "CACHEPROXY_CLUSTER__LEASE_TTL_S": str(TTL_S),
                "CACHEPROXY_CLUSTER__RENEW_INTERVAL_S": str(RENEWAL_S),
                "CACHEPROXY_ROUTING__HEALTH_INTERVAL_S": "0.5",
                "CACHEPROXY_DISK__MIN_TOKENS": "128",
                "CACHEPROXY_TENANTS__ADMIN_API_KEY": ADMIN_KEY,
                **self.env,
            },
        )

    async def wait_spread(self, timeout_s: float = 20.0) -> None:
        """Until every upstream is held, and every live proxy holds one."""
        deadline = time.monotonic() + timeout_s
        live = {proxy.url for proxy in self.proxies if proxy.process.returncode is None}
        while True:
            leases = self.leases()
            if len(leases) == len(self.servers) and set(leases.values()) == live:
                # every proxy's next round reads the new spread: until then their views of
                # who owns a conversation may differ
                await asyncio.sleep(2 * RENEWAL_S)
                return
            assert time.monotonic() < deadline, f"leases never spread: {leases}"
            await asyncio.sleep(0.1)

    async def stop_gracefully(self) -> None:
        """SIGTERM to every proxy: each writes its last ledger batch and gives back what it
        holds of the shared limits."""
        for proxy in self.proxies:
            if proxy.process.returncode is None:
                proxy.process.terminate()
        for proxy in self.proxies:
            assert await proxy.process.wait() == 0, proxy.log()[-2000:]


@contextlib.asynccontextmanager
async def two_proxies(
    start_server: StartServer, tmp_path: Path, env: dict[str, str] | None = None
) -> AsyncIterator[Cluster]:
    state = tmp_path / "state"
    servers = [start_server(slot_save_path=state / "slots", **TWO_SLOTS) for _ in range(2)]
    with TenantRegistry(databases.chosen(state / "cacheproxy.db")) as registry:
        tenant, key = registry.create("acme")
        _, other_key = registry.create("globex")
    cluster = Cluster(state, servers, [], key, other_key, tenant.id, env or {})
    try:
        for _ in range(2):
            cluster.proxies.append(await cluster.start_proxy(tmp_path))
        await cluster.wait_spread()
        yield cluster
    finally:
        for proxy in cluster.proxies:
            await proxy.stop()


async def metric_values(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The proxy's own `cacheproxy_*` samples, by name with labels."""
    async with client.get(url + "/metrics", headers=ADMIN) as response:
        text = await response.text()
    return {
        name: float(value)
        for name, value in (
            line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("cacheproxy_")
        )
    }
