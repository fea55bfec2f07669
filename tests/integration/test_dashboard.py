"""The admin dashboard: its JSON through a real proxy and llama-server, and the page in Chromium.

The browser test runs a headless Chromium against the live proxy, so the page's own JS fetches
/admin/state and draws it; the DOM it leaves and a screenshot are what we check. The browser is
provisioned like the engine wheel: found on the machine, else Debian's package installed once
(as root; `cacheproxy testbed chromium`). Set CACHEPROXY_SCREENSHOT_DIR to keep a copy of the
screenshot for a human to look at.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import struct
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from cacheproxy.http import dashboard
from cacheproxy.http.dashboard import ReuseHistory
from cacheproxy.provision.chromium import ChromiumUnavailable, ensure_chromium
from cacheproxy.tenancy.registry import Tenant, TenantRegistry
from tests.support.servers import LlamaServer, serving_tenants

ADMIN_KEY = "admin-key-for-dashboard-tests-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
# a word no page, id or name contains: if it shows up, prompt text leaked
SECRET_WORD = "Quixotrombulax"
CHROMIUM_TIMEOUT_S = 90.0
SAMPLE_INTERVAL_S = 0.5  # the dashboard samples every 5 s; the tests cannot wait that long
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class Dashboard:
    url: str
    registry: TenantRegistry
    server: LlamaServer


@dataclass
class Client:
    tenant: Tenant
    key: str


@pytest.fixture
async def proxy(
    llama_server: LlamaServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Dashboard]:
    monkeypatch.setattr(dashboard, "SAMPLE_INTERVAL_S", SAMPLE_INTERVAL_S)
    async with serving_tenants(llama_server.url, tmp_path, ADMIN_KEY) as (url, registry):
        yield Dashboard(url, registry, llama_server)


def new_tenant(proxy: Dashboard, name: str, **options: Any) -> Client:
    tenant, key = proxy.registry.create(name, **options)
    return Client(tenant, key)


async def chat(
    http: aiohttp.ClientSession, proxy: Dashboard, client: Client, session: str, turns: int
) -> None:
    """A conversation of `turns` user messages, so later calls share a prefix with earlier ones."""
    messages = [{"role": "system", "content": f"You are a helpful assistant. {SECRET_WORD}."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Tell me about {SECRET_WORD} number {turn}."})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"{SECRET_WORD} {turn} is a word."})
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "seed": 1}
    headers = {"Authorization": f"Bearer {client.key}", "X-Session-Id": session}
    async with http.post(
        proxy.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def get(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    async with http.get(url, headers=headers or {}) as response:
        return response.status, await response.text()


async def state(http: aiohttp.ClientSession, proxy: Dashboard) -> tuple[dict[str, Any], str]:
    status, text = await get(http, proxy.url + "/admin/state", AUTH)
    assert status == 200, text
    return orjson.loads(text), text


# -- JSON ----------------------------------------------------------------------------------


async def test_dashboard_needs_the_admin_key(
    client: aiohttp.ClientSession, proxy: Dashboard
) -> None:
    for path in ("/admin/state", "/admin/dashboard"):
        status, text = await get(client, proxy.url + path)
        assert status == 401, text
        assert orjson.loads(text)["error"]["type"] == "authentication_error"
        status, _ = await get(client, proxy.url + path, {"Authorization": "Bearer wrong"})
        assert status == 401
        status, _ = await get(client, proxy.url + path + "?key=wrong")
        assert status == 401
        # a tenant's key is not the admin key
        tenant = new_tenant(proxy, f"t{len(path)}")
        status, _ = await get(client, proxy.url + path, {"Authorization": f"Bearer {tenant.key}"})
        assert status == 401
        status, _ = await get(client, proxy.url + path, AUTH)
        assert status == 200
        status, _ = await get(client, proxy.url + path + f"?key={ADMIN_KEY}")
        assert status == 200
    # ?key= is for the dashboard's two routes only: the rest of the admin API reads headers
    status, _ = await get(client, proxy.url + f"/admin/tenants?key={ADMIN_KEY}")
    assert status == 401
    status, _ = await get(client, proxy.url + f"/admin/nowhere?key={ADMIN_KEY}")
    assert status == 401  # unknown paths still tell nothing without the key in a header
    status, _ = await get(client, proxy.url + "/admin/nowhere", AUTH)
    assert status == 404

    status, page = await get(client, proxy.url + f"/admin/dashboard?key={ADMIN_KEY}")
    assert status == 200 and "<svg" in page
    assert ADMIN_KEY not in page  # the page never echoes the key back
    async with client.get(proxy.url + "/admin/dashboard", headers=AUTH) as response:
        assert response.headers["Referrer-Policy"] == "no-referrer"
        assert response.headers["Cache-Control"] == "no-store"
        csp = response.headers["Content-Security-Policy"]
        nonce = csp.split("'nonce-", 1)[1].split("'", 1)[0]
        assert f'<script nonce="{nonce}">' in await response.text()


async def test_state_shows_slots_tenants_quotas_and_no_prompt_text(
    client: aiohttp.ClientSession, proxy: Dashboard
) -> None:
    acme = new_tenant(proxy, "acme", quota_bytes=1 << 30, quota_archives=50)
    globex = new_tenant(proxy, "globex")
    await chat(client, proxy, acme, "conv-acme-1", turns=1)
    await asyncio.sleep(SAMPLE_INTERVAL_S * 2)  # let the sampler close an interval
    await chat(client, proxy, acme, "conv-acme-1", turns=2)  # reuses the first turn

    document, text = await state(client, proxy)
    [upstream] = document["upstreams"]
    assert upstream["url"] == proxy.server.url
    assert upstream["healthy"] is True and upstream["ram_cache"] is False
    assert [slot["id"] for slot in upstream["slots"]] == [0, 1, 2, 3]
    used = [slot for slot in upstream["slots"] if slot["tenant_id"] == acme.tenant.id]
    assert len(used) == 1, upstream["slots"]  # the second turn went where the first one was
    [slot] = used
    assert slot["busy"] is False
    assert slot["n_tokens"] > 0 and slot["n_ctx"] > slot["n_tokens"]
    assert slot["tenant_name"] == "acme" and slot["session"] == "conv-acme-1"
    assert 0 <= slot["last_used_age_s"] < 60
    for other in upstream["slots"]:
        if other is not slot:
            assert other["tenant_id"] is None
            # never used, or longer ago (the start-up probe runs on an idle slot: on a fresh
            # server, an empty one, whose age then shows)
            age = other["last_used_age_s"]
            assert age is None or age >= slot["last_used_age_s"]

    tenants = {row["name"]: row for row in document["tenants"]}
    assert set(tenants) == {"acme", "globex"}  # no default tenant once tenants exist
    assert tenants["acme"]["id"] == acme.tenant.id
    assert tenants["acme"]["quota_bytes"] == 1 << 30 and tenants["acme"]["quota_archives"] == 50
    assert tenants["globex"]["id"] == globex.tenant.id
    assert tenants["globex"]["quota_bytes"] is None and tenants["globex"]["quota_archives"] is None
    # the disk tier reports: nothing evicted, so nothing archived yet
    assert document["archive_available"] is True
    assert tenants["acme"]["archive_bytes"] == 0 and tenants["acme"]["archive_count"] == 0
    usage = tenants["acme"]["usage"]
    assert usage["requests"] == 2
    assert 0 < usage["reused_tokens"] < usage["prompt_tokens"]
    assert usage["reuse_ratio"] == pytest.approx(usage["reused_tokens"] / usage["prompt_tokens"])
    assert tenants["globex"]["usage"]["requests"] == 0
    assert document["totals"]["prompt_tokens"] == usage["prompt_tokens"]
    # the usage ledger's day, counted but not necessarily written yet
    [day] = document["ledger_days"]
    assert (day["tenant_id"], day["tenant_name"], day["requests"]) == (acme.tenant.id, "acme", 2)
    assert day["reused_slot_tokens"] == usage["reused_tokens"]
    assert day["computed_tokens"] == usage["decoded_tokens"]

    # the reuse series: a sample covering the second request shows its reuse
    await asyncio.sleep(SAMPLE_INTERVAL_S * 2)
    document, text = await state(client, proxy)
    series = document["reuse_series"]
    assert series["interval_s"] == SAMPLE_INTERVAL_S and series["capacity"] == 120
    measured = [s for s in series["samples"] if s["ratio"] is not None]
    assert sum(s["prompt_tokens"] for s in measured) == usage["prompt_tokens"]
    assert sum(s["reused_tokens"] for s in measured) == usage["reused_tokens"]
    assert any(s["ratio"] > 0 for s in measured)

    # ids and counts only: no prompt text, no token ids, no keys
    assert SECRET_WORD.lower() not in text.lower()
    assert acme.key not in text and ADMIN_KEY not in text
    _, page = await get(client, proxy.url + "/admin/dashboard", AUTH)
    assert SECRET_WORD.lower() not in page.lower()


def test_reuse_history_measures_each_interval_alone() -> None:
    history = ReuseHistory(capacity=3)
    history.sample(100, 50, now=1.0)  # the baseline: what ran before has no interval
    assert not history.samples
    history.sample(300, 200, now=2.0)
    history.sample(300, 200, now=3.0)  # nothing ran: no ratio, not 0
    history.sample(400, 200, now=4.0)
    history.sample(500, 300, now=5.0)  # the oldest falls out
    ratios = [s["ratio"] for s in history.to_json(5.0)["samples"]]
    assert ratios == [None, 0.0, 1.0]


# -- the page in headless Chromium -----------------------------------------------------------


@pytest.fixture(scope="session")
def chromium() -> Path:
    """The browser, found or installed once (apt-get, as root) before the test starts."""
    try:
        return ensure_chromium()
    except ChromiumUnavailable as exc:
        # a failure, never a skip: a dashboard nobody ever rendered is not tested
        pytest.fail(f"the dashboard test needs a headless Chromium: {exc}")


async def run_chromium(chromium: Path, url: str, profile: Path, *extra: str) -> bytes:
    """Chromium headless on `url`; the proxy serves from this event loop, so never block it."""
    process = await asyncio.create_subprocess_exec(
        str(chromium),
        "--headless",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
        "--virtual-time-budget=5000",  # time for a few 2 s polls of /admin/state
        *extra,
        url,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), CHROMIUM_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        pytest.fail(f"chromium did not finish within {CHROMIUM_TIMEOUT_S} s")
    assert process.returncode == 0, stderr.decode(errors="replace")[-3000:]
    return stdout


def png_facts(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the pixel data) of a PNG, checking its CRCs."""
    assert data.startswith(PNG_SIGNATURE), data[:16]
    offset, width, height, idat = len(PNG_SIGNATURE), 0, 0, b""
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        chunk = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + chunk) == crc, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            width, height = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            idat += chunk
        elif kind == b"IEND":
            break
        offset += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


