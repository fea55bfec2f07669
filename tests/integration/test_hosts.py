"""Conversations across llama-servers that share one archive folder: archived by one server,
restored by another, also when the first dies.

The servers load copies of the model at different paths (the fingerprint depends on the model's
content, not on where its file lies). The first test runs them on two "hosts": network
namespaces, each with its own GlusterFS mount of the archive (`cacheproxy.provision.hosts`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import struct
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.disk.fingerprint import compatibility_fingerprint
from cacheproxy.disk.slot_file import read_slot_file
from cacheproxy.http.app_keys import ARCHIVES, CACHE
from cacheproxy.settings import Settings, load_settings
from cacheproxy.upstreams.managed import free_port
from tests.support.completions import complete
from tests.support.cpu import cpu_capped
from tests.support.disk_tier import PROMPT_TOKENS, archived, conversation, next_turn
from tests.support.hosts import start_on_host, two_hosts
from tests.support.metrics import proxy_counters
from tests.support.servers import serving, start_llama_server
from tests.support.waiting import wait_for

ONE_SLOT = {"parallel": 1, "ctx_size": 4096}
# what a one-slot server holds after a first turn: the prompt and the answer but its last token
ARCHIVED_TOKENS = PROMPT_TOKENS + 3


def shared_archive_settings(
    upstreams: list[str], archive: Path, workdir: Path, **overrides: Any
) -> Settings:
    disk = {
        "directory": archive,
        "database": workdir / "archive.db",
        "min_tokens": 128,
        **overrides.pop("disk", {}),
    }
    return load_settings(upstreams=upstreams, state_dir=workdir / "state", disk=disk, **overrides)


async def test_archived_on_one_host_restores_on_another(
    llama_server_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    with two_hosts(tmp_path / "hosts") as testbed:
        host_a, host_b = testbed.hosts
        server_a = start_on_host(host_a, llama_server_binary, tiny_model, tmp_path, **ONE_SLOT)
        server_b = start_on_host(host_b, llama_server_binary, tiny_model, tmp_path, **ONE_SLOT)
        try:
            # host A's server saves into its own mount; the proxy reads its own mount
            settings_a = shared_archive_settings(
                [server_a.url],
                testbed.proxy_archive,
                tmp_path,
                disk={"upstream_save_paths": {server_a.url: str(host_a.archive)}},
            )
            async with (
                serving(settings_a) as (url, app),
                aiohttp.ClientSession() as client,
            ):
                first = conversation(1)
                answer = await complete(client, url, first)
                await complete(client, url, conversation(100))  # takes the only slot
                assert archived(app[ARCHIVES].blocking) == [("default", ARCHIVED_TOKENS)]
                fingerprint_a = app[CACHE].disk.attached[0].fingerprint

            settings_b = shared_archive_settings(
                [server_b.url],
                testbed.proxy_archive,
                tmp_path,
                disk={"upstream_save_paths": {server_b.url: str(host_b.archive)}},
            )
            async with (
                serving(settings_b) as (url, app),
                aiohttp.ClientSession() as client,
            ):
                assert app[CACHE].disk.attached[0].fingerprint == fingerprint_a
                again = await complete(client, url, next_turn(first, answer, 2))
                # host B read host A's file through its own GlusterFS client: no prefill
                assert again["timings"]["cache_n"] == ARCHIVED_TOKENS
                counters = await proxy_counters(client, url)
                assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 1
        finally:
            server_a.stop()
            server_b.stop()


async def test_conversations_of_a_killed_server_resume_on_another(
    llama_server_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    archive = tmp_path / "archive"
    models = []
    for name in ("a", "b"):
        copy = tmp_path / name / tiny_model.name
        copy.parent.mkdir()
        shutil.copyfile(tiny_model, copy)
        models.append(copy)
    server_a = start_llama_server(
        llama_server_binary, models[0], tmp_path / "a", slot_save_path=archive, **ONE_SLOT
    )
    port_b = free_port()
    url_b = f"http://127.0.0.1:{port_b}"
    settings = shared_archive_settings(
        [server_a.url, url_b], archive, tmp_path, routing={"health_interval_s": 0.2}
    )
    server_b = None
    try:
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
            layer = app[CACHE]
            table_a, table_b = layer.tables
            assert not table_b.healthy  # B is not started yet: everything runs on A
            first = conversation(1)
            answer = await complete(client, url, first)
            await complete(client, url, conversation(100))
            assert archived(app[ARCHIVES].blocking) == [("default", ARCHIVED_TOKENS)]

            server_b = start_llama_server(
                llama_server_binary,
                models[1],
                tmp_path / "b",
                port=port_b,
                slot_save_path=archive,
                **ONE_SLOT,
            )
            await wait_for(lambda: table_b.healthy and 1 in layer.disk.attached, within_s=60)
            assert layer.disk.attached[1].fingerprint == layer.disk.attached[0].fingerprint

            # a long turn of the other conversation runs on A when A is killed
            long_turn = asyncio.create_task(
                client.post(
                    url + "/completion",
                    json={"prompt": [*conversation(100), 5], "n_predict": 100000},
                )
            )
            await wait_for(lambda: any(slot.busy for slot in table_a.slots))
            server_a.kill()
            await wait_for(lambda: not table_a.healthy)
            response = await long_turn
            response.release()

            again = await complete(client, url, next_turn(first, answer, 2))
            # the conversation A held came back on B from its archive, not from prefill
            assert again["timings"]["cache_n"] == ARCHIVED_TOKENS
            counters = await proxy_counters(client, url)
            assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 1
    finally:
        server_a.stop()
        if server_b is not None:
            server_b.stop()


async def test_another_kv_layout_gets_another_fingerprint(
    llama_server_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The same weights with keys cached as q8_0: llama-server refuses to restore an f16 state
    there ("mismatched key type"), so no archive may match across."""
    archive = tmp_path / "archive"
    servers = [
        start_llama_server(
            llama_server_binary,
            tiny_model,
            tmp_path,
            slot_save_path=archive,
            extra_args=extra,
            **ONE_SLOT,
        )
        for extra in ((), ("--cache-type-k", "q8_0"), ())
    ]
    try:
        settings = shared_archive_settings([server.url for server in servers], archive, tmp_path)
        async with serving(settings) as (_, app):
            attached = app[CACHE].disk.attached
            assert sorted(attached) == [0, 1, 2]
            assert attached[0].fingerprint == attached[2].fingerprint
            assert attached[1].fingerprint != attached[0].fingerprint
    finally:
        for server in servers:
            server.stop()


