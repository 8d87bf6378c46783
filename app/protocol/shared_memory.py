"""System shared memory: the regions clients register, and tensor bytes read from and written to them.

A region is `byte_size` bytes at `offset` in a POSIX shared-memory object, `/dev/shm/<key>` on
Linux (what `shm_open(key)` opens, and what tritonclient.utils.shared_memory creates). Registering
opens the object read-write, refusing links and anything but a regular file, checks that the
region lies inside it, and keeps the descriptor until the region is unregistered or the server
stops. Bytes move with pread/pwrite on that descriptor at offsets checked against the region, so:

- nothing outside a registered region is ever read or written;
- an object the client shrinks after registering gives a short read, answered 400, where a
  mapping would have faulted (SIGBUS) and killed the process;
- an input is copied into the server's own memory as it is read: the client cannot change the
  bytes under a batch that is running;
- no object of the server's own memory is ever a region: the hand-off's has no name to give
  (app/handoff/memory.py), and an object that is memory this process holds or maps is refused all
  the same (own_memory.py), whatever the layout.

All of it runs on the event loop, as the routes do, so a region is never closed while a request
of this process is moving bytes through it; one unregistered while a request waits for its batch
answers that request 400 when its output would be written.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.protocol import own_memory
from app.protocol.errors import InvalidInput, RegionNotFound, UnsupportedExtension
from app.protocol.limits import MAX_REGIONS

SHM_FOLDER = Path("/dev/shm")
# Region names travel in URLs and logs: the model names' characters, a little longer.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# A key is one name in the shared-memory folder, with shm_open's optional leading slash.
KEY_PATTERN = re.compile(r"/?([A-Za-z0-9_.-]{1,255})")
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO must not hang open()


def turned_off() -> UnsupportedExtension:
    """The answer to any use of the extension while the setting `shared_memory` is off."""
    return UnsupportedExtension(
        "system_shared_memory", "it is off on this server; start it with shared_memory = true (FFN_SHARED_MEMORY=true)"
    )


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidInput(
            f"shared memory region name {name[:64]!r} must be 1 to 128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(eq=False)
class Region:
    """One registered region: where it is, and the open descriptor of its object (None once closed)."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int | None = field(default=None, repr=False)
    registration: str = ""  # which registration made it: an undo names it, and leaves another alone

    def status(self) -> dict[str, Any]:
        """Triton's status entry."""
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def check_span(self, offset: int, size: int, what: str) -> None:
        """Refuse a span that does not lie inside the region (400), before any byte moves."""
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise InvalidInput(
                f"{what}: {size} bytes at offset {offset} do not fit in shared memory region {self.name!r} "
                f"of {self.byte_size} bytes"
            )

    def read(self, offset: int, size: int, what: str) -> bytearray:
        """A copy of `size` bytes at `offset` in the region."""
        self.check_span(offset, size, what)
        fd = self._open_fd(what)
        buffer = bytearray(size)
        view, position, done = memoryview(buffer), self.offset + offset, 0
        while done < size:
            got = os.preadv(fd, [view[done:]], position + done)
            if got == 0:
                raise InvalidInput(
                    f"{what}: shared memory region {self.name!r} ends after {done} of {size} bytes: "
                    f"its object {self.key!r} was made smaller after it was registered"
                )
            done += got
        return buffer

    def write(self, offset: int, data: memoryview, what: str) -> None:
        """Write `data` at `offset` in the region."""
        self.check_span(offset, data.nbytes, what)
        fd = self._open_fd(what)
        position, done = self.offset + offset, 0
        while done < data.nbytes:
            done += os.pwrite(fd, data[done:], position + done)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _open_fd(self, what: str) -> int:
        if self.fd is None:
            raise InvalidInput(f"{what}: shared memory region {self.name!r} was unregistered while the request ran")
        return self.fd


class SharedMemoryRegions:
    """This process's registered regions, by name. Every worker holds the same ones (by broadcast)."""

    def __init__(self, folder: Path = SHM_FOLDER, max_regions: int = MAX_REGIONS) -> None:
        self._folder = folder
        self._max = max_regions
        self._regions: dict[str, Region] = {}

    def names(self) -> list[str]:
        return list(self._regions)

    def find(self, name: str) -> Region | None:
        return self._regions.get(name)

    def get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"no system shared memory region named {name[:128]!r} is registered")
        return region

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        """Triton's status list: every region, or the one named (404 if it is not registered)."""
        if name is not None:
            return [self.get(name).status()]
        return [region.status() for region in self._regions.values()]

    def check(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Everything register would refuse, refused (400) without keeping anything open."""
        os.close(self._open(name, key, offset, byte_size))

    def register(self, name: str, key: str, offset: int, byte_size: int, registration: str = "") -> Region:
        region = Region(name, key, offset, byte_size, self._open(name, key, offset, byte_size), registration)
        self._regions[name] = region
        return region

    def unregister(self, name: str, registration: str | None = None) -> bool:
        """Close the region's descriptor; False if no region has that name (not an error, as in Triton).

        `registration`: only the region that registration made (None: whichever has the name).
        """
        region = self._regions.get(name)
        if region is None or (registration is not None and region.registration != registration):
            return False
        del self._regions[name]
        region.close()
        return True

    def close_all(self) -> None:
        for name in list(self._regions):
            self.unregister(name)

    def _open(self, name: str, key: str, offset: int, byte_size: int) -> int:
        """The object's descriptor, open read-write, once the region is known to lie inside it."""
        check_name(name)
        if name in self._regions:
            raise InvalidInput(f"shared memory region {name!r} is already registered; unregister it first")
        if len(self._regions) >= self._max:
            raise InvalidInput(f"{self._max} shared memory regions are registered, the most one server holds")
        match = KEY_PATTERN.fullmatch(key)
        if match is None or match[1] in (".", ".."):
            raise InvalidInput(
                f"shared memory key {key[:64]!r} must be one name in {self._folder} (as shm_open takes it): "
                "an optional '/' then letters, digits, '_', '.' or '-'"
            )
        if offset < 0 or byte_size < 1:
            raise InvalidInput(f"a region needs offset >= 0 and byte_size >= 1, got {offset} and {byte_size}")
        path = self._folder / match[1]
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise InvalidInput(f"no shared memory object {key!r} ({path}): create it before registering") from None
        except OSError as exc:  # a link (ELOOP), no permission, ...
            raise InvalidInput(f"cannot open shared memory object {key!r}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidInput(f"{path} is not a shared memory object (not a regular file)")
            if own_memory.is_own(info):
                raise InvalidInput(f"shared memory object {key!r} is this server's own memory, never a client's region")
            if offset + byte_size > info.st_size:
                raise InvalidInput(
                    f"region {name!r} ({byte_size} bytes at offset {offset}) does not fit in shared memory "
                    f"object {key!r} of {info.st_size} bytes"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd
