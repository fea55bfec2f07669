"""Shared fixtures: the real llama-server build, the generated model, servers and proxies."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.settings import load_settings
from cacheproxy.testbed.build_engine import ensure_engine
from cacheproxy.testbed.build_server import ensure_llama_server
from cacheproxy.testbed.make_model import ensure_model
from tests.servers import LlamaServer, StartServer, running_proxy, start_llama_server


def pytest_sessionstart(session: pytest.Session) -> None:
    """The embedded engine's tests import llama-cpp-python: install the pinned build (from the
    cached wheel, built once) before the test modules are collected."""
    if importlib.util.find_spec("llama_cpp") is None:
        ensure_engine()
        importlib.invalidate_caches()


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    return ensure_llama_server()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_model("small")


@pytest.fixture(scope="session")
def llama_server(
    llama_server_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """One real llama-server (-np 4, slot save path, metrics) shared by tests that only read."""
    server = start_llama_server(llama_server_binary, tiny_model, tmp_path_factory.mktemp("shared"))
    yield server
    server.stop()


@pytest.fixture
def start_server(
    llama_server_binary: Path, tiny_model: Path, tmp_path: Path
) -> Iterator[StartServer]:
    """A factory for llama-servers a test may kill or configure; all are stopped afterwards."""
    started: list[LlamaServer] = []

    def start(**kwargs: Any) -> LlamaServer:
        kwargs.setdefault("model", tiny_model)
        server = start_llama_server(llama_server_binary, workdir=tmp_path, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
async def proxy(llama_server: LlamaServer, tmp_path: Path) -> AsyncIterator[str]:
    """The proxy, in this process on a real socket, in front of the shared llama-server."""
    settings = load_settings(upstreams=[llama_server.url], state_dir=tmp_path / "state")
    async with running_proxy(settings) as url:
        yield url


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
