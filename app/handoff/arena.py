"""Arena: one block of anonymous shared memory (memory.py) cut into slots, each with a generation number.

Slot i starts at i * (HEADER + slot_bytes). Its header is two little-endian uint64s: the
generation of the request whose answer follows, and that answer's length in bytes. The front
renews a slot's generation when it takes the slot for a request; the engine writes the answer,
then the header. The front reads an answer only where the header names the generation it gave
that request: anything else in the slot is not this request's answer.

The front creates the arena and hands its descriptor to the engine with the connection
(`handed_over` then closes the front's); the engine attaches the descriptor it received. Each
unmaps it when the connection ends, and the memory is gone with the last mapping.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from app.handoff import memory
from app.handoff.memory import NoRoom

HEADER = struct.Struct("<QQ")  # generation, answer bytes

__all__ = ["HEADER", "Arena", "NoRoom", "Slot"]


@dataclass
class Slot:
    index: int
    generation: int = 0
    busy: bool = False


class Arena:
    """`slots` slots of `slot_bytes` each, in a block of shared memory this process created or attached."""

    def __init__(self, block: memory.Block, slots: int, slot_bytes: int, *, owner: bool) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError("an arena has at least one slot of at least one byte")
        if block.size < slots * (HEADER.size + slot_bytes):
            raise ValueError(f"a block of {block.size} bytes holds fewer than its slots need")
        self.block = block
        self._buf = memoryview(block.mapping)
        self.slot_bytes = slot_bytes
        self.owner = owner
        self.slots = [Slot(i) for i in range(slots)]
        self._free = list(reversed(range(slots)))

    @staticmethod
    def size_of(slots: int, slot_bytes: int) -> int:
        return slots * (HEADER.size + slot_bytes)

    @classmethod
    def create(cls, slots: int, slot_bytes: int, what: str = "the hand-off's slots") -> Arena:
        """A new arena, its memory reserved now: NoRoom (naming `what`, the size and the remedy) if it does not fit."""
        return cls(memory.create(cls.size_of(slots, slot_bytes), what), slots, slot_bytes, owner=True)

    @classmethod
    def attach(cls, fd: int, slots: int, slot_bytes: int) -> Arena:
        """The arena whose descriptor a front handed over (this takes the descriptor); ValueError if it does not fit."""
        return cls(memory.attach(fd, cls.size_of(slots, slot_bytes)), slots, slot_bytes, owner=False)

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
        """Unmap the block, unless a view into it is still alive (rows a batch still holds after their
        request was cancelled): the mapping then goes with the last view."""
        self._buf.release()
        try:
            self.block.close()
        except BufferError:
            pass  # unmapped when the last view is collected

    def _offset(self, index: int) -> int:
        return index * (HEADER.size + self.slot_bytes)
