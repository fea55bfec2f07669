"""An https llama-server for the overhead benchmark (`--upstream-tls`): a certificate for the
test bed's address issued by a private CA made for the run (trustme, a dev dependency made for
this), the flags that serve it, and the context that trusts it. Every arm then reaches the
server over https: the proxy checks it against `upstream_ca_file`, the bare pass-through and
the load generator with the same CA."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from cacheproxy.bench.harness import BenchmarkError


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the CA's certificate (PEM): what the clients trust
    key: Path  # the server's private key
    chain: Path  # the server's certificate, then the CA's

    def server_flags(self) -> tuple[str, ...]:
        return ("--ssl-key-file", str(self.key), "--ssl-cert-file", str(self.chain))

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


def make_tls_files(folder: Path, host: str) -> TlsFiles:
    """A private CA and a certificate it issued for `host`, written to `folder`."""
    try:
        import trustme  # only this option needs it: a dev dependency
    except ImportError as exc:
        raise BenchmarkError(
            f"--upstream-tls needs trustme ({exc}): install the dev extra (pip install -e '.[dev]')"
        ) from exc
    folder.mkdir(parents=True, exist_ok=True)
    authority = trustme.CA()
    issued = authority.issue_cert(host)
    files = TlsFiles(folder / "ca.pem", folder / "key.pem", folder / "chain.pem")
    authority.cert_pem.write_to_path(str(files.ca))
    issued.private_key_pem.write_to_path(str(files.key))
    files.chain.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    return files
