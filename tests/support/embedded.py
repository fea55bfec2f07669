"""The embedded engine on a loopback port, for tests that talk to it over HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from cacheproxy.embedded.server import EmbeddedServer
from cacheproxy.settings import EmbeddedSettings
from tests.support.completions import complete

N_PREDICT = 4  # what `complete` asks for unless told otherwise


@contextlib.asynccontextmanager
async def embedded(
    model: Path, workdir: Path, *, parallel: int = 2, **settings: Any
) -> AsyncIterator[EmbeddedServer]:
    server = EmbeddedServer(
        EmbeddedSettings(parallel=parallel, ctx_size=2048 * parallel, threads=1, **settings),
        model,
        workdir,
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def converse(
    client: aiohttp.ClientSession,
    url: str,
    openings: list[list[int]],
    questions: list[list[list[int]]],
    cache_prompt: bool,
) -> tuple[list[list[int]], list[int]]:
    """Users take turns, each prompt its opening plus its questions so far (not the answers):
    the generated ids and the reused counts of every turn, in order."""
    outputs, reused = [], []
    histories = [list(opening) for opening in openings]
    for turn in range(len(questions[0])):
        for user, history in enumerate(histories):
            history += questions[user][turn]
            answer = await complete(client, url, history, cache_prompt=cache_prompt, n_predict=8)
            outputs.append(answer["tokens"])
            reused.append(answer["timings"]["cache_n"])
    return outputs, reused
