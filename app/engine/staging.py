"""Double-buffered staging of a batch's rows to the device and of its answer back.

CUDA: two pinned host slots and two device slots. The rows of chunk k+1 are gathered into host
slot (k+1) % 2 and copied to the device on a copy stream of their own while chunk k computes on
the compute stream; events order the four uses of a slot (host written, copied, read on the
device, free again) without ever synchronising the whole device. The answer is copied into
pinned memory on the compute stream and an event marks it complete: `Pending.wait()` waits on
that event alone.

Host (the same bookkeeping with no device): the slots are plain tensors and nothing is copied.
It runs the staged path on the CPU, so the CPU tests cover the slot rotation and the chunking.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

SLOTS = 2  # double-buffered: one slot fills while the other's rows are being read
WIDEST = 4  # bytes per element of the widest dtype a slot holds (float32)


class Pending(Protocol):
    """A launched forward pass: `done()` without blocking; `wait()` blocks until the answer is on the host."""

    def done(self) -> bool: ...

    def wait(self) -> torch.Tensor: ...


@dataclass
class Ready:
    """An answer computed already (the CPU, or a path that waited)."""

    output: torch.Tensor

    def done(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self.output


@dataclass
class InFlight:
    """An answer being copied into pinned host memory; `event` completes when it is there."""

    output: torch.Tensor
    event: torch.cuda.Event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> torch.Tensor:
        self.event.synchronize()  # this event only: other batches keep running
        return self.output


def copy_rows(target: torch.Tensor, parts: Sequence[torch.Tensor], start: int = 0) -> None:
    """Fill `target` with rows [start, start + len(target)) of the parts' concatenation, converting the dtype."""
    stop = start + target.shape[0]
    offset = 0
    for part in parts:
        n = part.shape[0]
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            target[lo - start : hi - start].copy_(part[lo - offset : hi - offset])
        offset += n
        if offset >= stop:
            return


def _rows(slot: torch.Tensor, dtype: torch.dtype, rows: int, d_model: int) -> torch.Tensor:
    """The first `rows` rows of a byte slot, viewed as (rows, d_model) of `dtype`."""
    return slot.view(dtype)[: rows * d_model].view(rows, d_model)


class HostStaging:
    """Slots in plain host memory, for the CPU: staging is a gather, the answer is computed when returned."""

    def __init__(self, d_model: int, capacity_rows: int, *, pin_memory: bool = False) -> None:
        self.d_model = d_model
        self.capacity_rows = capacity_rows
        nbytes = capacity_rows * d_model * WIDEST  # any dtype fits: a slot is bytes, viewed as needed
        self._slots = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory) for _ in range(SLOTS)]
        self._next = 0
        self.staged_chunks = 0  # for tests and logs: how many chunks went through the slots

    def _take_slot(self) -> int:
        slot = self._next
        self._next = (slot + 1) % SLOTS
        self.staged_chunks += 1
        return slot

    def stage(self, parts: Sequence[torch.Tensor], start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of the parts, gathered into the next slot as `dtype`: (stop - start, d_model)."""
        assert stop - start <= self.capacity_rows, "a chunk larger than a slot; this is a bug."
        rows = _rows(self._slots[self._take_slot()], dtype, stop - start, self.d_model)
        copy_rows(rows, parts, start)
        return rows

    def consumed(self) -> None:
        """The compute has been issued for the last staged chunk (nothing to record on the host)."""

    def output(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((rows, self.d_model), dtype=dtype)

    def copy_out(self, target: torch.Tensor, y: torch.Tensor) -> None:
        target.copy_(y)

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        yield

    def finish(self, output: torch.Tensor) -> Pending:
        return Ready(output)


class CudaStaging(HostStaging):
    """Pinned host slots, device slots, a copy stream and a compute stream, ordered by events."""

    def __init__(self, d_model: int, capacity_rows: int, device: torch.device) -> None:
        super().__init__(d_model, capacity_rows, pin_memory=True)
        self.device = device
        self._device_slots = [torch.empty(slot.shape, dtype=torch.uint8, device=device) for slot in self._slots]
        self.copy_stream = torch.cuda.Stream(device)
        self.compute_stream = torch.cuda.Stream(device)
        self._current = torch.cuda.default_stream(device)
        # An event never recorded is complete: waiting on it returns at once, so the first use
        # of each slot waits for nothing.
        self._copied = [torch.cuda.Event() for _ in range(SLOTS)]  # host slot read, device slot written
        self._read = [torch.cuda.Event() for _ in range(SLOTS)]  # device slot read by the compute stream
        self._last = 0

    def stage(self, parts: Sequence[torch.Tensor], start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        assert stop - start <= self.capacity_rows, "a chunk larger than a slot; this is a bug."
        slot = self._last = self._take_slot()
        rows = stop - start
        self._copied[slot].synchronize()  # the slot's previous copy has left the host buffer
        host = _rows(self._slots[slot], dtype, rows, self.d_model)
        copy_rows(host, parts, start)
        on_device = _rows(self._device_slots[slot], dtype, rows, self.d_model)
        with self._on(self.copy_stream):
            self.copy_stream.wait_event(self._read[slot])  # the compute stream is done with the slot's last rows
            on_device.copy_(host, non_blocking=True)
            self._copied[slot].record(self.copy_stream)
        self.compute_stream.wait_event(self._copied[slot])
        return on_device

    def consumed(self) -> None:
        self._read[self._last].record(self.compute_stream)

    def output(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        # PyTorch's caching host allocator reuses pinned blocks, and keeps one from reuse until
        # the copies recorded on it have finished.
        return torch.empty((rows, self.d_model), dtype=dtype, pin_memory=True)

    def copy_out(self, target: torch.Tensor, y: torch.Tensor) -> None:
        target.copy_(y.to(target.dtype), non_blocking=True)  # converts on the device, then one copy

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        with self._on(self.compute_stream):
            yield

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream) -> Iterator[None]:
        """`torch.cuda.stream(stream)` less its lookups of the device and the current stream.

        Those lookups cost a quarter of a 1-row pass on an H100 machine: 217 µs a pass with
        them, 159 without (the median of 2,000). The stream to go back to is the one this
        staging made current before (stage runs inside computing), else the device's default
        stream, which is the model thread's outside these passes.
        """
        previous, self._current = self._current, stream
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            self._current = previous
            torch.cuda.set_stream(previous)

    def finish(self, output: torch.Tensor) -> Pending:
        event = torch.cuda.Event()
        event.record(self.compute_stream)
        return InFlight(output, event)
