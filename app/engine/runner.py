"""ModelRunner: one model's forward pass on its device, called on the device's own thread.

concatenate rows -> device -> FFN -> host. On CUDA the rows are gathered into a pinned host
buffer and copied with non_blocking=True; the device-to-host copy of the answer synchronises
the stream, so the pinned buffer is free again when the call returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ffn_core import FeedForward

log = logging.getLogger("ffn_serve.runner")


def resolve_device(name: str) -> torch.device:
    """'auto' is the first GPU when CUDA is available, else the CPU; 'cuda' without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} GPU(s) are visible")
    return device


class ModelRunner:
    """Callable forward for the batcher: `runner(parts) -> output` for the rows of all parts."""

    def __init__(self, model: FeedForward, *, max_batch_rows: int, staging: bool | None = None) -> None:
        """`staging` (default: on for CUDA) gathers rows in a reused host buffer, pinned when CUDA is there.

        The staged path is the GPU path; forcing it on the CPU lets the CPU test suite run it.
        """
        self.model = model
        first = next(model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self.d_model = model.config.d_model
        self._pin = torch.cuda.is_available()
        self._staging: torch.Tensor | None = None
        if staging if staging is not None else self.device.type == "cuda":
            self._staging = self._host_buffer(max_batch_rows)

    def _host_buffer(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, self.d_model), dtype=self.dtype, pin_memory=self._pin)

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        with torch.inference_mode():
            if self._staging is None:
                return self.model(self._gather_on_host(parts))  # (N, d_model)
            return self._forward_staged(parts)

    def _gather_on_host(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(parts) == 1 and parts[0].dtype == self.dtype:
            return parts[0]
        if all(p.dtype == self.dtype for p in parts):
            return torch.cat(list(parts))
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty((rows, self.d_model), dtype=self.dtype)
        self._copy_into(out, parts)
        return out

    @staticmethod
    def _copy_into(buffer: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        offset = 0
        for part in parts:
            buffer[offset : offset + part.shape[0]].copy_(part)  # converts the dtype where needed
            offset += part.shape[0]

    def _forward_staged(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        assert self._staging is not None
        rows = sum(p.shape[0] for p in parts)
        if rows > self._staging.shape[0]:  # an entry larger than the buffer: grow it once
            self._staging = self._host_buffer(rows)
        staging = self._staging[:rows]
        self._copy_into(staging, parts)
        # From pinned memory the copy is asynchronous; on the CPU `to` returns the buffer itself.
        x = staging.to(self.device, non_blocking=True)
        try:
            y = self.model(x)  # (N, d_model)
            # Synchronous device-to-host copy: once it returns, the staging buffer may be reused.
            # (y is the model's own new tensor, never a view of the staging buffer.)
            return y.to("cpu")
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise

    def warm_up(self, max_rows: int) -> list[int]:
        """Run each batch-size bucket once (1, 2, 4, ..., max_rows) so no request pays for first-call setup."""
        sizes = []
        rows = 1
        while rows < max_rows:
            sizes.append(rows)
            rows *= 2
        sizes.append(max_rows)
        for rows in sizes:
            self([torch.zeros((rows, self.d_model), dtype=self.dtype)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return sizes


def device_executor(device: torch.device) -> ThreadPoolExecutor:
    """The one thread that runs every forward pass for a device."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ffn-{device}")