async def test_archives_indexed_before_the_kv_layout_counted_still_match(
    llama_server_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """An index written when the fingerprint had no KV layout: at attach, its archives whose
    files show the server's layout are indexed under the new fingerprint, the others are not."""
    archive = tmp_path / "archive"
    server = start_llama_server(
        llama_server_binary, tiny_model, tmp_path, slot_save_path=archive, **ONE_SLOT
    )
    try:
        # whole files, as every index written before the layout counted holds (blocks came after)
        settings = shared_archive_settings([server.url], archive, tmp_path, disk={"blocks": False})
        first, second = conversation(1), conversation(2, 500)
        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
            first_answer = await complete(client, url, first)
            await complete(client, url, second)  # archives the first
            fingerprint = app[CACHE].disk.attached[0].fingerprint
        # stopping archived the second too; now the index is as an older version wrote it
        database = sqlite3.connect(tmp_path / "archive.db")
        with database:
            (facts,) = database.execute(
                "SELECT facts FROM fingerprints WHERE fingerprint = ?", [fingerprint]
            ).fetchone()
            legacy_facts = {k: v for k, v in json.loads(facts).items() if k != "kv_layout"}
            legacy = compatibility_fingerprint(legacy_facts)
            for table in ("archives", "archive_blocks"):
                database.execute(f"UPDATE {table} SET fingerprint = ?", [legacy])
            # one archive whose file says another layout (its key type byte changed): it must
            # stay under the old fingerprint
            (other,) = database.execute(
                "SELECT file_name FROM archives WHERE n_tokens != ?", [ARCHIVED_TOKENS]
            ).fetchone()
        database.close()
        change_first_key_type(archive / other)

        async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
            assert app[CACHE].disk.attached[0].fingerprint == fingerprint
            again = await complete(client, url, next_turn(first, first_answer, 3))
            assert again["timings"]["cache_n"] == ARCHIVED_TOKENS
        database = sqlite3.connect(tmp_path / "archive.db")
        with database:
            labels = dict(database.execute("SELECT file_name, fingerprint FROM archives"))
        database.close()
        assert labels[other] == legacy
    finally:
        server.stop()


def change_first_key_type(path: Path) -> None:
    """Rewrite the first layer's K type id in a slot file (the layout a restore would refuse)."""
    header = read_slot_file(path)
    data = bytearray(path.read_bytes())
    offset = header.state_offset + 4  # past n_stream
    for _ in range(header.n_stream):
        (cells,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if cells:
            break
    offset += cells * 12 + 16  # cells' pos, seq count, seq id; v_trans, n_layer, n_rot_k/v
    (k_type,) = struct.unpack_from("<i", data, offset)
    struct.pack_into("<i", data, offset, k_type + 7)
    path.write_bytes(bytes(data))


def holder(tables: list, prompt: list[int]) -> tuple[int, int] | None:
    """(upstream, slot) of the table entry that holds `prompt` whole, if any."""
    for table in tables:
        for slot in table.slots:
            if slot.known[: len(prompt)] == prompt:
                return table.index, slot.slot_id
    return None


async def test_a_conversation_moves_off_a_loaded_server(
    llama_server_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """A's free slot holds the conversation but A's other slots are busy generating; B is
    idle. The router places the next turn (with a long tool output) on B; rather than prefill
    it all there, the proxy saves the conversation on A and restores it on B.

    A gets a tenth of one CPU (a cgroup cap): a loaded server. Without it, both servers
    share this machine's CPUs, A's generating slots barely slow its prefill, and whether the
    router moves follows the noise in two prefill rates each measured from a few prompts."""
    archive = tmp_path / "archive"
    four_slots = {"parallel": 4, "ctx_size": 4 * 8192}
    server_a = start_llama_server(
        llama_server_binary, tiny_model, tmp_path / "a", slot_save_path=archive, **four_slots
    )
    port_b = free_port()
    settings = shared_archive_settings(
        [server_a.url, f"http://127.0.0.1:{port_b}"],
        archive,
        tmp_path,
        routing={"health_interval_s": 0.2},
    )
    server_b = None
    long_turns: list[aiohttp.ClientResponse] = []
    with cpu_capped(server_a.process.pid, 0.1):
        try:
            async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
                layer = app[CACHE]
                first = conversation(1)
                answer = await complete(client, url, first)
                upstream, first_slot = holder(layer.tables, first)  # any empty slot of A
                assert upstream == 0
                # two of A's other slots generate at length (B is not up yet, so they run on A);
                # streamed, so that closing them stops the server at once
                for seed in (100, 101):
                    body = {"prompt": conversation(seed), "n_predict": 7000, "stream": True}
                    long_turns.append(await client.post(url + "/completion", json=body))
                busy = [slot.slot_id for slot in layer.tables[0].slots if slot.busy]
                assert len(busy) == 2 and first_slot not in busy
                # A's prefill speed measured under that load, in its last free slot
                await complete(client, url, conversation(150, 200))
                (last_free,) = set(range(4)) - {first_slot, *busy}
                assert holder(layer.tables, conversation(150, 200)) == (0, last_free)

                server_b = start_llama_server(
                    llama_server_binary,
                    tiny_model,
                    tmp_path / "b",
                    port=port_b,
                    slot_save_path=archive,
                    **four_slots,
                )
                # a fresh server's first prompt is slow (buffers allocated, weights paged in):
                # sent straight to B, so that the proxy measures B on the ones after it
                await complete(client, server_b.url, conversation(199, 200))
                await wait_for(
                    lambda: layer.tables[1].healthy and 1 in layer.disk.attached, within_s=60
                )
                # and B's, on a conversation of its own
                await complete(client, url, conversation(200, 200))
                assert holder(layer.tables, conversation(200, 200))[0] == 1

                follow_up = next_turn(first, answer, 2) + conversation(3, 1500)
                again = await complete(client, url, follow_up)
                assert layer.tables[0].slots[busy[0]].busy, "A was no longer busy"
                assert holder(layer.tables, follow_up)[0] == 1
                # what A's slot held came to B through the archive folder, not through prefill
                assert again["timings"]["cache_n"] == ARCHIVED_TOKENS
                counters = await proxy_counters(client, url)
                assert counters['cacheproxy_archive_restores_total{outcome="restored"}'] == 1
                for response in long_turns:
                    response.close()
        finally:
            server_a.stop()
            if server_b is not None:
                server_b.stop()
