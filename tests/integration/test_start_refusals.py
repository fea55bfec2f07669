"""Every refusal `cacheproxy serve` makes at start is one line on stderr and an exit code: 2 for
settings (a value, a plugin name or its options), 3 for what there is to start with (an upstream
it cannot serve, a managed server that does not come up, a port already held). Each runs
`python -m cacheproxy serve` as its own process. (State files: test_state_faults.py.)"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cacheproxy.upstreams.managed import free_port
from tests.support.serve_once import assert_refused, serve_once
from tests.support.servers import LlamaServer, StartServer

EXIT_BAD_SETTINGS, EXIT_CANNOT_START = 2, 3


@pytest.mark.parametrize(
    ("variable", "kind"),
    [
        ("CACHEPROXY_ROUTING__POLICY", "routing"),
        ("CACHEPROXY_DISK__EVICTION", "eviction"),
        ("CACHEPROXY_EMBEDDED__PROMPT_CACHE", "prompt_cache"),
    ],
)
def test_an_unknown_plugin_name_is_one_line_naming_the_known_ones(
    llama_server: LlamaServer, tmp_path: Path, variable: str, kind: str
) -> None:
    started = serve_once(tmp_path / "state", llama_server.url, **{variable: "nope"})
    assert_refused(started, f"unknown {kind} plugin 'nope'; known: ", EXIT_BAD_SETTINGS)


def test_options_a_plugin_does_not_take_are_one_line(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    config = tmp_path / "cacheproxy.toml"
    config.write_text("[routing]\noptions = { max_wait_s = -3 }\n")
    started = serve_once(tmp_path / "state", llama_server.url, "--config", str(config))
    assert_refused(started, "bad options for routing plugin 'exact-prefix'", EXIT_BAD_SETTINGS)
    assert "max_wait_s" in started.stderr


def test_check_config_checks_plugin_names_too(tmp_path: Path) -> None:
    started = serve_once(
        tmp_path / "state", None, command="check-config", CACHEPROXY_DISK__EVICTION="nope"
    )
    assert_refused(started, "unknown eviction plugin 'nope'", EXIT_BAD_SETTINGS)
    assert serve_once(tmp_path / "state", None, command="check-config").exit_code == 0


def test_a_bad_setting_is_one_line(llama_server: LlamaServer, tmp_path: Path) -> None:
    started = serve_once(
        tmp_path / "state",
        llama_server.url,
        CACHEPROXY_ROUTING__MAX_QUEUE="-1",
        CACHEPROXY_ROUTING__HEALTH_INTERVAL_S="0",
    )
    assert_refused(started, "routing.max_queue", EXIT_BAD_SETTINGS)
    assert "routing.health_interval_s" in started.stderr


def test_an_upstream_without_slots_is_one_line_naming_the_fix(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=4096, extra_args=("--no-slots",))
    started = serve_once(tmp_path / "state", server.url)
    assert_refused(started, "start llama-server without --no-slots", EXIT_CANNOT_START)


def test_a_port_already_held_is_one_line(llama_server: LlamaServer, tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = serve_once(tmp_path / "state", llama_server.url, port=port)
    assert_refused(started, f"cannot listen on 127.0.0.1:{port}", EXIT_CANNOT_START)


def test_a_managed_server_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-llama-server"
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    started = serve_once(
        tmp_path / "state",
        None,
        "--llama-server",
        str(missing),
        "-m",
        str(model),
        "--backend",
        "llama-server",
        # the start of a managed server is logged at `info`: the refusal alone is asked for
        "--log-level",
        "warning",
        CACHEPROXY_MANAGED__PORT=str(free_port()),
    )
    assert_refused(started, "llama-server could not be started", EXIT_CANNOT_START)
    assert str(missing) in started.stderr


def test_a_managed_socket_another_process_listens_on_is_one_line(
    llama_server_binary: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """`managed.host` a unix socket's path: a file another server listens on is never taken
    from it (llama-server cannot bind over it; removing it would cut that server off)."""
    path = tmp_path / "llama.sock"
    with socket.socket(socket.AF_UNIX) as holder:
        holder.bind(str(path))
        holder.listen()
        started = serve_once(
            tmp_path / "state",
            None,
            "--llama-server",
            str(llama_server_binary),
            "-m",
            str(tiny_model),
            "--log-level",
            "warning",
            CACHEPROXY_MANAGED__HOST=str(path),
        )
        assert path.is_socket()  # still the holder's
    assert_refused(started, f"cannot listen on {path}: another process listens", EXIT_CANNOT_START)
    assert "managed.host" in started.stderr
