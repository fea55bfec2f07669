"""The usage ledger through a real proxy in front of a real llama-server: every request shape
counted, its totals equal to what the answers reported, exported by the CLI and the admin API,
kept whole on SIGTERM and losing at most one batch interval on a real SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.http.app_keys import ARCHIVES
from cacheproxy.settings import load_settings
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support import databases
from tests.support.completions import bearer, complete
from tests.support.serve_process import start_serve
from tests.support.servers import LlamaServer, StartServer, serving
from tests.support.sse import collect_sse

# runs on the database backend chosen with --database (the registry, ledger and index)
pytestmark = pytest.mark.database

ADMIN_KEY = "admin-key-for-ledger-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MESSAGES = [{"role": "user", "content": "Name a colour."}]
FLUSH_S = 0.3
MIN_ANSWERED = 16


def export(state: Path, *args: str) -> Any:
    """`cacheproxy usage export --format json ...` on the proxy's state folder."""
    completed = subprocess.run(
        [sys.executable, "-m", "cacheproxy", "usage", "export", *args],
        env={**os.environ, "CACHEPROXY_STATE_DIR": str(state)},
        capture_output=True,
        text=True,
        check=True,
    )
    return completed.stdout


def totals(rows: list[dict]) -> dict[str, int]:
    keys = ("requests", "prompt_tokens", "reused_tokens", "generated_tokens", "errors")
    return {key: sum(int(row[key]) for row in rows) for key in keys}


