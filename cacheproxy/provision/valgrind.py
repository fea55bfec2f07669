"""Valgrind for `cacheproxy bench instructions`: found on the machine, or installed once.

The benchmark counts the instructions a front process executes per request under callgrind
(`valgrind --tool=callgrind`, driven by `callgrind_control`, both in Debian's `valgrind`
package). Without them, the package is installed with apt-get when running as root (as CI
does); otherwise the error says what to install. `cacheproxy testbed valgrind` prints the path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from cacheproxy.provision.apt import found_or_installed

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
    return found_or_installed(
        find_valgrind,
        DEBIAN_PACKAGE,
        ValgrindUnavailable,
        f"no {' and '.join(TOOLS)} on PATH; install them, e.g. `sudo apt-get install"
        f" {DEBIAN_PACKAGE}` on Debian/Ubuntu, or run `cacheproxy testbed valgrind` as root",
    )
