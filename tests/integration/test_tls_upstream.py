"""llama-server over https (`--ssl-key-file`, `--ssl-cert-file`; the pinned build links
OpenSSL): its certificate, issued by a private CA (trustme's), is checked against
`upstream_ca_file`, and the proxy serves it as over plain http, its requests on its own pooled
client. Without that CA the proxy does not talk to it, and says why."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import pytest
import trustme
from yarl import URL

from cacheproxy.http.app_keys import CACHE, UPSTREAM_CONNECTIONS
from cacheproxy.http.start_checks import StartupError, check_state
from cacheproxy.settings import load_settings
from tests.support.completions import complete
from tests.support.disk_tier import TWO_SLOTS, conversation
from tests.support.servers import LlamaServer, StartServer, serving, wait_for_health
from tests.support.transports import serves_as_over_tcp


@pytest.fixture
def ca_file(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A private CA's certificate, and llama-server's flags for a certificate it issued."""
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1")
    ca, key, chain = tmp_path / "ca.pem", tmp_path / "key.pem", tmp_path / "chain.pem"
    authority.cert_pem.write_to_path(str(ca))
    issued.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    return ca, ("--ssl-key-file", str(key), "--ssl-cert-file", str(chain))


def https_server(start_server: StartServer, flags: tuple[str, ...], ca: Path) -> LlamaServer:
    server = start_server(extra_args=flags, wait=False, **TWO_SLOTS)
    wait_for_health(https_url(server), server, ssl.create_default_context(cafile=str(ca)))
    return server


def https_url(server: LlamaServer) -> str:
    return f"https://127.0.0.1:{server.port}"


async def test_a_server_on_https_is_served_predicted_and_archived(
    start_server: StartServer, tmp_path: Path, ca_file: tuple[Path, tuple[str, ...]]
) -> None:
    ca, flags = ca_file
    server = https_server(start_server, flags, ca)
    disk = {"directory": server.slot_save_path, "database": tmp_path / "archive.db"}
    settings = load_settings(
        upstreams=[https_url(server)],
        upstream_ca_file=ca,
        state_dir=tmp_path / "state",
        disk={**disk, "min_tokens": 128},
    )
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        await serves_as_over_tcp(client, url, app)
        # carried by the proxy's own pooled client over TLS, not by aiohttp's: the connection
        # of the last answer is kept in its pool for the next request
        pool = app[UPSTREAM_CONNECTIONS]
        await complete(client, url, conversation(9))
        assert pool.open_count(URL(https_url(server))) >= 1


async def test_an_upstream_whose_certificate_nobody_vouches_for_is_not_served(
    start_server: StartServer, tmp_path: Path, ca_file: tuple[Path, tuple[str, ...]]
) -> None:
    ca, flags = ca_file
    server = https_server(start_server, flags, ca)
    settings = load_settings(upstreams=[https_url(server)], state_dir=tmp_path / "state")
    async with serving(settings) as (url, app), aiohttp.ClientSession() as client:
        assert not app[CACHE].tables[0].healthy
        async with client.post(url + "/completion", json={"prompt": "Hello"}) as response:
            assert response.status == 502
            assert "no upstream is reachable" in (await response.json())["error"]["message"]


def test_a_ca_file_that_holds_no_certificate_stops_the_start(tmp_path: Path) -> None:
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    settings = load_settings(
        upstreams=["https://127.0.0.1:8443"], upstream_ca_file=garbage, state_dir=tmp_path
    )
    with pytest.raises(StartupError, match=r"upstream_ca_file .* holds no CA certificate"):
        check_state(settings)


async def test_a_big_body_goes_out_over_tls_from_its_spill_file(
    start_server: StartServer, tmp_path: Path, ca_file: tuple[Path, tuple[str, ...]]
) -> None:
    """A body made big by a member the proxy never reads is spilled and sent from its file: over
    TLS in blocks the transport takes as it has room (no sendfile there), answered as the body
    small."""
    ca, flags = ca_file
    server = https_server(start_server, flags, ca)
    settings = load_settings(
        upstreams=[https_url(server)], upstream_ca_file=ca, state_dir=tmp_path / "state"
    )
    body = {"prompt": conversation(3), "n_predict": 2, "temperature": 0}
    answers = []
    async with serving(settings) as (url, _), aiohttp.ClientSession() as client:
        for extra in ({}, {"client_padding": "x" * 3_000_000}):
            async with client.post(url + "/completion", json={**body, **extra}) as response:
                answers.append((response.status, (await response.json())["content"]))
    assert answers[0][0] == 200
    assert answers[1] == answers[0]
