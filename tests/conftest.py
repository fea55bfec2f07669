"""Shared fixtures: the real llama-server build, the generated model, servers and proxies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.settings import load_settings
from tests.support import databases
from tests.support.servers import LlamaServer, StartServer, running_proxy, start_llama_server

SUITES = ("unit", "integration", "embedded", "compat")
ASYNCIO_ONLY = {"asyncio": asyncio.new_event_loop}


def pytest_addoption(parser: pytest.Parser) -> None:
    databases.add_option(parser)


def pytest_report_header(config: pytest.Config) -> str:
    return f"database backend of the tests marked `database`: {databases.backend(config)}"


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]] | None:
    """The async tests of a module that names `LOOP_FACTORIES` run once on each of those loops
    (the proxy runs on asyncio's or on uvloop's, ops/event_loop.py); the rest on asyncio's."""
    return getattr(getattr(item, "module", None), "LOOP_FACTORIES", ASYNCIO_ONLY)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its suite, the folder it lives in: `pytest -m unit` runs the
    tests that need neither a llama-server nor the engine."""
    for item in items:
        suite = item.path.parent.name
        if suite in SUITES:
            item.add_marker(suite)
        if "database_url" in getattr(item, "fixturenames", ()):
            item.add_marker("database")


@pytest.fixture(scope="session")
def postgres_server(request: pytest.FixtureRequest) -> Iterator[databases.PostgresServer]:
    """One throwaway PostgreSQL server for the session (started only when a test needs it)."""
    with databases.PostgresServer() as server:
        yield server


@pytest.fixture
def database_url(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The test's own PostgreSQL database under `--database postgresql`, else None (SQLite).

    Set as CACHEPROXY_DATABASE_URL for the test, so proxies the test starts use it too."""
    if databases.backend(request.config) != "postgresql":
        monkeypatch.delenv(databases.ENV_DATABASE_URL, raising=False)
        return None
    server = request.getfixturevalue("postgres_server")
    url = server.new_database()
    monkeypatch.setenv(databases.ENV_DATABASE_URL, url)
    return url


@pytest.fixture(autouse=True)
def _database_of_marked_tests(request: pytest.FixtureRequest) -> None:
    # a test marked `database` runs on the chosen backend even if it never names the fixture
    if request.node.get_closest_marker("database") is not None:
        request.getfixturevalue("database_url")


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
