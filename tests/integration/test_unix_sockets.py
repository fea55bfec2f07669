"""llama-server on a unix socket (`--host /path/server.sock`), and the proxy on one: both sides
of the proxy speak HTTP over a unix socket as over TCP.

The upstream is configured as `unix:///path/server.sock`, the address llama-server prints; its
requests, the proxy's own calls (the probe, slot saves and restores, /slots, /metrics) and the
pooled connections all reach it there (upstreams/unix_sockets.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.ops.shutdown import CannotListen, check_can_listen
from cacheproxy.settings import load_settings
from cacheproxy.upstreams.unix_sockets import socket_path, transport_base
from tests.support.completions import complete
from tests.support.disk_tier import TWO_SLOTS, conversation
from tests.support.servers import StartServer, http_status, serving
from tests.support.transports import SERVER_ROUTES, serves_as_over_tcp


@pytest.fixture
def socket_folder() -> Iterator[Path]:
    """A short folder: a socket's path has at most 107 bytes, which a deep tmp_path may pass."""
    with tempfile.TemporaryDirectory(prefix="cp-") as folder:
        yield Path(folder)


async def test_a_server_on_a_unix_socket_is_served_predicted_and_archived(
    start_server: StartServer, tmp_path: Path, socket_folder: Path
) -> None:
    socket = socket_folder / "llama.sock"
    server = start_server(host=str(socket), **TWO_SLOTS)
    assert server.url == f"unix://{socket}"
    disk = {"directory": server.slot_save_path, "database": tmp_path / "archive.db"}
    settings = load_settings(
        upstreams=[server.url], state_dir=tmp_path / "state", disk={**disk, "min_tokens": 128}
    )
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        await serves_as_over_tcp(client, url, app)
    for path in SERVER_ROUTES:
        assert http_status(f"{server.url}{path}") == 200  # the test's own client, as curl's


async def test_the_proxy_listens_on_a_unix_socket_as_llama_server_does(
    start_server: StartServer, tmp_path: Path, socket_folder: Path
) -> None:
    """`--host /path/proxy.sock`, as llama-server's: clients reach the proxy over the socket;
    a path another process listens on is refused at the start, a stale one is taken."""
    server = start_server(parallel=1)
    listening = socket_folder / "proxy.sock"
    settings = load_settings(upstreams=[server.url], state_dir=tmp_path / "state")
    async with serving(settings, unix_socket=listening):
        with pytest.raises(CannotListen, match="another process listens there"):
            check_can_listen([str(listening)], 0)
        connector = aiohttp.UnixConnector(path=str(listening))
        async with aiohttp.ClientSession(connector=connector) as client:
            answer = await complete(client, "http://localhost", conversation(3, 40))
            assert answer["timings"]["prompt_n"] == 40
    assert listening.is_socket()  # left behind, nobody listening there: taken again
    check_can_listen([str(listening)], 0)


def test_a_unix_socket_url_spells_its_path_in_a_host_name_that_never_resolves() -> None:
    path = "/run/llama/" + "s" * 90 + ".sock"  # near the 107 bytes a socket path may have
    base = transport_base("unix://" + path)
    host = base.removeprefix("http://")
    assert host.endswith(".invalid") and all(len(label) <= 63 for label in host.split("."))
    assert len(host) <= 253
    assert socket_path(host) == path
    assert socket_path("127.0.0.1") is None and socket_path("nothex.unix.invalid") is None
    assert transport_base("http://127.0.0.1:8080") == "http://127.0.0.1:8080"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("unix://", "names the socket file"),
        ("unix:///run/llama/", "names the socket file"),
        ("unix:///" + "a" * 120, "at most 107 bytes"),
        ("ftp://127.0.0.1:8080", "URL scheme should be 'http' or 'https'"),
    ],
)
def test_an_upstream_url_that_names_no_server_is_refused_at_load(value: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_settings(upstreams=[value])


def test_a_relative_socket_path_is_taken_from_the_current_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As llama-server's `--host server.sock` binds it where it was started."""
    monkeypatch.chdir(tmp_path)
    settings = load_settings(upstreams=["unix://server.sock"])
    assert settings.upstream_urls() == [f"unix://{tmp_path / 'server.sock'}"]
