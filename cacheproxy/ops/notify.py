"""A dependency-free sd_notify client: tells systemd (Type=notify) when the service is ready,
alive, reloading or stopping.

The protocol is one datagram of newline-separated `KEY=value` lines sent to the AF_UNIX socket
named by `$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without that variable
the service is not run by systemd and every call is a no-op, so callers never need to check.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

# A blocked send can only mean systemd is not reading; never stall the event loop for long on it.
SEND_TIMEOUT_S = 1.0


class SystemdNotifier:
    """sd_notify for one process, configured from an environment mapping (passed in, so tests and
    callers decide where it comes from; nothing is read at import time)."""

    def __init__(self, environ: Mapping[str, str], pid: int | None = None) -> None:
        self._environ = environ
        self._pid = os.getpid() if pid is None else pid
        self._address = socket_address(environ.get("NOTIFY_SOCKET", ""))

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send `fields` (each `KEY=value`) as one datagram; False when not sent."""
        if self._address is None or not fields:
            return False
        message = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(message, self._address)
        except OSError as exc:
            # systemd going away must not take the service down with it
            log.warning("sd_notify %r failed: %s", fields[0], exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *_status(status))

    def status(self, text: str) -> bool:
        return self.notify(*_status(text))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def reloading(self, status: str | None = None) -> bool:
        # Type=notify-reload (systemd 253+) wants the monotonic time with RELOADING=1; older
        # versions ignore the extra field. Send ready() when the reload is done.
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}", *_status(status))

    def watchdog_interval(self) -> float | None:
        """The watchdog timeout in seconds (`WatchdogSec=`), or None when there is none for this
        process: unset, malformed, zero, or meant for another PID (`WATCHDOG_PID`)."""
        try:
            usec = int(self._environ.get("WATCHDOG_USEC", ""))
        except ValueError:
            return None
        if usec <= 0:
            return None
        watchdog_pid = self._environ.get("WATCHDOG_PID")
        if watchdog_pid is not None:
            try:
                if int(watchdog_pid) != self._pid:
                    return None  # inherited from a parent that systemd is watching instead
            except ValueError:
                return None
        return usec / 1_000_000

    def watchdog_ping_interval(self) -> float | None:
        """How often to send WATCHDOG=1: half the timeout, as sd_watchdog_enabled(3) advises, so
        one late ping does not trip it."""
        interval = self.watchdog_interval()
        return None if interval is None else interval / 2


def socket_address(notify_socket: str) -> str | bytes | None:
    """The `sendto` address for a `$NOTIFY_SOCKET` value, None when unset or unusable."""
    if notify_socket.startswith("/"):
        return notify_socket
    if notify_socket.startswith("@") and len(notify_socket) > 1:
        # abstract namespace: the leading '@' stands for a NUL byte
        return b"\0" + notify_socket[1:].encode()
    if notify_socket:
        # e.g. systemd 254's vsock: addresses, which only matter inside VMs
        log.warning("NOTIFY_SOCKET=%r is not a path or @name; not notifying", notify_socket)
    return None


def _status(text: str | None) -> tuple[str, ...]:
    # one line only: a newline would start a new field in the datagram
    return () if text is None else ("STATUS=" + " ".join(text.splitlines()),)
