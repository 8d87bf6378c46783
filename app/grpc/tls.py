"""The gRPC door's TLS: server credentials that take the rotation's pair at each new handshake.

grpc core calls the fetcher before each handshake; it answers a new configuration when the pair
(app/config/tls.py: Rotation) has changed since the last one it gave, and None (keep the one you have)
otherwise. Connections already open keep the pair they shook hands with. grpc core's defaults:
TLS 1.2 at the least, its own cipher list; with a client CA, a client certificate is required.
"""

from __future__ import annotations

import threading

import grpc

from app.config.tls import KeyPair, Rotation


def server_credentials(rotation: Rotation) -> grpc.ServerCredentials:
    """Credentials serving `rotation.current`, and each pair that replaces it, to new connections."""
    first = rotation.current
    served = [first.generation]
    lock = threading.Lock()  # the fetcher runs on grpc core's threads

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        pair = rotation.current
        with lock:
            if pair.generation == served[0]:
                return None
            served[0] = pair.generation
        return _configuration(pair)

    return grpc.dynamic_ssl_server_credentials(
        _configuration(first), fetch, require_client_authentication=first.client_ca is not None
    )


def _configuration(pair: KeyPair) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pair.key, pair.cert_chain)], root_certificates=pair.client_ca)
