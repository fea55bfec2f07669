"""Router-mode llama-servers for the tests: one process serving several test models, each a
model instance it loads on demand (`--models-dir`), and what a test reads of each instance."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

import aiohttp

from cacheproxy.provision.make_model import model_folder
from tests.support.servers import LlamaServer, start_llama_server

# test models of the same shape with weights of their own (what they answer tells them apart)
SEEDS = {"alpha": 1234, "beta": 4321, "gamma": 5678}


def start_router(
    binary: Path,
    workdir: Path,
    models: tuple[str, ...] = ("alpha", "beta"),
    *,
    models_max: int = 2,
    parallel: int = 2,
    ctx_size: int = 8192,
    slot_save_path: Path | None = None,
    extra_args: tuple[str, ...] = (),
) -> LlamaServer:
    """A router serving `models` (names of `SEEDS`), at most `models_max` loaded at once;
    every instance it starts takes its -np, -c, --cache-ram 0, --slot-save-path, --metrics
    (and `extra_args`)."""
    folder = model_folder(workdir / "models", {name: SEEDS[name] for name in models})
    return start_llama_server(
        binary,
        None,
        workdir,
        parallel=parallel,
        ctx_size=ctx_size,
        slot_save_path=slot_save_path,
        extra_args=("--models-dir", str(folder), "--models-max", str(models_max), *extra_args),
    )


def start_plain(
    binary: Path, workdir: Path, name: str, *, parallel: int = 2, slot_save_path: Path | None = None
) -> LlamaServer:
    """A plain llama-server of one test model, named `name` (`--alias`)."""
    folder = model_folder(workdir / f"model-{name}", {name: SEEDS[name]})
    return start_llama_server(
        binary,
        folder / f"{name}.gguf",
        workdir,
        parallel=parallel,
        ctx_size=8192,
        slot_save_path=slot_save_path,
        extra_args=("--alias", name),
    )


def model_query(model: str | None) -> str:
    return "" if model is None else f"?model={quote(model, safe='')}&autoload=false"


async def instance_slots(
    client: aiohttp.ClientSession, server: LlamaServer, model: str | None = None
) -> list[dict]:
    """The server's own `GET /slots` (a router's: of the instance of `model`, never loading it)."""
    async with client.get(server.url + "/slots" + model_query(model)) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def prompt_tokens_total(
    client: aiohttp.ClientSession, server: LlamaServer, model: str | None = None
) -> float:
    """The server's own `llamacpp:prompt_tokens_total` (a router's: of the instance of `model`).

    The server counts a prompt's tokens once a batch of it has an output, or when its loop
    next finds every slot idle (tools/server/server-context.cpp `metrics_flush_idle`, 3026):
    a `GET /slots` first (a task of its own) has it count what it queued."""
    await instance_slots(client, server, model)
    async with client.get(server.url + "/metrics" + model_query(model)) as response:
        assert response.status == 200, await response.text()
        text = await response.text()
    found = re.search(r"^llamacpp:prompt_tokens_total (\S+)$", text, re.MULTILINE)
    assert found, text
    return float(found.group(1))


async def model_statuses(client: aiohttp.ClientSession, router: LlamaServer) -> dict[str, str]:
    """Each model of a router and its status: unloaded, loading, loaded, sleeping."""
    async with client.get(router.url + "/models") as response:
        listed = await response.json()
    return {entry["id"]: entry["status"]["value"] for entry in listed["data"]}
