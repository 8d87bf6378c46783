"""The client side of TLS: a CA to trust and, for mutual TLS, a client certificate, as one SSL context.

    Client("https://host:8000", verify="ca.pem", cert=("client.pem", "client.key"))

`verify` and `cert` read as httpx's: `verify` True (the system's CAs, or SSL_CERT_FILE), a CA file,
or an `ssl.SSLContext` taken as it is; `cert` a PEM file holding certificate and key, or a
(certificate, key) pair. The paths become one context here, since httpx deprecates paths in both.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx

CertFiles = str | Path | tuple[str | Path, str | Path]


def client_context(
    verify: str | Path | ssl.SSLContext | bool = True, cert: CertFiles | None = None
) -> ssl.SSLContext | bool:
    """What httpx's `verify` takes: the context built from a CA file and a client certificate (or `verify` as given)."""
    if isinstance(verify, ssl.SSLContext):
        context = verify
    elif isinstance(verify, str | Path):
        # TLS 1.2 at the least, the hostname checked: ssl's defaults for a client.
        context = ssl.create_default_context(cafile=str(verify))
    elif cert is None:
        return verify
    elif verify:
        context = httpx.create_ssl_context()
    else:
        raise ValueError("a client certificate needs verification on: give verify a CA file or True")
    if cert is not None:
        certfile, keyfile = (cert, None) if isinstance(cert, str | Path) else cert
        context.load_cert_chain(str(certfile), None if keyfile is None else str(keyfile))
    return context