async def test_export_totals_equal_what_the_answers_reported(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    state = tmp_path / "state"
    settings = load_settings(
        upstreams=[llama_server.url],
        state_dir=state,
        tenants={"admin_api_key": ADMIN_KEY},
        usage={"flush_interval_s": FLUSH_S},
    )
    with TenantRegistry(databases.chosen(state / "cacheproxy.db")) as registry:
        tenant, key = registry.create("counted")
        other, other_key = registry.create("other")
    auth = {"Authorization": f"Bearer {key}"}
    reported = {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "generated_tokens": 0}

    def add(prompt: int, reused: int, generated: int) -> None:
        reported["requests"] += 1
        reported["prompt_tokens"] += prompt
        reported["reused_tokens"] += reused
        reported["generated_tokens"] += generated

    async with serving(settings) as (url, _):
        for _ in range(2):  # the second reuses the first's prompt from the slot
            async with client.post(
                url + "/v1/chat/completions",
                json={"messages": MESSAGES, "max_tokens": 3, "temperature": 0},
                headers=auth,
            ) as response:
                usage = (await response.json())["usage"]
            add(
                usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"],
                usage["completion_tokens"],
            )
        async with client.post(
            url + "/v1/chat/completions",
            json={
                "messages": MESSAGES,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers=auth,
        ) as response:
            events = [json.loads(data) for data in await collect_sse(response) if data != "[DONE]"]
        usage = next(event["usage"] for event in events if event.get("usage"))
        add(
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"],
        )
        async with client.post(
            url + "/completion",
            json={"prompt": ["a story", "another story"], "n_predict": 3},
            headers=auth,
        ) as response:
            batch = await response.json()
        reported["requests"] -= 1  # one request of two tasks
        for result in batch:
            timings = result["timings"]
            add(
                timings["prompt_n"] + timings["cache_n"], timings["cache_n"], timings["predicted_n"]
            )
        async with client.post(
            url + "/v1/messages",
            json={"model": "any", "messages": MESSAGES, "max_tokens": 3},
            headers=auth,
        ) as response:
            usage = (await response.json())["usage"]
        cached = usage.get("cache_read_input_tokens", 0)
        add(usage["input_tokens"] + cached, cached, usage["output_tokens"])
        async with client.post(
            url + "/v1/responses",
            json={"model": "any", "input": "Name a colour.", "max_output_tokens": 3},
            headers=auth,
        ) as response:
            usage = (await response.json())["usage"]
        add(
            usage["input_tokens"],
            usage["input_tokens_details"]["cached_tokens"],
            usage["output_tokens"],
        )
        # an error counts as a request and an error
        async with client.post(
            url + "/completion", json={"prompt": [10**9], "n_predict": 1}, headers=auth
        ) as response:
            assert response.status == 400
        # n=2, another tenant: one request, two completions of the same prompt, each counted
        async with client.post(
            url + "/v1/completions",
            json={"prompt": "Colours:", "n": 2, "max_tokens": 2, "ignore_eos": True},
            headers={"Authorization": f"Bearer {other_key}"},
        ) as response:
            answer = await response.json()
        assert len(answer["choices"]) == 2
        # the usage shown is the first task's, as llama-server shows it
        n2_prompt = answer["usage"]["prompt_tokens"]
        await asyncio.sleep(FLUSH_S * 4)
        async with client.get(
            url + "/admin/usage",
            params={"tenant": tenant.id, "group_by": "tenant"},
            headers=ADMIN,
        ) as response:
            by_tenant = await response.json()
            assert response.status == 200, by_tenant
        async with client.get(
            url + "/admin/usage", params={"group_by": "hour"}, headers=ADMIN
        ) as response:
            by_hour = await response.json()
    [row] = by_tenant["rows"]
    assert row["requests"] == reported["requests"] + 1  # and the refused one
    assert row["errors"] == 1
    exported = json.loads(export(state, "--format", "json", "--tenant", tenant.id))
    for figures in (row, totals(exported["rows"])):
        for name, value in reported.items():
            if name != "requests":
                assert figures[name] == value, (name, figures, reported)
    assert row["reused_tokens"] == (
        row["reused_slot_tokens"] + row["reused_disk_tokens"] + row["reused_public_tokens"]
    )
    assert row["prompt_tokens"] == row["computed_tokens"] + row["reused_tokens"]
    assert reported["reused_tokens"] > 0  # the repeated chat came from its slot
    assert row["reused_slot_tokens"] == reported["reused_tokens"]
    [fanned] = [r for r in by_hour["rows"] if r["tenant_id"] == other.id]
    assert fanned["requests"] == 1
    assert fanned["prompt_tokens"] == 2 * n2_prompt
    assert fanned["generated_tokens"] == 4  # two completions of 2 tokens
    assert {r["tenant_id"] for r in by_hour["rows"]} == {tenant.id, other.id}
    csv_text = export(state, "--format", "csv")
    header, *lines = csv_text.strip().splitlines()
    assert header.split(",")[:2] == ["tenant_id", "hour"]
    assert len(lines) == 2


async def count_answered(
    client: aiohttp.ClientSession,
    url: str,
    auth: dict[str, str],
    stop_at: float,
    sends: int = MIN_ANSWERED,
) -> list[float]:
    """Send requests one after another until `stop_at`, and at least `sends` of them (a slow
    machine answers few at first); the time each answer came back."""
    answered: list[float] = []
    body = {"prompt": [10, 11, 12], "n_predict": 1}
    while time.monotonic() < stop_at or len(answered) < sends:
        async with client.post(url + "/completion", json=body, headers=auth) as response:
            await response.read()
            assert response.status == 200
        answered.append(time.monotonic())
    return answered


def ledger_requests(state: Path, tenant_id: str) -> int:
    [row] = databases.query(
        databases.chosen(state / "usage.db"),
        "SELECT coalesce(sum(requests), 0) FROM usage_hours WHERE tenant_id = ?",
        (tenant_id,),
    )
    return int(row[0])


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
async def test_ledger_after_a_stop(
    llama_server: LlamaServer, tmp_path: Path, client: aiohttp.ClientSession, stop: str
) -> None:
    """SIGTERM keeps every request; kill -9 loses none of what the batches wrote before it
    (what came in since the last batch is what it may lose)."""
    state = tmp_path / "state"
    with TenantRegistry(databases.chosen(state / "cacheproxy.db")) as registry:
        tenant, key = registry.create("killed")
    auth = {"Authorization": f"Bearer {key}"}
    served = await start_serve(
        tmp_path,
        "--upstream",
        llama_server.url,
        env={"CACHEPROXY_USAGE__FLUSH_INTERVAL_S": "0.5"},
    )
    durable = 0
    try:
        if stop == "SIGTERM":
            answered = await count_answered(client, served.url, auth, time.monotonic() + 3.0)
        else:
            # requests until the batches have written some, read from the ledger itself (not
            # from a clock: a loaded machine writes late), then the kill, right after a request
            answered = []
            deadline = time.monotonic() + 60
            while durable < MIN_ANSWERED:
                assert time.monotonic() < deadline, "no batch was written while serving"
                answered += await count_answered(client, served.url, auth, 0.0, sends=8)
                durable = await asyncio.to_thread(ledger_requests, state, tenant.id)
            answered += await count_answered(client, served.url, auth, 0.0, sends=1)
        served.process.send_signal(getattr(signal, stop))
        await served.process.wait()
    finally:
        await served.stop()
    recorded = ledger_requests(state, tenant.id)
    assert recorded <= len(answered)
    if stop == "SIGTERM":
        assert recorded == len(answered)
    else:
        assert recorded >= durable, (recorded, durable, len(answered))


def ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


async def test_reuse_is_split_by_where_it_came_from(
    start_server: StartServer, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Reused from the slot, restored from disk (with the restore and the archived bytes
    counted), or another tenant's public prefix: each in its own column."""
    server = start_server(parallel=1, ctx_size=4096)
    state = tmp_path / "state"
    settings = load_settings(
        upstreams=[server.url],
        state_dir=state,
        disk={"directory": server.slot_save_path, "min_tokens": 128},
        usage={"flush_interval_s": FLUSH_S},
    )
    prefix = ids(1, 256)
    with TenantRegistry(databases.chosen(state / "cacheproxy.db")) as registry:
        alice, alice_key = registry.create("alice")
        bob, bob_key = registry.create("bob")
        registry.add_public_prefix("system", prefix)
    async with serving(settings) as (url, app):
        first = prefix + ids(2, 300)
        answer = await complete(client, url, first, bearer(alice_key))
        # idle, alice's conversation is archived ahead (bob's request never waits for a save
        # of it); then bob takes the only slot, reusing the public prefix
        deadline = time.monotonic() + 30
        while not app[ARCHIVES].blocking.list():
            assert time.monotonic() < deadline, "never archived ahead"
            await asyncio.sleep(0.05)
        public = await complete(client, url, prefix + ids(3, 300), bearer(bob_key))
        assert public["timings"]["cache_n"] == len(prefix)
        # alice's next turn comes back from disk
        restored = await complete(
            client, url, first + answer["tokens"] + ids(4, 40), bearer(alice_key)
        )
        assert restored["timings"]["cache_n"] >= len(first)
        # and her turn after that from the slot itself
        follow = first + answer["tokens"] + ids(4, 40) + restored["tokens"] + ids(5, 20)
        from_slot = await complete(client, url, follow, bearer(alice_key))
        assert from_slot["timings"]["cache_n"] > len(first)
        archived_bytes = sum(archive.bytes for archive in app[ARCHIVES].blocking.list())
        await asyncio.sleep(FLUSH_S * 4)
    rows = {
        row["tenant_id"]: row
        for row in json.loads(export(state, "--format", "json", "--group-by", "tenant"))["rows"]
    }
    assert rows[bob.id]["reused_public_tokens"] == len(prefix)
    assert rows[bob.id]["reused_slot_tokens"] == rows[bob.id]["reused_disk_tokens"] == 0
    assert rows[alice.id]["restores"] == 1
    assert rows[alice.id]["reused_disk_tokens"] == restored["timings"]["cache_n"]
    assert rows[alice.id]["reused_slot_tokens"] == from_slot["timings"]["cache_n"]
    assert rows[alice.id]["reused_public_tokens"] == 0
    # alice's conversation was archived before bob came, and again at the stop (the drain)
    assert rows[alice.id]["archived_bytes"] >= archived_bytes > 0
