"""A throwaway PostgreSQL server for tests and benchmarks (Debian's `postgresql` package).

`PostgresServer` runs `initdb` into a temporary folder and starts `postgres` on 127.0.0.1 on a
free port, its unix socket in that folder, with durability off (fsync, synchronous commit: a
test database is thrown away). PostgreSQL refuses to run as root, so under root the server runs
as the `postgres` user the Debian package creates (or `nobody`), owning the folder. `stop()`
stops it and deletes the folder. `ensure_postgres()` finds the binaries, installing the package
with apt-get as root when they are missing (`cacheproxy testbed postgres install`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from cacheproxy.provision.apt import apt_install
from cacheproxy.provision.cache import locked

DEBIAN_PACKAGE = "postgresql"
BIN_GLOB = "/usr/lib/postgresql/*/bin"
START_TIMEOUT_S = 60.0
SUPERUSER = "cacheproxy"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be run here (not installed and not installable)."""


def postgres_bin_dir() -> Path | None:
    """The newest installed server's binaries (Debian keeps them off PATH), or None."""
    found = sorted(
        Path(path).parent for path in glob.glob(BIN_GLOB + "/postgres") if os.access(path, os.X_OK)
    )
    if found:
        return max(found, key=lambda path: int(path.parent.name.split(".")[0]))
    on_path = shutil.which("postgres")
    return Path(on_path).parent if on_path else None


def ensure_postgres() -> Path:
    """The server binaries' folder, installing Debian's package (as root) if there is none."""
    with locked("postgresql"):
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            _install_with_apt()
            bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise PostgresUnavailable(f"{DEBIAN_PACKAGE} installed, but no postgres binary found")
        return bin_dir


class PostgresServer:
    """A running throwaway server; `url` connects as its superuser to database `postgres`."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        self.bin_dir = bin_dir or ensure_postgres()
        self.root = Path(tempfile.mkdtemp(prefix="cacheproxy-pg-"))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._user = _server_user()

    @property
    def url(self) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/postgres"

    def start(self) -> PostgresServer:
        data, log = self.root / "data", self.root / "server.log"
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self._run(
            [
                str(self.bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                SUPERUSER,
                "--auth=trust",  # loopback and a private socket folder only
                "-E",
                "UTF8",
                "--no-sync",
            ]
        )
        self.port = _free_port()
        with open(log, "ab") as log_file:
            self.process = subprocess.Popen(
                [
                    str(self.bin_dir / "postgres"),
                    "-D",
                    str(data),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.root),
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=200",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                **self._as_user(),
            )
        self._wait_ready(log)
        return self

    def new_database(self) -> str:
        """A fresh empty database on this server, as a URL."""
        name = "db_" + secrets.token_hex(6)
        with psycopg.connect(self.url, autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + "/" + name

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            # SIGINT: "fast" shutdown, which ends open sessions ("smart", SIGTERM, would wait
            # for every client to leave)
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise PostgresUnavailable(f"postgres exited at start:\n{log.read_text()[-2000:]}")
            with contextlib.suppress(psycopg.OperationalError):
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            if time.monotonic() > deadline:
                raise PostgresUnavailable(f"postgres did not accept connections:\n{log}")
            time.sleep(0.1)

    def _run(self, command: list[str]) -> None:
        result = subprocess.run(command, capture_output=True, text=True, **self._as_user())
        if result.returncode != 0:
            raise PostgresUnavailable(f"{command[0]} failed: {result.stderr.strip()[-2000:]}")

    def _as_user(self) -> dict[str, object]:
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}


def _server_user() -> pwd.struct_passwd | None:
    """Who runs the server: this user, unless root (postgres refuses to run as root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PostgresUnavailable("running as root and no `postgres` or `nobody` user to run as")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _install_with_apt() -> None:
    apt_install(
        DEBIAN_PACKAGE,
        PostgresUnavailable,
        f"PostgreSQL is not installed: `sudo apt-get install {DEBIAN_PACKAGE}` (Debian/Ubuntu)",
    )


def main(action: str) -> int:
    """`cacheproxy testbed postgres install|check`."""
    bin_dir = ensure_postgres()
    if action == "check":
        with PostgresServer(bin_dir) as server:
            print(f"PostgreSQL from {bin_dir} ran at {server.url}")
    else:
        print(bin_dir)
    return 0
