"""Upstreams on a unix socket: llama-server started with `--host /path/server.sock` (a path
ending in .sock binds an AF_UNIX socket, tools/server/server-http.cpp), known to the proxy as
`unix:///path/server.sock`, the address llama-server prints when it listens there.

HTTP clients want a host in a URL, so such an upstream is reached at a host name that spells
the socket's path (hex, in labels under `.unix.invalid`, a name that never resolves): every URL
built for it carries its path, and the two clients of the upstreams (the pooled HTTP/1 client,
and aiohttp's connector) open a unix connection to the path read back from the host name. No
table of sockets is kept or passed around: whoever makes an `Upstream` of that URL reaches it.
A socket path has at most 107 bytes (`sun_path`, checked in settings.py), so the name stays
within a host name's 253.
"""

from __future__ import annotations

import os

from cacheproxy.settings import UNIX_SCHEME, is_unix_url

_DOMAIN = ".unix.invalid"
_LABEL_CHARS = 62  # hex digits a label of the host name holds (63 at most, kept even)


def transport_base(base_url: str) -> str:
    """Where the HTTP clients send an upstream's requests: its own URL, or for a unix socket
    `http://` and the host name that spells its path."""
    if not is_unix_url(base_url):
        return base_url
    spelt = os.fsencode(base_url[len(UNIX_SCHEME) :]).hex()
    labels = [spelt[i : i + _LABEL_CHARS] for i in range(0, len(spelt), _LABEL_CHARS)]
    return "http://" + ".".join(labels) + _DOMAIN


def socket_path(host: str | None) -> str | None:
    """The socket path a host name of `transport_base` spells; None for any other host."""
    if host is None or not host.endswith(_DOMAIN):
        return None
    try:
        return os.fsdecode(bytes.fromhex(host[: -len(_DOMAIN)].replace(".", "")))
    except ValueError:
        return None
