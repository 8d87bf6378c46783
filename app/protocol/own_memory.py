"""The server's own shared memory, which no client may register as a region (app/protocol/shared_memory.py).

The hand-off's blocks (app/handoff/memory.py) have no name a client could give, so none can reach
a region; this is the check behind that: every block a process maps is claimed here by its
(st_dev, st_ino), and an object a client names is refused if it is one of those, or any other file
this process has mapped (/proc/self/maps), whatever the layout.
"""

from __future__ import annotations

import os
from pathlib import Path

_CLAIMED: dict[tuple[int, int], int] = {}  # identity -> how many of this process's blocks are it
MAPS = Path("/proc/self/maps")


def claim(fd: int) -> tuple[int, int]:
    """Count the object open at `fd` as the server's own while it is mapped here; its identity, to release."""
    info = os.fstat(fd)
    identity = (info.st_dev, info.st_ino)
    _CLAIMED[identity] = _CLAIMED.get(identity, 0) + 1
    return identity


def release(identity: tuple[int, int]) -> None:
    count = _CLAIMED.get(identity, 0) - 1
    if count > 0:
        _CLAIMED[identity] = count
    else:
        _CLAIMED.pop(identity, None)


def is_own(info: os.stat_result) -> bool:
    """Whether the object `info` describes is memory of this server: a claimed block, or a file mapped here."""
    return (info.st_dev, info.st_ino) in _CLAIMED or _mapped_here(info)


def _mapped_here(info: os.stat_result) -> bool:
    """Whether /proc/self/maps lists a mapping of that object (its device as major:minor in hex, then its inode)."""
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}"
    inode = str(info.st_ino)
    try:
        with MAPS.open() as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[4] == inode and fields[3] == device:
                    return True
    except OSError:  # no /proc: the claimed blocks are all it knows
        pass
    return False
