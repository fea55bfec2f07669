"""A proxy started again in front of a llama-server that kept running knows what its slots hold:
each slot's claim (whose text, the hashes of its ids) was written by the proxy before it died,
and the first turn of each conversation after the restart reuses its slot. (Another tenant
reusing nothing of a slot learnt so: test_cluster.py, after a takeover.)"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import aiohttp

from cacheproxy.tenancy.registry import TenantRegistry
from tests.support.completions import bearer, complete
from tests.support.disk_tier import conversation, next_turn
from tests.support.serve_process import start_serve
from tests.support.servers import StartServer
from tests.support.waiting import wait_for

ADMIN_KEY = "admin-key-of-the-slot-claims-test"
PROXY_ENV = {
    # nothing archived ahead: only the slot itself can give a turn its reuse
    "CACHEPROXY_DISK__AHEAD_MIB_S": "0",
    "CACHEPROXY_TENANTS__ADMIN_API_KEY": ADMIN_KEY,
}


def claimed_tenants(state: Path, upstream: str) -> dict[int, str | None]:
    with contextlib.closing(sqlite3.connect(state / "cacheproxy.db")) as db:
        rows = db.execute(
            "SELECT slot_id, tenant FROM slot_claims WHERE upstream = ?", [upstream]
        ).fetchall()
    return dict(rows)


async def archive_restores(client: aiohttp.ClientSession, url: str) -> float:
    async with client.get(url + "/metrics", headers=bearer(ADMIN_KEY)) as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('cacheproxy_archive_restores_total{outcome="restored"')
    )


async def test_a_restarted_proxy_reuses_the_slots_of_a_server_that_kept_running(
    start_server: StartServer, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    # two slots, both holding a conversation: the start-up probe must take one of them
    server = start_server(slot_save_path=state / "slots", parallel=2, ctx_size=8192)
    with TenantRegistry(state / "cacheproxy.db") as registry:
        tenants = {name: registry.create(name) for name in ("acme", "globex")}
    keys = {name: bearer(key) for name, (_, key) in tenants.items()}
    ids = {name: tenant.id for name, (tenant, _) in tenants.items()}
    prompts = {"acme": conversation(1), "globex": conversation(2)}
    proxy = await start_serve(tmp_path, "--upstream", server.url, env=PROXY_ENV)
    async with aiohttp.ClientSession() as client:
        try:
            answers = {
                name: await complete(client, proxy.url, prompt, keys[name])
                for name, prompt in prompts.items()
            }
            # the proxy writes what the slots hold behind the requests; then it dies
            await wait_for(
                lambda: (
                    sorted(t for t in claimed_tenants(state, server.url).values() if t)
                    == sorted(ids.values())
                ),
                "both slots claimed",
            )
        finally:
            await proxy.stop()  # SIGKILL: no drain, nothing archived
        proxy = await start_serve(tmp_path, "--upstream", server.url, env=PROXY_ENV)
        try:
            # each conversation's first turn after the restart reuses all its slot held
            for seed, (name, prompt) in enumerate(prompts.items(), 100):
                follow_up = next_turn(prompt, answers[name], seed)
                again = await complete(client, proxy.url, follow_up, keys[name])
                assert again["timings"]["cache_n"] == answers[name]["tokens_cached"], again
            assert await archive_restores(client, proxy.url) == 0  # from the slots themselves
        finally:
            await proxy.stop()
