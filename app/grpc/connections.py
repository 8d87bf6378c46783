"""The one thing grpcio gives a servicer no way to do: end one client's connection.

A unary answer the client never reads (its HTTP/2 flow-control window kept at 0) stays queued in
grpc core for as long as the connection lives, and a servicer can neither cancel the stream nor
close the connection. The HTTP door drops such an answer at `send_timeout_s`; here the connection
is ended at its socket: shutdown(2) on the process's descriptor whose peer is the call's, found
through /proc/self/fd (Linux), after which grpc core sees the connection end and frees all it held
for it. No HTTP/2 is spoken here: grpc core closes its side as for any peer that went away.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("ffn_serve")

_FD_FOLDER = "/proc/self/fd"


def peer_address(peer: str) -> tuple[str, int] | None:
    """grpc's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000") as (host, port); None for other kinds."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def close_connection(peer: str) -> bool:
    """Shut down this process's TCP connection to `peer` (a grpc peer string); whether one was found."""
    wanted = peer_address(peer)
    if wanted is None:
        return False
    try:
        descriptors = os.listdir(_FD_FOLDER)
    except OSError:  # not Linux: nothing to find the socket by
        return False
    for name in descriptors:
        try:
            copy = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                address = sock.getpeername()
                if (str(address[0]).removeprefix("::ffff:"), address[1]) == wanted:
                    sock.shutdown(socket.SHUT_RDWR)  # the connection itself: every descriptor of it sees the end
                    return True
        except OSError:  # not connected, or gone meanwhile
            pass
        finally:
            sock.close()  # the copy only
    return False
