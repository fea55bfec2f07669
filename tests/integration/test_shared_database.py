"""Two proxies on one PostgreSQL database (`database_url`), in front of a real llama-server: a
tenant made through one proxy's admin API is served by the other, a key rotated on the other is
refused by both, and both proxies' usage adds up in the one ledger. Always on a real PostgreSQL
server, whatever `--database` says: SQLite files are one proxy's."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from cacheproxy.provision.postgres import PostgresServer
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.ledger import LedgerStore
from tests.support.servers import LlamaServer, serving

ADMIN_KEY = "admin-key-for-shared-db-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
REFRESH_S = 0.25  # how often a proxy looks for registry changes (TenantRegistry's default)


SEEN: list[int] = []  # every status answered, so the served requests can be counted


async def wait_for_status(
    client: aiohttp.ClientSession, url: str, headers: dict[str, str], status: int
) -> int:
    """Poll a task route until it answers `status` (the proxy re-reads the registry every
    refresh interval); the last status seen."""
    deadline = time.monotonic() + 10 * REFRESH_S + 5
    body = {"prompt": "Hello", "n_predict": 1}
    while True:
        async with client.post(url + "/completion", json=body, headers=headers) as response:
            await response.read()
            SEEN.append(response.status)
            if response.status == status or time.monotonic() > deadline:
                return response.status
        await asyncio.sleep(REFRESH_S / 2)


async def test_two_proxies_share_tenants_keys_and_the_ledger(
    postgres_server: PostgresServer,
    llama_server: LlamaServer,
    tmp_path_factory,  # noqa: ANN001 - pytest's factory
    client: aiohttp.ClientSession,
) -> None:
    database_url = postgres_server.new_database()
    SEEN.clear()

    def settings(name: str):  # noqa: ANN202 - a Settings
        return load_settings(
            upstreams=[llama_server.url],
            state_dir=tmp_path_factory.mktemp(name),
            database_url=database_url,
            tenants={"admin_api_key": ADMIN_KEY},
            usage={"flush_interval_s": 0.2},
        )

    async with serving(settings("a")) as (url_a, _), serving(settings("b")) as (url_b, _):
        async with client.post(
            url_a + "/admin/tenants", json={"name": "shared"}, headers=ADMIN
        ) as response:
            assert response.status == 201, await response.text()
            created = await response.json()
        first = {"Authorization": f"Bearer {created['api_key']}"}
        tenant_id = created["tenant"]["id"]
        assert await wait_for_status(client, url_b, first, 200) == 200
        assert await wait_for_status(client, url_a, first, 200) == 200

        # rotated through B: the old key stops working on A too
        async with client.post(
            f"{url_b}/admin/tenants/{tenant_id}/rotate-key", headers=ADMIN
        ) as response:
            assert response.status == 200, await response.text()
            second = {"Authorization": f"Bearer {(await response.json())['api_key']}"}
        assert await wait_for_status(client, url_a, first, 401) == 401
        assert await wait_for_status(client, url_a, second, 200) == 200
    # both stopped: each wrote its last batch into the one ledger
    with LedgerStore(database_url) as ledger:
        requests = sum(row["requests"] for row in ledger.rows(tenant_id))
    # every request either proxy served, counted once (a 401 is nobody's request)
    assert requests == SEEN.count(200) >= 3
