"""Two "hosts" for a test: network namespaces sharing one GlusterFS volume (see
`cacheproxy.provision.hosts`), and llama-servers started inside them."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cacheproxy.provision import hosts
from tests.support.servers import LlamaServer, start_llama_server

LLAMA_SERVER_PORT = 8081  # every host has its own network: the same port on each


@contextlib.contextmanager
def two_hosts(root: Path) -> Iterator[hosts.HostsTestbed]:
    """Hosts named after this process, so that test runs side by side never share a name."""
    pid = os.getpid()
    testbed = hosts.plan(root, 2, tag=f"cp{pid % 100000}", subnet=20 + pid % 200)
    with hosts.running(testbed):
        yield testbed


def start_on_host(
    host: hosts.Host, binary: Path, model: Path, workdir: Path, **kwargs: Any
) -> LlamaServer:
    """A llama-server inside `host`'s network, saving into the archive as the host mounts it,
    from a copy of `model` of its own (another path, the same content)."""
    own_model = workdir / host.name / model.name
    own_model.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model, own_model)
    return start_llama_server(
        binary,
        own_model,
        workdir / host.name,
        host=host.address,
        port=LLAMA_SERVER_PORT,
        slot_save_path=host.archive,
        wrap=host.command,
        **kwargs,
    )
