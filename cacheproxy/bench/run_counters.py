"""What a benchmark run did, in the processes' own words: the proxy's disk-tier counters and
decisions, and llama-server's counters, from their `/metrics`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from cacheproxy.bench.harness import fail_on_bad_status
from cacheproxy.disk.archive_types import FILE_NAME_PATTERN
from cacheproxy.disk.kv_blocks import BLOCKS_DIR, block_files

# how long a run's last saves may take to be cut into blocks before the disk is measured
CUTS_WAIT_S = 120.0

DISK_COUNTERS = {
    "saves": 'cacheproxy_archive_saves_total{outcome="saved"}',
    "save_bytes": "cacheproxy_archive_saved_bytes_total",
    "save_s": "cacheproxy_archive_save_seconds_sum",
    "restores": 'cacheproxy_archive_restores_total{outcome="restored"}',
    "restore_bytes": "cacheproxy_archive_restored_bytes_total",
    "restore_s": "cacheproxy_archive_restore_seconds_sum",
    "failed_restores": 'cacheproxy_archive_restores_total{outcome="failed"}',
    # with `disk.blocks` a save is written twice (the server's file, then what its cut adds),
    # and a restore writes a file put together from blocks for the server to read
    "block_written_bytes": 'cacheproxy_archive_block_bytes_total{kind="written"}',
    "block_shared_bytes": 'cacheproxy_archive_block_bytes_total{kind="shared"}',
    "assembled_bytes": "cacheproxy_archive_assembled_bytes_total",
    "assemble_s": "cacheproxy_archive_assemble_seconds_sum",
    # answers whose cache_n the proxy's prediction did not match
    "mispredictions": 'cacheproxy_predictions_total{result="mismatch"}',
    # the part of those times llama-server's main loop spent (no slot decoded meanwhile)
    "save_stall_s": 'cacheproxy_disk_stall_seconds_total{action="save"}',
    "restore_stall_s": 'cacheproxy_disk_stall_seconds_total{action="restore"}',
    "save_stall_slot_s": 'cacheproxy_disk_stall_slot_seconds_total{action="save"}',
    "restore_stall_slot_s": 'cacheproxy_disk_stall_slot_seconds_total{action="restore"}',
    # from asking the server for each save and restore to its answer (the stall above, the
    # batch under way, the exchange), and how many were answered
    "save_round_trip_s": 'cacheproxy_disk_round_trip_seconds_sum{action="save"}',
    "save_round_trips": 'cacheproxy_disk_round_trip_seconds_count{action="save"}',
    "restore_round_trip_s": 'cacheproxy_disk_round_trip_seconds_sum{action="restore"}',
    "restore_round_trips": 'cacheproxy_disk_round_trip_seconds_count{action="restore"}',
    # how long requests waited for a slot (a slot idle meanwhile is server time lost)
    "queue_wait_s": "cacheproxy_queue_wait_seconds_sum",
    "queued": "cacheproxy_queue_wait_seconds_count",
}


# what the requests still waited for when they were served (slots/waiter.py's reasons)
WAIT_REASON_SAMPLE = "cacheproxy_queue_wait_by_reason_seconds_total{"
# the shadow of the server's RAM cache (one with `--cache-ram`), by upstream: the budget it
# follows, and how much of it the server has shown it keeps (-1: the budget taken as a fact)
SHADOW_SAMPLES = {
    "cacheproxy_shadow_budget_bytes{": "ram_cache_budget_bytes",
    "cacheproxy_shadow_proven_bytes{": "ram_cache_shown_bytes",
}


async def metric_samples(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> dict[str, float]:
    """Every sample of a Prometheus text `/metrics` at `url`, by name with its labels; none
    from a llama-server started without `--metrics` (or a proxy in front of one, which answers
    its 501 as it does)."""
    async with session.get(url + "/metrics", headers=headers) as response:
        if response.status == 501:
            return {}
        await fail_on_bad_status(response)
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            samples[name] = float(value)
    return samples


async def disk_tier_counters(session: aiohttp.ClientSession, proxy_url: str) -> dict[str, float]:
    """The proxy's saves and restores, with their bytes and time, from its /metrics."""
    samples = await metric_samples(session, proxy_url)
    figures = {figure: samples.get(sample, 0.0) for figure, sample in DISK_COUNTERS.items()}
    # every decision with its reason: why a slot was or was not saved
    for name, value in samples.items():
        if name.startswith(DECISION_COUNTERS):
            figures[name.removeprefix("cacheproxy_")] = value
        elif name.startswith(WAIT_REASON_SAMPLE):  # ...{reason="slots_busy"}: "wait_slots_busy"
            figures["wait_" + name.removeprefix(WAIT_REASON_SAMPLE).split('"')[1]] = value
    for prefix, figure in SHADOW_SAMPLES.items():
        values = [value for name, value in samples.items() if name.startswith(prefix)]
        if values:  # over the upstreams; any taken as a fact: the fact's -1
            figures[figure] = -1.0 if min(values) < 0 else sum(values)
    return figures


