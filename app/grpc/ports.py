"""The gRPC port, held from the start so that a port in use is reported at once, as the HTTP port is.

grpc binds its own listening sockets (it cannot adopt one bound elsewhere), in each serving
process: with worker processes every one joins the port with SO_REUSEPORT and the kernel
shares connections between them. `reserve` runs first, in the command's process: an exclusive
bind, refused while any other process holds or listens on the port (OSError, exit 3 like the
HTTP port), then the same address bound again with SO_REUSEPORT and held for the service's life.
That socket never listens (the kernel gives connections to listening sockets only); it keeps the
port ours, so the serving processes' grpc servers can join it, and it resolves port 0 to the one
port every worker then binds.
"""

from __future__ import annotations

import socket


def reserve(host: str, port: int) -> socket.socket:
    """A socket holding host:port for this service's gRPC servers; OSError if the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP port: no wait for TIME_WAIT
        probe.bind((host, port))
        port = int(probe.getsockname()[1])
    held = socket.socket(family, socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((host, port))
    except OSError:
        held.close()
        raise
    return held


def target(host: str, port: int) -> str:
    """host:port as grpc writes addresses (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
