"""Upstreams served over https: llama-server started with `--ssl-key-file` and
`--ssl-cert-file` (built with OpenSSL), whose certificate is checked against `upstream_ca_file`
when set (a private CA, a self-signed certificate), else against the system's bundle (and
`SSL_CERT_FILE`, which OpenSSL reads). The pooled HTTP/1 client carries plain http only: an
https upstream's requests go through aiohttp's session, with this context."""

from __future__ import annotations

import ssl
from pathlib import Path


class UnusableCaFile(ValueError):
    """`upstream_ca_file` holds no CA certificate OpenSSL can load."""


def upstream_ssl_context(ca_file: Path | None) -> ssl.SSLContext | None:
    """The context the https upstreams are checked with; None: aiohttp's default (blocking: it
    reads the file, so off the event loop)."""
    if ca_file is None:
        return None
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except (ssl.SSLError, OSError) as exc:
        raise UnusableCaFile(
            f"upstream_ca_file {ca_file} holds no CA certificate ({exc}): give a PEM file of"
            " the certificate authority (or the self-signed certificate) the upstreams use"
        ) from exc
