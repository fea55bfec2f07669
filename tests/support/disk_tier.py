"""The disk tier's test material: a proxy archiving into its llama-server's slot save path,
conversations of token ids and their next turns, and the archive as another process reads it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
from cacheproxy_plugins.eviction_lru import LruEviction

from cacheproxy.disk.store import ArchiveIndex
from cacheproxy.disk.tier import DiskTier
from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import Settings, load_settings
from tests.support import databases
from tests.support.completions import complete
from tests.support.servers import LlamaServer

PROMPT_TOKENS = 600
TWO_SLOTS = {"parallel": 2, "ctx_size": 8192}
# disk settings with no slot archived ahead while idle: a slot is saved by the request that
# evicts it, whatever the time between the requests on the machine
SAVED_ON_THE_PATH = {"ahead_mib_s": 0.0}


def disk_settings(server: LlamaServer, tmp_path: Path, **overrides: Any) -> Settings:
    disk = {
        "directory": server.slot_save_path,
        "database": tmp_path / "archive.db",
        "min_tokens": 128,
        **overrides.pop("disk", {}),
    }
    return load_settings(
        upstreams=[server.url], state_dir=tmp_path / "state", disk=disk, **overrides
    )


def conversation(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


def next_turn(prompt: list[int], answer: dict, seed: int) -> list[int]:
    """The client's next prompt: everything so far plus a new question."""
    return prompt + answer["tokens"] + conversation(seed, 40)


def tier(app: Any) -> DiskTier:
    """The serving proxy's disk tier (it has one)."""
    disk = app[CACHE].disk
    assert disk is not None
    return disk


def open_store(server: LlamaServer, tmp_path: Path) -> ArchiveIndex:
    """The proxy's archive, opened as another process would (the CLI, the next start)."""
    lru = LruEviction(LruEviction.Options())
    return ArchiveIndex(
        server.slot_save_path, databases.chosen(tmp_path / "archive.db"), lru, 1 << 30
    )


def archived(store: ArchiveIndex) -> list[tuple[str, int]]:
    return sorted((archive.tenant_id, archive.n_tokens) for archive in store.list())


async def evict_with_others(
    client: aiohttp.ClientSession, url: str, seeds: range, headers: dict | None = None
) -> None:
    """Fill every slot with other conversations, so the first one must leave its slot."""
    for seed in seeds:
        await complete(client, url, conversation(seed), headers)
