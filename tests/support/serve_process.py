"""`cacheproxy serve` as a process of its own, its log (stderr) kept in a file for the test."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cacheproxy.upstreams.managed import free_port
from tests.support.servers import wait_for_health


@dataclass
class ServeProcess:
    process: asyncio.subprocess.Process
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


async def start_serve(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None
) -> ServeProcess:
    """Start `python -m cacheproxy serve --port FREE FLAGS...` and wait for /health."""
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    environment = {**os.environ, "CACHEPROXY_STATE_DIR": str(tmp_path / "state"), **(env or {})}
    with open(log_path, "wb") as log_file:  # noqa: ASYNC230 - opening a log is instant
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "cacheproxy", "serve", "--port", str(port), *flags),
            env=environment,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
        )
    served = ServeProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        await asyncio.to_thread(wait_for_health, served.url)
    except BaseException:
        await served.stop()
        raise
    return served
