"""Upstreams served over https: llama-server started with `--ssl-key-file` and
`--ssl-cert-file` (built with OpenSSL), whose certificate is checked against `upstream_ca_file`
when set (a private CA, a self-signed certificate), else against the system's bundle (and
`SSL_CERT_FILE`, which OpenSSL reads). Both clients check it with this one context: the
pooled HTTP/1 client (upstreams/connection_pool.py), which carries the requests and the
proxy's own calls to the server, and aiohttp's session, which carries the rest (HEAD, the
metrics scrape, a model listing)."""

from __future__ import annotations

import ssl
from pathlib import Path


class UnusableCaFile(ValueError):
    """`upstream_ca_file` holds no CA certificate OpenSSL can load."""


def upstream_ssl_context(ca_file: Path | None) -> ssl.SSLContext:
    """The context the https upstreams are checked with: against `ca_file`, or (None) the
    system's bundle, as aiohttp's default context (blocking: it reads the files, so off the
    event loop)."""
    try:
        context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    except (ssl.SSLError, OSError) as exc:
        raise UnusableCaFile(
            f"upstream_ca_file {ca_file} holds no CA certificate ({exc}): give a PEM file of"
            " the certificate authority (or the self-signed certificate) the upstreams use"
        ) from exc
    context.set_alpn_protocols(["http/1.1"])  # what both clients speak, as aiohttp's own says
    return context
