"""Arena: one shared-memory block cut into slots, each with a generation number.

Slot i starts at i * (HEADER + slot_bytes). Its header is two little-endian uint64s: the
generation of the request whose answer follows, and that answer's length in bytes. The front
renews a slot's generation when it takes the slot for a request; the engine writes the answer,
then the header. The front reads an answer only where the header names the generation it gave
that request: anything else in the slot is not this request's answer.

The front creates the arena (and unlinks it when done); the engine attaches by name.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

HEADER = struct.Struct("<QQ")  # generation, answer bytes
_CREATED_HERE: set[str] = set()  # blocks this process created (a front and an engine in one process: tests)


class NoRoom(Exception):
    """/dev/shm cannot hold a new arena."""


@dataclass
class Slot:
    index: int
    generation: int = 0
    busy: bool = False


class Arena:
    """`slots` slots of `slot_bytes` each, in a block of shared memory this process created or attached."""

    def __init__(self, memory: shared_memory.SharedMemory, slots: int, slot_bytes: int, *, owner: bool) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError("an arena has at least one slot of at least one byte")
        if memory.size < slots * (HEADER.size + slot_bytes):
            raise ValueError(f"shared memory {memory.name} holds {memory.size} bytes, fewer than its slots need")
        self.memory = memory
        assert memory.buf is not None, "an open block has a buffer"
        self._buf: memoryview = memory.buf
        self.slot_bytes = slot_bytes
        self.owner = owner
        self.slots = [Slot(i) for i in range(slots)]
        self._free = list(reversed(range(slots)))

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> Arena:
        """A new block, its room reserved now: NoRoom if /dev/shm cannot hold it.

        A shared-memory file holds no pages until they are written, and a write past what its
        tmpfs has left (Docker gives /dev/shm 64 MiB unless told otherwise) kills the writer with
        SIGBUS, whichever process it is. Reserved at creation, a full /dev/shm is an error here,
        once, instead of a crash under load."""
        size = slots * (HEADER.size + slot_bytes)
        memory = shared_memory.SharedMemory(create=True, size=size)
        try:
            os.posix_fallocate(memory._fd, 0, size)  # type: ignore[attr-defined]
        except OSError as exc:
            memory.close()
            memory.unlink()
            raise NoRoom(
                f"no room in /dev/shm for the hand-off's {size / 2**20:.0f} MiB of shared memory "
                f"({exc.strerror}): give the container more (docker run --shm-size, compose shm_size)"
            ) from None
        _CREATED_HERE.add(memory.name)
        return cls(memory, slots, slot_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, slots: int, slot_bytes: int) -> Arena:
        memory = shared_memory.SharedMemory(name=name)
        if name not in _CREATED_HERE:
            # Python's resource tracker would unlink a block it saw attached when this process
            # ends: the front that created it does that (bpo-39959; Python 3.13's track=False).
            resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]
        return cls(memory, slots, slot_bytes, owner=False)

    @property
    def name(self) -> str:
        return self.memory.name

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    # ----- the front's side -----------------------------------------------------------------

    def take(self) -> Slot | None:
        """A free slot under a new generation, or None when every slot is taken."""
        if not self._free:
            return None
        slot = self.slots[self._free.pop()]
        slot.generation += 1
        slot.busy = True
        return slot

    def give_back(self, slot: Slot) -> None:
        if slot.busy:
            slot.busy = False
            self._free.append(slot.index)

    @property
    def free(self) -> int:
        return len(self._free)

    def answer(self, slot: Slot) -> memoryview | None:
        """The answer the engine wrote for the slot's current generation, or None if the slot holds no such answer."""
        generation, nbytes = HEADER.unpack_from(self._buf, self._offset(slot.index))
        if generation != slot.generation or nbytes > self.slot_bytes:
            return None
        start = self._offset(slot.index) + HEADER.size
        return self._buf[start : start + nbytes]

    # ----- both sides -----------------------------------------------------------------------

    def payload(self, index: int, nbytes: int) -> memoryview:
        """The first `nbytes` of slot `index`'s payload: where the rows go, and then the answer."""
        if not 0 <= index < len(self.slots) or nbytes > self.slot_bytes:
            raise ValueError(f"slot {index} of {len(self.slots)} holds at most {self.slot_bytes} bytes, not {nbytes}")
        start = self._offset(index) + HEADER.size
        return self._buf[start : start + nbytes]

    # ----- the engine's side ----------------------------------------------------------------

    def write_answer(self, index: int, generation: int, parts: list[np.ndarray]) -> bool:
        """Write the arrays one after the other as slot `index`'s answer for `generation`; False if they do not fit."""
        nbytes = sum(part.nbytes for part in parts)
        if nbytes > self.slot_bytes:
            return False
        offset = 0
        target = self.payload(index, nbytes)
        for part in parts:
            target[offset : offset + part.nbytes] = np.ascontiguousarray(part).data.cast("B")
            offset += part.nbytes
        target.release()
        HEADER.pack_into(self._buf, self._offset(index), generation, nbytes)
        return True

    def close(self) -> None:
        """Unlink the block (the front that created it) and unmap it, unless a view into it is still
        alive (rows a batch still holds after their request was cancelled): the mapping then goes
        with the last view."""
        self._buf.release()
        try:
            self.memory.close()
        except BufferError:
            pass  # unmapped when the last view is collected; the name is unlinked below all the same
        if self.owner:
            _CREATED_HERE.discard(self.memory.name)
            try:
                self.memory.unlink()
            except FileNotFoundError:
                pass  # unlinked already: closing twice is harmless

    def _offset(self, index: int) -> int:
        return index * (HEADER.size + self.slot_bytes)
