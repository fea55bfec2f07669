"""Debian packages the test bed needs (Chromium, GlusterFS, PostgreSQL): installed with apt-get
as root, once."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

from cacheproxy.provision.cache import say


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
