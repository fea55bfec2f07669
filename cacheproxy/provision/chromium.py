"""A headless Chromium for the dashboard test: found on the machine, or installed once.

The test renders the admin dashboard in a real browser. Any Chromium-family binary on `PATH`
will do (Debian's `chromium`, `chromium-headless-shell`, Google Chrome), or the one named by
`$CACHEPROXY_CHROMIUM`. Without one, Debian's `chromium` package is installed with apt-get when
running as root (as CI does); otherwise the error says what to install.
`cacheproxy testbed chromium` prints the binary's path.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cacheproxy.provision.apt import found_or_installed

ENV_OVERRIDE = "CACHEPROXY_CHROMIUM"
# in order of preference: Debian's package first, the one the test is run with in CI
BINARY_NAMES = (
    "chromium",
    "chromium-headless-shell",
    "chromium-browser",
    "google-chrome-stable",
    "google-chrome",
)
DEBIAN_PACKAGE = "chromium"


class ChromiumUnavailable(RuntimeError):
    """No Chromium on this machine, and none could be installed."""


def find_chromium(search_path: str | None = None) -> Path | None:
    """The Chromium binary to use: `$CACHEPROXY_CHROMIUM` if set, else the first of
    `BINARY_NAMES` on `search_path` (default: `$PATH`)."""
    explicit = os.environ.get(ENV_OVERRIDE)
    if explicit:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise ChromiumUnavailable(f"${ENV_OVERRIDE}={explicit} is not an executable file")
    for name in BINARY_NAMES:
        found = shutil.which(name, path=search_path)
        if found is not None:
            return Path(found)
    return None


def ensure_chromium() -> Path:
    """Find Chromium, or install Debian's package (as root, with apt-get); the binary's path."""
    return found_or_installed(
        find_chromium,
        DEBIAN_PACKAGE,
        ChromiumUnavailable,
        (
            f"no Chromium found (looked for {', '.join(BINARY_NAMES)} on PATH, or set"
            f" ${ENV_OVERRIDE}); install one, e.g. `sudo apt-get install {DEBIAN_PACKAGE}`"
            " on Debian/Ubuntu, or run `cacheproxy testbed chromium` as root"
        ),
    )


def main() -> None:
    print(ensure_chromium())


if __name__ == "__main__":
    main()
