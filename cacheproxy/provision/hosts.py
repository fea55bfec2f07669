"""Several "hosts" on one machine for the test bed: network namespaces and one GlusterFS volume.

Each host is a network namespace joined to a bridge in the root namespace by a veth pair, with
an address of its own (`10.77.N.11`, `.12`, ...; the bridge, where the proxy runs, is `.1`).
A process started through `Host.command` sees only its host's network, as a process on another
machine would, and reaches the others (and the proxy) over the bridge.

The shared archive folder is a real distributed file system: a single-brick GlusterFS volume
served by the root namespace's glusterd on the bridge address, and mounted once per host by a
FUSE client that runs inside that host's namespace (its traffic crosses the veth like a remote
client's), plus once for the proxy. Every mount is a separate client with its own caches, so a
file one host's llama-server writes reaches the others through GlusterFS, not through a shared
page cache. Mounts are made in the root mount namespace, so they outlive the command that made
them. Needs root and Debian's `glusterfs-server` (installed with apt-get when missing, as root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cacheproxy.provision.apt import apt_install
from cacheproxy.provision.cache import cache_root, locked, say

DEBIAN_PACKAGE = "glusterfs-server"
NETNS_DIR = Path("/run/netns")
GLUSTERD_START_TIMEOUT_S = 30.0


class HostsUnavailable(RuntimeError):
    """The hosts test bed cannot run here (not root, no GlusterFS, no network namespaces)."""


@dataclass(frozen=True)
class Host:
    """One "host": a network namespace with an address and its own mount of the archive."""

    name: str  # the network namespace
    address: str
    archive: Path  # the shared archive folder as this host sees it

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's network (the mounts stay the machine's)."""
        return ["nsenter", f"--net={NETNS_DIR / self.name}", "--", *argv]


@dataclass(frozen=True)
class HostsTestbed:
    tag: str  # names every interface, namespace and the volume, so test beds never collide
    subnet: int  # the third octet of 10.77.N.0/24
    root: Path  # the brick and every mount point live under it
    hosts: tuple[Host, ...]
    proxy_archive: Path  # the shared archive folder as the proxy (root namespace) sees it

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def bridge_address(self) -> str:
        return f"10.77.{self.subnet}.1"

    @property
    def volume(self) -> str:
        return f"{self.tag}-archive"

    @property
    def brick(self) -> Path:
        return self.root / "brick"


def plan(root: Path, count: int = 2, tag: str = "cph", subnet: int = 0) -> HostsTestbed:
    """The test bed's names and addresses, nothing created yet."""
    if not 1 <= count <= 200 or not 0 <= subnet <= 255:
        raise ValueError("between 1 and 200 hosts, on 10.77.0-255.x")
    if len(tag) > 8 or not tag.isalnum():
        raise ValueError("the tag names interfaces: at most 8 letters or digits")
    hosts = tuple(
        Host(f"{tag}h{i}", f"10.77.{subnet}.{10 + i}", root / f"host{i}" / "archive")
        for i in range(1, count + 1)
    )
    return HostsTestbed(tag, subnet, root, hosts, root / "proxy" / "archive")


def up(testbed: HostsTestbed) -> HostsTestbed:
    """Create the bridge, the hosts, the volume and every mount; undone by `down`, also when
    a step fails half-way."""
    if os.geteuid() != 0:
        raise HostsUnavailable("the hosts test bed needs root (network namespaces, mounts)")
    ensure_glusterfs()
    try:
        _network_up(testbed)
        _volume_up(testbed)
        for host in testbed.hosts:
            _mount(testbed, host.archive, host)
        _mount(testbed, testbed.proxy_archive, None)
    except BaseException:
        down(testbed)
        raise
    return testbed


def down(testbed: HostsTestbed) -> None:
    """Undo `up`, whatever of it was done: mounts, volume, brick, namespaces, bridge."""
    for mount_point in (testbed.proxy_archive, *(host.archive for host in testbed.hosts)):
        # lazy: a llama-server still holding a file open must not keep the mount
        _run(["umount", "-l", str(mount_point)], check=False)
    gluster = ["gluster", "--mode=script"]
    _run([*gluster, "volume", "stop", testbed.volume, "force"], check=False)
    _run([*gluster, "volume", "delete", testbed.volume], check=False)
    shutil.rmtree(testbed.brick, ignore_errors=True)
    for host in testbed.hosts:
        _run(["ip", "netns", "delete", host.name], check=False)  # takes its veth end along
        _run(["ip", "link", "delete", f"{host.name}r"], check=False)
    _run(["ip", "link", "delete", testbed.bridge], check=False)


