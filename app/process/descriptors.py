"""File descriptors: a process must be able to open as many as its connection cap promises.

Each connection is a file descriptor. With `max_connections` above the process's limit
(RLIMIT_NOFILE, 1024 by default on many systems, as max_connections is), the cap never
triggers: past the limit accept() fails, clients see resets and nothing says why. At start the
soft limit is raised to what the cap needs (up to the hard limit, which an unprivileged process
cannot pass); a cap that still does not fit is lowered to what does, with a log line.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("ffn_serve")

# Descriptors a serving process needs besides its connections: listening sockets, the
# supervisor's pipe, log and metrics files, weight files being read, torch's and the loop's own.
RESERVED = 64


def fit_connection_cap(max_connections: int) -> int:
    """The connection cap this process can keep: max_connections, its descriptor limit raised to fit if need be."""
    needed = max_connections + RESERVED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the file descriptor limit from %d to %d: %s", soft, raised, exc)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    cap = max(1, soft - RESERVED)
    log.warning(
        "max_connections %d does not fit this process's file descriptor limit (%d, hard limit %s): "
        "at most %d connections are served; raise the hard limit (ulimit -Hn, LimitNOFILE, the container's nofile)",
        max_connections,
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        cap,
    )
    return cap
