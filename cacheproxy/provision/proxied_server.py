"""A stand-in for the `llama-server` binary, for running llama.cpp's own server tests.

llama.cpp's test suite (`tools/server/tests`) starts `$LLAMA_SERVER_BIN_PATH` with llama-server's
flags and talks to the host and port it gave. This program takes that argv and:

- in both arms, points every model the tests ask for (`--hf-repo`, `--hf-file`, `--model`,
  `--model-url`, `--model-draft`) at one local model, since the tests' Hugging Face downloads cannot
  work without a network; a server started without any model and without a models folder or
  preset of its own (router mode over the download cache) gets a preset naming the models the
  router tests ask for (`ROUTER_TEST_MODELS`), each the local model;
- `direct` arm: runs the real llama-server with that argv (the reference);
- `proxy` arm: runs the real llama-server with the same flags on a free loopback port, waits for
  it, and runs `cacheproxy serve` in front of it on the host and port the test asked for, with the
  server's `--api-key` as the proxy's upstream key. One upstream flag is changed because the
  proxy needs it: `--no-slots` becomes `--slots` (the proxy reads `/slots`). A `--slot-save-path`
  becomes the proxy's archive folder; without one the disk tier is off (the proxy's archive
  folder must be the server's).

Configured by the environment (the test suite passes its environment on):
`CACHEPROXY_COMPAT_ARM` (`direct` | `proxy`), `CACHEPROXY_COMPAT_LLAMA_SERVER` (the real binary),
`CACHEPROXY_COMPAT_MODEL` (the local model). Run as `python -m cacheproxy.provision.proxied_server
ARGS...`; both children die with it (SIGTERM is passed on, and PR_SET_PDEATHSIG covers SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable

ARM_VARIABLE = "CACHEPROXY_COMPAT_ARM"
BINARY_VARIABLE = "CACHEPROXY_COMPAT_LLAMA_SERVER"
MODEL_VARIABLE = "CACHEPROXY_COMPAT_MODEL"

# flags that name a model to load, each followed by its value
MODEL_FLAGS = frozenset(
    {"-m", "--model", "-mu", "--model-url", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file"}
)
DRAFT_FLAGS = frozenset({"-md", "--model-draft"})
UPSTREAM_START_TIMEOUT_S = 120.0
# what llama.cpp's router tests (unit/test_router.py) load from the Hugging Face cache, by name
ROUTER_TEST_MODELS = (
    "ggml-org/tinygemma3-GGUF:Q8_0",
    "ggml-org/test-model-stories260K:F32",
    "ggml-org/test-model-stories260K-infill:F32",
)
ROUTER_SOURCE_FLAGS = frozenset({"--models-dir", "--models-preset"})


def redirect_models(argv: list[str], model: str) -> list[str]:
    """Replace every model source in `argv` by `model`; leave an argv without one unchanged."""
    out: list[str] = []
    had_model = False
    index = 0
    while index < len(argv):
        flag = argv[index]
        if flag in MODEL_FLAGS and index + 1 < len(argv):
            had_model = True
            index += 2
            continue
        if flag in DRAFT_FLAGS and index + 1 < len(argv):
            out += [flag, model]
            index += 2
            continue
        out.append(flag)
        index += 1
    return [*out, "--model", model] if had_model else out


def with_local_router_models(argv: list[str], model: str, folder: str) -> list[str]:
    """A router over the download cache (no model, no models folder or preset) gets a preset
    in `folder` naming `ROUTER_TEST_MODELS`, each `model`; any other argv is left as it is."""
    if any(flag in MODEL_FLAGS or flag.split("=")[0] in ROUTER_SOURCE_FLAGS for flag in argv):
        return argv
    preset = os.path.join(folder, "router-test-models.ini")
    with open(preset, "w") as ini:
        ini.write("version = 1\n\n")
        for name in ROUTER_TEST_MODELS:
            ini.write(f"[{name}]\nmodel = {model}\n\n")
    return [*argv, "--models-preset", preset]


def flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last occurrence of any of `names` (`--flag value` or `--flag=value`)."""
    found = None
    for index, item in enumerate(argv):
        for name in names:
            if item == name and index + 1 < len(argv):
                found = argv[index + 1]
            elif item.startswith(name + "="):
                found = item.split("=", 1)[1]
    return found


