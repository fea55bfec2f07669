"""A benchmark report's command: what one types to run it again, with the variables of the
environment that change what it measured (llama-server's OpenMP waits, its flags, the
proxy's settings), and none of the others."""

from __future__ import annotations

import os
import shlex

import pytest

from cacheproxy.bench.harness import MEASURED_ENVIRONMENT, invoked_command


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith(MEASURED_ENVIRONMENT):
            monkeypatch.delenv(name)
    monkeypatch.setattr("sys.argv", ["/somewhere/cacheproxy/__main__.py", "bench", "overhead"])
    return monkeypatch


def test_without_such_variables_it_is_the_command_alone(
    clean_environment: pytest.MonkeyPatch,
) -> None:
    clean_environment.setenv("HOME", "/home/someone")
    assert invoked_command() == "python -m cacheproxy bench overhead"


def test_the_variables_that_change_the_figures_come_first(
    clean_environment: pytest.MonkeyPatch,
) -> None:
    clean_environment.setattr(
        "sys.argv", ["cacheproxy", "bench", "overhead", "--server-args", "", "--rounds", "3"]
    )
    clean_environment.setenv("OMP_WAIT_POLICY", "passive")
    clean_environment.setenv("GOMP_SPINCOUNT", "3000")
    clean_environment.setenv("LLAMA_ARG_THREADS", "1")
    clean_environment.setenv("CACHEPROXY_DISK__BLOCKS", "false")
    clean_environment.setenv("LANG", "C.UTF-8")  # changes nothing measured: left out
    # what ggml sets itself wherever it is loaded (this process, once the embedded engine has
    # been): left out; another value is the user's
    clean_environment.setenv("KMP_BLOCKTIME", "200")

    command = invoked_command()

    assert command == (
        "CACHEPROXY_DISK__BLOCKS=false GOMP_SPINCOUNT=3000 LLAMA_ARG_THREADS=1"
        " OMP_WAIT_POLICY=passive cacheproxy bench overhead --server-args '' --rounds 3"
    )
    clean_environment.setenv("KMP_BLOCKTIME", "0")
    assert invoked_command().startswith("CACHEPROXY_DISK__BLOCKS=false GOMP_SPINCOUNT=3000 KMP_")


def test_a_value_a_shell_would_split_is_quoted(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setenv("OMP_PLACES", "{0,1} {2,3}")

    words = shlex.split(invoked_command())

    assert words[0] == "OMP_PLACES={0,1} {2,3}"
    assert words[1:] == ["python", "-m", "cacheproxy", "bench", "overhead"]


def test_keys_and_passwords_are_masked_as_in_the_logs(
    clean_environment: pytest.MonkeyPatch,
) -> None:
    # a report is shared: what the proxy's logs mask, its command line masks too
    clean_environment.setattr(
        "sys.argv", ["cacheproxy", "bench", "overhead", "--server-args", "--api-key sk-s3cret"]
    )
    clean_environment.setenv("CACHEPROXY_ADMIN_API_KEY", "admin-s3cret-key-of-32-characters")
    clean_environment.setenv("CACHEPROXY_DATABASE_URL", "postgresql://cache:pa55word@db/cache")
    clean_environment.setenv("LLAMA_ARG_API_KEY", "sk-s3cret")

    command = invoked_command()

    assert "s3cret" not in command and "pa55word" not in command
    assert shlex.split(command) == [
        "CACHEPROXY_ADMIN_API_KEY=***",
        "CACHEPROXY_DATABASE_URL=postgresql://cache:***@db/cache",
        "LLAMA_ARG_API_KEY=***",
        "cacheproxy",
        "bench",
        "overhead",
        "--server-args",
        "--api-key ***",
    ]
