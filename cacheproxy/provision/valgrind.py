"""Valgrind for `cacheproxy bench instructions`: found on the machine, or installed once.

The benchmark counts the instructions a front process executes per request under callgrind
(`valgrind --tool=callgrind`, driven by `callgrind_control`, both in Debian's `valgrind`
package). Without them, the package is installed with apt-get when running as root (as CI
does); otherwise the error says what to install. `cacheproxy testbed valgrind` prints the path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from cacheproxy.provision.apt import apt_install
from cacheproxy.provision.cache import locked

DEBIAN_PACKAGE = "valgrind"
TOOLS = ("valgrind", "callgrind_control")


class ValgrindUnavailable(RuntimeError):
    """No valgrind on this machine, and none could be installed."""


def find_valgrind() -> Path | None:
    """valgrind's path, where `callgrind_control` is on PATH beside it; else None."""
    found = [shutil.which(tool) for tool in TOOLS]
    return None if None in found else Path(str(found[0]))


def ensure_valgrind() -> Path:
    """Find valgrind, or install Debian's package (as root, with apt-get); valgrind's path."""
    found = find_valgrind()
    if found is not None:
        return found
    with locked("valgrind"):
        found = find_valgrind()  # another process may have installed it meanwhile
        if found is None:
            apt_install(
                DEBIAN_PACKAGE,
                ValgrindUnavailable,
                f"no {' and '.join(TOOLS)} on PATH; install them, e.g. `sudo apt-get install"
                f" {DEBIAN_PACKAGE}` on Debian/Ubuntu, or run `cacheproxy testbed valgrind`"
                " as root",
            )
            found = find_valgrind()
    if found is None:
        raise ValgrindUnavailable(f"apt-get installed {DEBIAN_PACKAGE} but {TOOLS} are not on PATH")
    return found