def replace_flag(argv: list[str], names: tuple[str, ...], value: str) -> list[str]:
    """`argv` without any of `names` (and their values), then `names[0] value`."""
    out: list[str] = []
    index = 0
    while index < len(argv):
        item = argv[index]
        if item in names:
            index += 2
            continue
        if any(item.startswith(name + "=") for name in names):
            index += 1
            continue
        out.append(item)
        index += 1
    return [*out, names[0], value]


def upstream_argv(argv: list[str], port: int) -> list[str]:
    """The real server's flags in the proxy arm: loopback, its own port, `/slots` on."""
    out = replace_flag(argv, ("--host",), "127.0.0.1")
    out = replace_flag(out, ("--port",), str(port))
    return ["--slots" if item == "--no-slots" else item for item in out]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """Before exec: SIGTERM this process when its parent dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)


def wait_healthy(
    url: str, api_key: str | None, alive: Callable[[], bool], timeout_s: float
) -> bool:
    """Poll `url` until it answers 200; False when the process died or time ran out."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    return False


def _stop(process: subprocess.Popen, grace_s: float = 2.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _stop_all(processes: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_proxied(binary: str, argv: list[str]) -> int:
    """llama-server on a free port, cacheproxy in front of it where the test expects the server."""
    host = flag_value(argv, "--host") or os.environ.get("LLAMA_ARG_HOST") or "127.0.0.1"
    port = flag_value(argv, "--port") or os.environ.get("LLAMA_ARG_PORT") or "8080"
    api_key = flag_value(argv, "--api-key")
    slot_save_path = flag_value(argv, "--slot-save-path")
    upstream_port = free_port()
    upstream_env = dict(os.environ)
    if "AIP_HTTP_PORT" in upstream_env:  # Vertex AI mode takes its port from here
        upstream_env["AIP_HTTP_PORT"] = str(upstream_port)
    upstream = _start([binary, *upstream_argv(argv, upstream_port)], upstream_env)
    children = [upstream]

    def on_term(signum: int, _frame: object) -> None:
        # both at once, as when both services are stopped: the proxy finishes its requests
        # before it exits, and those end as soon as the server stops
        _stop_all(children)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    alive = lambda: upstream.poll() is None  # noqa: E731
    if not wait_healthy(upstream_url + "/health", api_key, alive, UPSTREAM_START_TIMEOUT_S):
        _stop(upstream)
        return upstream.returncode or 1
    state_dir = tempfile.mkdtemp(prefix="cacheproxy-compat-")
    proxy_env = {**os.environ, "CACHEPROXY_STATE_DIR": state_dir}
    if slot_save_path:
        proxy_env["CACHEPROXY_DISK__DIRECTORY"] = os.path.abspath(slot_save_path)
    else:
        proxy_env["CACHEPROXY_DISK__ENABLED"] = "false"
    proxy_argv = [sys.executable, "-m", "cacheproxy", "serve", "--host", host, "--port", port]
    proxy_argv += ["--upstream", upstream_url]
    if api_key:
        proxy_argv += ["--upstream-api-key", api_key]
    proxy = _start(proxy_argv, proxy_env)
    children.append(proxy)
    # whichever ends first ends the other: the test sees a dead server either way
    while upstream.poll() is None and proxy.poll() is None:
        time.sleep(0.1)
    code = proxy.returncode if proxy.returncode is not None else upstream.returncode
    _stop_all(children)
    return code or 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    binary = os.environ[BINARY_VARIABLE]
    model = os.environ.get(MODEL_VARIABLE)
    if model:
        args = redirect_models(args, model)
        args = with_local_router_models(args, model, tempfile.mkdtemp(prefix="router-models-"))
    if os.environ.get(ARM_VARIABLE, "direct") == "proxy":
        return run_proxied(binary, args)
    _die_with_parent()  # kept across exec: the server ends with the test run that started it
    os.execv(binary, [binary, *args])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
