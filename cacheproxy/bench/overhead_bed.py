"""The overhead benchmark's test bed: one llama-server, and in front of it the bare aiohttp
pass-through, `cacheproxy serve` with every feature on, the same with its stages timed, and
(with `--calibrate-us`) the pass-through burning CPU; `bring_up` starts them all. With
`--upstream-tls` the server is served over https (bench/tls_bed.py), and every arm reaches it
there."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import sys
from pathlib import Path

import aiohttp

from cacheproxy.bench.harness import (
    HOST,
    ProcessSet,
    create_tenant,
    progress,
    proxy_command,
    wait_healthy,
)
from cacheproxy.bench.overhead_report import Arm, TestBed
from cacheproxy.bench.tls_bed import TlsFiles
from cacheproxy.provision.build_server import ensure_llama_server
from cacheproxy.provision.make_model import ensure_model
from cacheproxy.upstreams.managed import free_port, llama_server_args

# Every limit on, far above what any run reaches: the proxy meters each request, refuses none.
PROXY_LIMITS = {
    "CACHEPROXY_LIMITS__REQUESTS_PER_MINUTE": str(10**9),
    "CACHEPROXY_LIMITS__PROMPT_TOKENS_PER_MINUTE": str(10**12),
    "CACHEPROXY_LIMITS__GENERATED_TOKENS_PER_MINUTE": str(10**12),
    "CACHEPROXY_LIMITS__TOKENS_PER_DAY": str(10**14),
    "CACHEPROXY_LIMITS__TOKENS_PER_MONTH": str(10**15),
}
LLAMA_SERVER_OPTIONS = {"parallel": 4, "ctx_size": 16384, "cache_ram_mib": 0}
REGISTRY_FILE = "cacheproxy.db"  # in the state folder, where create_tenant writes the tenant


def start_llama_server(
    processes: ProcessSet,
    extra_args: tuple[str, ...] = (),
    chat_tokens: bool = False,
    tls: TlsFiles | None = None,
) -> tuple[str, list[str], Path]:
    """Start llama-server (with `extra_args` too; `chat_tokens`: the model whose vocabulary
    holds the chat template's markers as control tokens; `tls`: over https, with that
    certificate); return its base URL, its command line and the model it serves."""
    progress("locating llama-server (a build in progress is waited for, never started twice)")
    binary = ensure_llama_server()
    model = ensure_model("small", chat_tokens=chat_tokens)
    port = free_port(HOST)
    slot_save_path = processes.workdir / "slots"  # the proxy's archive folder too
    slot_save_path.mkdir()
    args = llama_server_args(
        binary,
        model,
        host=HOST,
        port=port,
        slot_save_path=slot_save_path,
        extra_args=(*extra_args, *(tls.server_flags() if tls else ())),
        **LLAMA_SERVER_OPTIONS,
    )
    progress(f"starting llama-server: {shlex.join(args)}")
    processes.start("llama-server", args)
    return f"{'https' if tls else 'http'}://{HOST}:{port}", args, model


def start_front_processes(
    processes: ProcessSet, upstream: str, calibrate_us: float = 0.0, tls: TlsFiles | None = None
) -> dict[str, str]:
    """Start the bare pass-through and the proxy in front of `upstream` (with `calibrate_us`,
    the calibration arm too: the bare pass-through burning that much CPU a request; `tls`: the
    upstream's CA, which they check it against); return their base URLs."""
    bare_port, proxy_port = free_port(HOST), free_port(HOST)
    processes.start("bare", passthrough_command(upstream, bare_port, tls=tls))
    processes.start("proxy", proxy_command(upstream, proxy_port), env=proxy_env(processes, tls))
    urls = {"bare": f"http://{HOST}:{bare_port}", "proxy": f"http://{HOST}:{proxy_port}"}
    if calibrate_us > 0:
        port = free_port(HOST)
        processes.start("calibrated", passthrough_command(upstream, port, calibrate_us, tls))
        urls["calibrated"] = f"http://{HOST}:{port}"
    return urls


def passthrough_command(
    upstream: str, port: int, burn_us: float = 0.0, tls: TlsFiles | None = None
) -> list[str]:
    module = [sys.executable, "-m", "cacheproxy.bench.passthrough"]
    burning = ["--burn-us", f"{burn_us:g}"] if burn_us > 0 else []
    trusting = ["--ca-file", str(tls.ca)] if tls else []
    return [*module, "--upstream", upstream, "--port", str(port), *burning, *trusting]


def proxy_env(processes: ProcessSet, tls: TlsFiles | None = None) -> dict[str, str]:
    # Its own state folder, so a run never touches the user's cacheproxy state.
    return {
        **os.environ,
        "CACHEPROXY_STATE_DIR": str(processes.workdir / "proxy-state"),
        "CACHEPROXY_DISK__DIRECTORY": str(processes.workdir / "slots"),
        **PROXY_LIMITS,
        **({"CACHEPROXY_UPSTREAM_CA_FILE": str(tls.ca)} if tls else {}),
    }


def start_timed_proxy(
    processes: ProcessSet, upstream: str, admin_key: str, tls: TlsFiles | None = None
) -> str:
    """The proxy again, its stages timed (started once the first is up: two proxies probing
    the same server's idle slots at once would erase each other's probes); its base URL.
    A registry of its own holding the same tenant and key, an archive folder of its own (the
    two index files would not know of each other's files)."""
    timed_port = free_port(HOST)
    timed_state = processes.workdir / "timed-state"
    timed_state.mkdir()
    for registry_file in (processes.workdir / "proxy-state").glob(REGISTRY_FILE + "*"):
        shutil.copy(registry_file, timed_state / registry_file.name)  # with its WAL, if any
    timed_env = {
        **proxy_env(processes, tls),
        "CACHEPROXY_STATE_DIR": str(timed_state),
        "CACHEPROXY_DISK__DIRECTORY": str(processes.workdir / "slots" / "timed"),
        "CACHEPROXY_TRACING__STAGE_CLOCK": "true",
        "CACHEPROXY_TENANTS__ADMIN_API_KEY": admin_key,  # its /metrics, once tenants exist
    }
    (processes.workdir / "slots" / "timed").mkdir()
    processes.start("timed", proxy_command(upstream, timed_port), env=timed_env)
    return f"http://{HOST}:{timed_port}"


async def bring_up(
    processes: ProcessSet,
    session: aiohttp.ClientSession,
    server_args: tuple[str, ...] = (),
    chat_tokens: bool = False,
    calibrate_us: float = 0.0,
    tls: TlsFiles | None = None,
) -> TestBed:
    """Every process of the test bed started and healthy (`tls`: the server over https, its
    certificate issued by that CA, which `session` trusts)."""
    direct_url, llama_server_command, model = start_llama_server(
        processes, server_args, chat_tokens, tls
    )
    await wait_healthy(session, processes.find("llama-server"), direct_url)
    progress(f"llama-server healthy at {direct_url}; starting the bare pass-through and the proxy")
    api_key = create_tenant(processes.workdir / "proxy-state")
    admin_key = "bench-admin-" + os.urandom(8).hex()
    front_urls = start_front_processes(processes, direct_url, calibrate_us, tls)
    await asyncio.gather(
        *(wait_healthy(session, processes.find(name), url) for name, url in front_urls.items())
    )
    timed_url = start_timed_proxy(processes, direct_url, admin_key, tls)
    await wait_healthy(session, processes.find("timed"), timed_url)
    arms = (
        Arm("direct", direct_url),
        Arm("bare", front_urls["bare"]),
        Arm("proxy", front_urls["proxy"]),
    )
    session.headers["Authorization"] = f"Bearer {api_key}"  # every arm: the proxy needs it
    timed = Arm("timed", timed_url)
    calibrated = front_urls.get("calibrated")
    return TestBed(
        arms,
        shlex.join(llama_server_command),
        model.name,
        timed,
        admin_key,
        None if calibrated is None else Arm("calibrated", calibrated),
    )
