"""The hand-off's shared memory: anonymous (a memfd), its pages reserved when it is made.

A front makes the block for one connection to an engine and hands its descriptor over the Unix
socket (SCM_RIGHTS, front.py and engine.py); both map it. The block has no name anywhere: no file
in /dev/shm that another process could list, open or register as a shared-memory region, and no
resource tracker to unlink it. It lives exactly as long as a mapping or a descriptor of it does, so
a front killed by SIGKILL or the OOM killer leaves nothing behind once the engine has seen its
connection end and unmapped it.

Its pages come from the host's memory (the memory cgroup's, in a container), not from /dev/shm's
size. The slots' pages are all reserved when the block is made, within the headroom the host or the
container has: a block that does not fit is an error (NoRoom) at once, never a SIGBUS or an OOM kill
under load. An arena's large area (arena.py) is not reserved: its pages are taken as large requests
are written into it and given back as they are answered, within the fronts' byte budget.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from app.protocol import own_memory

NAME = "ffn-handoff"  # what /proc/<pid>/maps shows: "/memfd:ffn-handoff (deleted)"
# A block may take at most this share of the memory the host (or the container) has left: the rest
# is the processes' own, and a block that took the last of it would have the OOM killer end one.
HEADROOM_SHARE = 0.5
REMEDY = (
    "give the service more memory (docker run --memory, compose mem_limit, a pod's resources.limits.memory) "
    "or fewer hand-off slots (handoff_slots, FFN_HANDOFF_SLOTS)"
)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class NoRoom(Exception):
    """The host (or the container) has not the memory a new block needs."""


@dataclass(eq=False)
class Block:
    """One block of shared memory mapped in this process: its mapping, and its descriptor until handed over."""

    mapping: mmap.mmap
    size: int
    identity: tuple[int, int]  # (st_dev, st_ino): how the shared-memory extension knows it as the server's own
    fd: int | None
    released: bool = False

    def close_fd(self) -> None:
        """Close this process's descriptor (the mapping keeps the memory): nothing in /proc/<pid>/fd names it."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Unmap it; BufferError (the mapping then goes with the last view) if a view into it is still alive."""
        self.close_fd()
        if not self.released:
            self.released = True
            own_memory.release(self.identity)
        self.mapping.close()


def create(size: int, what: str, reserve: int | None = None) -> Block:
    """A new block of `size` bytes, the pages of its first `reserve` bytes (all by default) reserved; NoRoom (naming
    `what`, the size and the remedy) if they do not fit. The rest is taken page by page as it is written."""
    reserve = size if reserve is None else reserve
    problem = shortage(reserve, what)
    if problem is not None:
        raise NoRoom(problem)
    fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        # Every page now, or an error now: a page first touched under load past what is left would be
        # a SIGBUS in whichever process touched it.
        if reserve:
            os.posix_fallocate(fd, 0, reserve)
        # Neither side can shrink it under the other's mapping (a SIGBUS) or grow it.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return _mapped(fd, size)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
            raise
        raise NoRoom(f"no room for {what}: {_mib(reserve)} of shared memory ({exc.strerror}): {REMEDY}") from None


def shortage(size: int, what: str) -> str | None:
    """Why `size` bytes of shared memory for `what` do not fit the headroom (one line, with the remedy), or None."""
    room = headroom()
    if room is None or size <= room * HEADROOM_SHARE:
        return None
    return (
        f"no room for {what}: {_mib(size)} of shared memory, with {_mib(room)} of memory left to this "
        f"service (the hand-off may take half): {REMEDY}"
    )


def attach(fd: int, size: int) -> Block:
    """Map the block a front handed over (taking its descriptor, closed here); ValueError if it is not one."""
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if info.st_size != size or seals & _SEALS != _SEALS:
            raise ValueError(
                f"the memory handed over holds {info.st_size} bytes, sealed {seals:#x}: not a {size}-byte block"
            )
        block = _mapped(fd, size)
    except BaseException:
        os.close(fd)
        raise
    block.close_fd()
    return block


def _mapped(fd: int, size: int) -> Block:
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return Block(mapping, size, own_memory.claim(fd), fd)


def headroom(root: Path = Path("/")) -> int | None:
    """The bytes of memory this process's service may still take: the host's available memory, or less where
    its memory cgroup (v2 or v1) has a limit; None where neither can be read."""
    known = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    limit = _cgroup_room(root)
    if limit is not None:
        known.append(limit)
    return min(known) if known else None


def _cgroup_room(root: Path) -> int | None:
    """The memory cgroup's limit less its usage, or None (no cgroup, or no limit)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            mount, limit_file, usage_file = root / "sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            mount, limit_file, usage_file = (
                root / "sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        # A container sees its own cgroup at the mount's root, whatever path /proc/self/cgroup names.
        folder = mount / path.lstrip("/")
        if not (folder / limit_file).exists():
            folder = mount
        try:
            limit_text = (folder / limit_file).read_text().strip()
            if limit_text == "max" or int(limit_text) >= 1 << 60:  # no limit (v1 says so with a huge number)
                continue
            return max(0, int(limit_text) - int((folder / usage_file).read_text()))
        except (OSError, ValueError):
            continue
    return None


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size:,} bytes"
