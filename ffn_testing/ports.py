"""Free TCP ports on the loopback interface, for the servers a test or a benchmark starts."""

from __future__ import annotations

import contextlib
import socket

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = HOST) -> list[int]:
    """`count` different TCP ports nobody listens on right now.

    Each is held bound until all are chosen: once one is closed the kernel may hand the same port
    out again, and two calls of free_port() in a row gave a server the same HTTP and gRPC port
    (seen in a CI-style run).
    """
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports
