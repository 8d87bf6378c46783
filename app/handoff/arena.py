"""Arena: one block of anonymous shared memory (memory.py) cut into slots, each with a generation number.

The block holds `slots` slots of `slot_bytes` each, then (from the next page on) a large area of
`large_bytes`, from which a request too large for a slot takes a slot of its own size (an extent,
page-aligned). Every slot, small or large, begins with a header of two little-endian uint64s: the
generation of the request whose answer follows, and that answer's length in bytes. A request
names its slot by its place (the header's offset in the block) and its room (the bytes after the
header), so that the engine reads and writes either kind alike, within the block's bounds.

The front renews a slot's generation when it takes the slot for a request; the engine writes the
answer, then the header. The front reads an answer only where the header names the generation it
gave that request: anything else in the slot is not this request's answer.

The small slots' pages are reserved when the block is made; the large area's are not (a sparse
file): a large slot's pages are taken as its rows are written, and given back to the host when the
slot is (MADV_REMOVE), so that the area holds only the large requests in flight, which the
front's byte budget (max_held_bytes) bounds.

The front creates the arena and hands its descriptor to the engine with the connection
(`handed_over` then closes the front's); the engine attaches the descriptor it received. Each
unmaps it when the connection ends, and the memory is gone with the last mapping.
"""

from __future__ import annotations

import bisect
import mmap
import struct
from dataclasses import dataclass

import numpy as np

from app.handoff import memory
from app.handoff.memory import NoRoom

HEADER = struct.Struct("<QQ")  # generation, answer bytes
PAGE = mmap.PAGESIZE

__all__ = ["HEADER", "Arena", "NoRoom", "Slot"]


@dataclass
class Slot:
    index: int  # of a small slot; -1 for a large one
    place: int  # its header's offset in the block
    room: int  # the bytes after its header
    generation: int = 0
    busy: bool = False

    @property
    def large(self) -> bool:
        return self.index < 0


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class Arena:
    """`slots` slots of `slot_bytes` each and a large area of `large_bytes`, in a block of shared memory
    this process created or attached."""

    def __init__(self, block: memory.Block, slots: int, slot_bytes: int, large_bytes: int, *, owner: bool) -> None:
        if slots < 1 or slot_bytes < 1 or large_bytes < 0:
            raise ValueError("an arena has at least one slot of at least one byte")
        if block.size != self.block_size(slots, slot_bytes, large_bytes):
            raise ValueError(f"a block of {block.size} bytes is not an arena of its slots")
        self.block = block
        self._buf = memoryview(block.mapping)
        self.slot_bytes = slot_bytes
        self.owner = owner
        self.slots = [Slot(i, i * (HEADER.size + slot_bytes), slot_bytes) for i in range(slots)]
        self._free = list(reversed(range(slots)))
        self.large_start = _pages(self.size_of(slots, slot_bytes))
        self.large_bytes = large_bytes
        # The large area's free extents, (place, size) sorted by place, none adjacent to another.
        self._extents: list[tuple[int, int]] = [(self.large_start, large_bytes)] if large_bytes else []
        self._large_generation = 0

    @staticmethod
    def size_of(slots: int, slot_bytes: int) -> int:
        """The small slots' bytes: the part of the block reserved when it is made."""
        return slots * (HEADER.size + slot_bytes)

    @classmethod
    def block_size(cls, slots: int, slot_bytes: int, large_bytes: int) -> int:
        return (
            _pages(cls.size_of(slots, slot_bytes)) + _pages(large_bytes)
            if large_bytes
            else cls.size_of(slots, slot_bytes)
        )

    @classmethod
    def create(cls, slots: int, slot_bytes: int, what: str = "the hand-off's slots", *, large_bytes: int = 0) -> Arena:
        """A new arena, its slots' memory reserved now: NoRoom (naming `what`, the size and the remedy) if it
        does not fit. `large_bytes`: the large area, rounded up to pages, its pages taken only as used."""
        large_bytes = _pages(large_bytes)
        size = cls.block_size(slots, slot_bytes, large_bytes)
        block = memory.create(size, what, reserve=cls.size_of(slots, slot_bytes))
        return cls(block, slots, slot_bytes, large_bytes, owner=True)

    @classmethod
    def attach(cls, fd: int, slots: int, slot_bytes: int, large_bytes: int = 0) -> Arena:
        """The arena whose descriptor a front handed over (this takes the descriptor); ValueError if it does not fit."""
        return cls(
            memory.attach(fd, cls.block_size(slots, slot_bytes, large_bytes)),
            slots,
            slot_bytes,
            large_bytes,
            owner=False,
        )

    @property
    def fd(self) -> int:
        """The descriptor to hand over (the creating front's, until `handed_over`)."""
        assert self.block.fd is not None, "an arena's descriptor is handed over once; this is a bug"
        return self.block.fd

    def handed_over(self) -> None:
        """The engine has its own descriptor now: the front keeps only its mapping."""
        self.block.close_fd()

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    # ----- the front's side -----------------------------------------------------------------

    def take(self) -> Slot | None:
        """A free small slot under a new generation, or None when every slot is taken."""
        if not self._free:
            return None
        slot = self.slots[self._free.pop()]
        slot.generation += 1
        slot.busy = True
        return slot

    def take_large(self, nbytes: int) -> Slot | None:
        """A large slot of at least `nbytes` (its header aside), from the first free extent that holds it, or None."""
        size = _pages(HEADER.size + nbytes)
        for k, (place, free) in enumerate(self._extents):
            if free >= size:
                if free == size:
                    del self._extents[k]
                else:
                    self._extents[k] = (place + size, free - size)
                self._large_generation += 1
                return Slot(-1, place, size - HEADER.size, self._large_generation, busy=True)
        return None

    def give_back(self, slot: Slot) -> None:
        if not slot.busy:
            return
        slot.busy = False
        if not slot.large:
            self._free.append(slot.index)
            return
        place, size = slot.place, slot.room + HEADER.size
        # Its pages back to the host, out of both processes' mappings: the area holds only what is in flight.
        self.block.mapping.madvise(mmap.MADV_REMOVE, place, size)
        k = bisect.bisect(self._extents, (place, size))
        if k < len(self._extents) and self._extents[k][0] == place + size:  # merge with the next
            size += self._extents.pop(k)[1]
        if k > 0 and sum(self._extents[k - 1]) == place:  # and with the one before
            place, before = self._extents.pop(k - 1)
            size += before
            k -= 1
        self._extents.insert(k, (place, size))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def large_free(self) -> int:
        """The large area's free bytes (in extents, perhaps not in one)."""
        return sum(size for _, size in self._extents)

    def answer(self, slot: Slot) -> memoryview | None:
        """The answer the engine wrote for the slot's current generation, or None if the slot holds no such answer."""
        generation, nbytes = HEADER.unpack_from(self._buf, slot.place)
        if generation != slot.generation or nbytes > slot.room:
            return None
        start = slot.place + HEADER.size
        return self._buf[start : start + nbytes]

    def let_go(self, slot: Slot) -> None:
        """This process is done with the slot's pages for now (the rows are written): out of its resident
        set, still in the block for the engine to read."""
        if slot.large:
            self.block.mapping.madvise(mmap.MADV_DONTNEED, slot.place, slot.room + HEADER.size)

    # ----- both sides -----------------------------------------------------------------------

    def payload(self, index: int, nbytes: int) -> memoryview:
        """The first `nbytes` of small slot `index`'s payload: where the rows go, and then the answer."""
        if not 0 <= index < len(self.slots):
            raise ValueError(f"no slot {index} of {len(self.slots)}")
        return self.region(self.slots[index].place, self.slot_bytes, nbytes)

    def region(self, place: int, room: int, nbytes: int) -> memoryview:
        """The first `nbytes` of the payload of the slot at `place` with `room` bytes: ValueError unless that
        slot lies within the block, page-aligned where it is large."""
        small = (
            room == self.slot_bytes
            and place % (HEADER.size + room) == 0
            and place + HEADER.size + room <= self.size_of(len(self.slots), room)
        )
        large = place >= self.large_start and place % PAGE == 0 and (room + HEADER.size) % PAGE == 0
        if not (small or large) or place + HEADER.size + room > self.block.size or not 0 <= nbytes <= room:
            raise ValueError(f"no slot of {room} bytes at {place} holds {nbytes} bytes")
        start = place + HEADER.size
        return self._buf[start : start + nbytes]

    # ----- the engine's side ----------------------------------------------------------------

    def write_answer(self, place: int, room: int, generation: int, parts: list[np.ndarray]) -> bool:
        """Write the arrays one after the other as the answer for `generation` of the slot at `place`; False if
        they do not fit."""
        nbytes = sum(part.nbytes for part in parts)
        if nbytes > room:
            return False
        offset = 0
        target = self.region(place, room, nbytes)
        for part in parts:
            target[offset : offset + part.nbytes] = np.ascontiguousarray(part).data.cast("B")
            offset += part.nbytes
        target.release()
        HEADER.pack_into(self._buf, place, generation, nbytes)
        return True

    def done_with(self, place: int, room: int) -> None:
        """The engine is done with a large slot (its answer written): out of its resident set; the front reads
        the answer from the block, then gives the pages back."""
        if place >= self.large_start:
            self.block.mapping.madvise(mmap.MADV_DONTNEED, place, room + HEADER.size)

    def close(self) -> None:
        """Unmap the block, unless a view into it is still alive (rows a batch still holds after their
        request was cancelled): the mapping then goes with the last view."""
        self._buf.release()
        try:
            self.block.close()
        except BufferError:
            pass  # unmapped when the last view is collected