@contextlib.contextmanager
def running(testbed: HostsTestbed) -> Iterator[HostsTestbed]:
    up(testbed)
    try:
        yield testbed
    finally:
        down(testbed)


def _network_up(testbed: HostsTestbed) -> None:
    bridge = testbed.bridge
    _run(["ip", "link", "add", bridge, "type", "bridge"])
    _run(["ip", "addr", "add", f"{testbed.bridge_address}/24", "dev", bridge])
    _run(["ip", "link", "set", bridge, "up"])
    for host in testbed.hosts:
        outside, inside = f"{host.name}r", f"{host.name}n"
        _run(["ip", "netns", "add", host.name])
        _run(["ip", "link", "add", outside, "type", "veth", "peer", "name", inside])
        _run(["ip", "link", "set", inside, "netns", host.name])
        _run(["ip", "link", "set", outside, "master", bridge, "up"])
        _run(["ip", "-n", host.name, "addr", "add", f"{host.address}/24", "dev", inside])
        _run(["ip", "-n", host.name, "link", "set", inside, "up"])
        _run(["ip", "-n", host.name, "link", "set", "lo", "up"])


def _volume_up(testbed: HostsTestbed) -> None:
    testbed.brick.parent.mkdir(parents=True, exist_ok=True)
    gluster = ["gluster", "--mode=script"]
    # one brick inside the test bed's folder: glusterd wants `force` for a brick on the root
    # file system; the brick's host is the bridge address, which every host's client reaches
    brick = f"{testbed.bridge_address}:{testbed.brick}"
    _run([*gluster, "volume", "create", testbed.volume, brick, "force"])
    _run([*gluster, "volume", "start", testbed.volume])


def _mount(testbed: HostsTestbed, mount_point: Path, host: Host | None) -> None:
    mount_point.mkdir(parents=True, exist_ok=True)
    # the FUSE client is started by the mount helper, so in the host's network when run there
    argv = ["mount", "-t", "glusterfs", f"{testbed.bridge_address}:/{testbed.volume}"]
    argv.append(str(mount_point))
    _run(host.command(argv) if host else argv)
    if host is None:
        # the folder llama-servers save into: writable by whoever runs them
        mount_point.chmod(0o777)


def ensure_glusterfs() -> None:
    """glusterd installed (Debian's package, with apt-get as root) and running."""
    with locked("glusterfs"):
        if shutil.which("glusterd") is None:
            _install_with_apt()
        if _run(["gluster", "--mode=script", "volume", "list"], check=False).returncode != 0:
            say("starting glusterd")
            _run(["glusterd"])  # daemonizes
            deadline = time.monotonic() + GLUSTERD_START_TIMEOUT_S
            while _run(["gluster", "--mode=script", "volume", "list"], check=False).returncode:
                if time.monotonic() > deadline:
                    raise HostsUnavailable("glusterd did not answer after starting")
                time.sleep(0.2)


def _install_with_apt() -> None:
    apt_install(
        DEBIAN_PACKAGE,
        HostsUnavailable,
        f"GlusterFS is not installed: `sudo apt-get install {DEBIAN_PACKAGE}` (Debian/Ubuntu)",
    )


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def main(action: str, root: Path | None, count: int, tag: str, subnet: int) -> int:
    """`cacheproxy testbed hosts up|down|install`: `down` takes the arguments `up` was given."""
    try:
        if action == "install":
            ensure_glusterfs()
            return 0
        testbed = plan(root or cache_root() / "hosts", count, tag, subnet)
        if action == "down":
            down(testbed)
            return 0
        up(testbed)
    except (HostsUnavailable, ValueError) as exc:
        print(f"cacheproxy testbed hosts: {exc}", file=sys.stderr)
        return 1
    print(f"proxy (root namespace) at {testbed.bridge_address}, archive {testbed.proxy_archive}")
    for host in testbed.hosts:
        run = " ".join(host.command(["CMD"]))
        print(f"{host.name}: {host.address}, archive {host.archive}, run there: {run}")
    return 0
