"""Debian packages the test bed needs (Chromium, GlusterFS, PostgreSQL, valgrind): installed with
apt-get as root, once."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from cacheproxy.provision.cache import locked, say


def apt_install(package: str, unavailable: Callable[[str], Exception], not_root: str) -> None:
    """Install `package` with its recommends; raise `unavailable(not_root)` where apt-get cannot
    run (not Debian, not root), and `unavailable(what failed)` when it fails."""
    apt_get = shutil.which("apt-get")
    if apt_get is None or os.geteuid() != 0:
        raise unavailable(not_root)
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    say(f"installing Debian's {package} with apt-get (once)")
    for command in ([apt_get, "update", "-qq"], [apt_get, "install", "-y", "-qq", package]):
        result = subprocess.run(command, env=environment, capture_output=True, text=True)
        if result.returncode != 0:
            raise unavailable(
                f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}"
            )


def found_or_installed(
    find: Callable[[], Path | None],
    package: str,
    unavailable: Callable[[str], Exception],
    not_root: str,
) -> Path:
    """What `find` finds, or else what it finds once Debian's `package` is installed (under a
    lock: processes that find it missing at once install it once); raises `unavailable` as
    `apt_install` does, or when the package is installed and still nothing is found."""
    found = find()
    if found is not None:
        return found
    with locked(package):
        found = find()  # another process may have installed it meanwhile
        if found is None:
            apt_install(package, unavailable, not_root)
            found = find()
    if found is None:
        raise unavailable(f"apt-get installed {package}, but it is still not found")
    return found
