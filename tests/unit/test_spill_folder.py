"""The spill folder: what a killed proxy left is removed at the next start; a running proxy's
subfolder, sharing the folder, is left alone. Real processes, killed for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheproxy.http.spill_folder import BODY_PREFIX, SpillFolder

# a process that takes a subfolder, spills a body into it, says where, and waits
HOLDER = """
import sys
from pathlib import Path
from cacheproxy.http.spill_folder import SpillFolder
folder = SpillFolder.open(Path(sys.argv[1]))
handle, path = folder.new_file()
print(path, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def hold(root: Path, holders: list[subprocess.Popen[str]]) -> Path:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    holders.append(process)
    assert process.stdout is not None
    return Path(process.stdout.readline().strip())


def test_bodies_left_by_a_killed_proxy_go_and_a_running_ones_stay(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    root = tmp_path / "bodies"
    killed_body = hold(root, holders)
    running_body = hold(root, holders)
    holders[0].send_signal(signal.SIGKILL)
    holders[0].wait()
    assert killed_body.exists() and running_body.exists()

    folder = SpillFolder.open(root)
    try:
        assert not killed_body.parent.exists()
        assert running_body.exists()
        assert folder.run.parent == root and folder.run != running_body.parent
    finally:
        folder.close()
    assert not folder.run.exists() and running_body.exists()


def test_a_body_file_is_private_to_the_proxy(tmp_path: Path) -> None:
    folder = SpillFolder.open(tmp_path / "bodies")
    try:
        handle, path = folder.new_file()
        os.close(handle)
        assert Path(path).name.startswith(BODY_PREFIX)
        assert Path(path).stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "bodies").stat().st_mode & 0o777 == 0o700
    finally:
        folder.close()