async def disk_held(
    session: aiohttp.ClientSession, proxy_url: str, folder: Path
) -> dict[str, float]:
    """What the archive folder holds once the proxy has cut every save into blocks (with
    `disk.blocks`): its archive files and block files, in bytes, and what the archives would
    take as whole files (the proxy's own count)."""
    deadline = time.monotonic() + CUTS_WAIT_S
    while True:
        samples = await metric_samples(session, proxy_url)
        pending = samples.get("cacheproxy_archive_conversions_pending", 0.0)
        if not pending or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    whole, cut = await asyncio.to_thread(folder_bytes, folder)
    held = sum(
        value for name, value in samples.items() if name.startswith("cacheproxy_archive_bytes{")
    )
    saved = sum(
        value
        for name, value in samples.items()
        if name.startswith("cacheproxy_archive_deduplicated_bytes{")
    )
    return {
        "held_bytes": float(whole + cut),
        "held_whole_file_bytes": float(whole),
        "held_block_bytes": float(cut),
        # the archives as whole files: what the disk would hold without blocks
        "held_as_whole_files_bytes": held + saved,
        "cuts_pending": pending,
    }


def folder_bytes(folder: Path) -> tuple[int, int]:
    """The bytes of the archive files in `folder`, and of its block files."""
    whole = sum(
        path.stat().st_size for path in folder.iterdir() if FILE_NAME_PATTERN.fullmatch(path.name)
    )
    return whole, sum(block_files(folder / BLOCKS_DIR).values())


DECISION_COUNTERS = (
    "cacheproxy_archive_saves_total{",
    "cacheproxy_saves_skipped_total{",
    "cacheproxy_evictions_total{",
    "cacheproxy_archive_restores_total{",
    "cacheproxy_predictions_total{",  # how often the table's and the shadow's missed
    "cacheproxy_shadow_mispredictions_total{",
    # and the cost model's inputs as the run left them
    "cacheproxy_prefill_server_tokens_per_second{",
    "cacheproxy_prefill_tokens_per_second{",
    "cacheproxy_disk_save_mib_per_second{",
    "cacheproxy_disk_restore_mib_per_second{",
    "cacheproxy_disk_overhead_ms{",
    "cacheproxy_disk_busy_when_placed{",
    "cacheproxy_disk_bytes_per_token{",
)


SERVER_COUNTERS = (
    "prompt_tokens_total",
    "prompt_seconds_total",
    "tokens_predicted_total",
    "tokens_predicted_seconds_total",
    "n_decode_total",
    "n_busy_slots_per_decode",
)


async def server_counters(session: aiohttp.ClientSession, server_url: str) -> dict[str, float]:
    """llama-server's own counters (`--metrics`), where the server's time went: those of the
    process running at the end (a restart starts them again)."""
    samples = await metric_samples(session, server_url)
    return {
        name: samples[f"llamacpp:{name}"]
        for name in SERVER_COUNTERS
        if f"llamacpp:{name}" in samples
    }


def decode_fill(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """llama-server's decode calls between two reads of its counters, and the busy slots they
    ran summed (it keeps their mean since it started: `n_busy_slots_per_decode`)."""
    decodes_before, decodes = before.get("n_decode_total", 0.0), after.get("n_decode_total", 0.0)
    busy_before = before.get("n_busy_slots_per_decode", 0.0) * decodes_before
    busy = after.get("n_busy_slots_per_decode", 0.0) * decodes
    return decodes - decodes_before, busy - busy_before


def server_work(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What llama-server did between two reads of its counters: its decode calls, the busy
    slots each ran on average, and the seconds its prompts and its generation took."""
    decodes, busy = decode_fill(before, after)
    return {
        "decode_calls": decodes,
        "busy_slots_per_decode": busy / decodes if decodes else 0.0,
        "prompt_s": after.get("prompt_seconds_total", 0.0)
        - before.get("prompt_seconds_total", 0.0),
        "generation_s": after.get("tokens_predicted_seconds_total", 0.0)
        - before.get("tokens_predicted_seconds_total", 0.0),
    }