async def test_page_in_headless_chromium_shows_live_slots(
    client: aiohttp.ClientSession, proxy: Dashboard, tmp_path: Path, chromium: Path
) -> None:
    acme = new_tenant(proxy, "acme", quota_bytes=1 << 30, quota_archives=50)
    globex = new_tenant(proxy, "globex", quota_bytes=256 << 20)
    # a few turns spread over sampling intervals, so the reuse curve has points to join
    for turn in range(1, 4):
        await chat(client, proxy, acme, "conv-acme-1", turns=turn)
        await chat(client, proxy, globex, "conv-globex-7", turns=turn)
        await asyncio.sleep(SAMPLE_INTERVAL_S * 1.5)
    await chat(client, proxy, acme, "conv-acme-2", turns=1)
    await asyncio.sleep(SAMPLE_INTERVAL_S * 1.5)
    page = f"{proxy.url}/admin/dashboard?key={ADMIN_KEY}"

    document, _ = await state(client, proxy)  # what the page should show: nothing runs now
    held = [slot for slot in document["upstreams"][0]["slots"] if slot["tenant_id"]]
    assert {slot["tenant_name"] for slot in held} == {"acme", "globex"}

    dom = (await run_chromium(chromium, page, tmp_path / "profile-dom", "--dump-dom")).decode()
    # what the script drew, without the script itself (whose source holds words like "healthy")
    dom = re.sub(r"<script\b.*?</script>", "", dom, flags=re.DOTALL)
    assert "<tbody" in dom and 'data-slot="0"' in dom
    assert proxy.server.url in dom
    for text in ("slot 0", "slot 3", "acme", "globex", acme.tenant.id, globex.tenant.id):
        assert text in dom, text
    for slot in held:  # each live slot's conversation and size, as the proxy's table has them
        assert slot["session"] in dom, slot
        assert f"{slot['n_tokens']:,} / {slot['n_ctx']:,}" in dom, slot
    assert "0 B / 1.0 GiB" in dom and "0 / 50" in dom  # archive use against the quotas
    assert "0 B / 256.0 MiB" in dom
    assert '<span class="badge ok">healthy</span>' in dom
    assert re.search(r'<span id="status" class="status muted">updated [0-9:]+</span>', dom), dom
    assert "<polyline" in dom  # the reuse-rate curve
    # the usage ledger's table: acme's four requests of today
    ledger_row = r'<td class="mono">\d{4}-\d\d-\d\d</td><td>acme</td><td class="num">4</td>'
    assert re.search(ledger_row, dom), dom
    assert SECRET_WORD.lower() not in dom.lower()

    screenshot = tmp_path / "dashboard.png"
    await run_chromium(chromium, page, tmp_path / "profile-shot", f"--screenshot={screenshot}")
    check_and_keep_screenshot(screenshot)


def check_and_keep_screenshot(screenshot: Path) -> None:
    """A real 1280x900 PNG with content, copied to $CACHEPROXY_SCREENSHOT_DIR if set."""
    assert screenshot.is_file(), "chromium wrote no screenshot"
    data = screenshot.read_bytes()
    width, height, distinct = png_facts(data)
    assert (width, height) == (1280, 900)
    assert len(data) > 20_000 and distinct > 16, "the screenshot looks blank"
    if keep := os.environ.get("CACHEPROXY_SCREENSHOT_DIR"):
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(screenshot, Path(keep) / "dashboard.png")
