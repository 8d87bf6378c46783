"""ModelRunner: one model's forward pass on its device, called on the device's own thread.

concatenate rows -> device -> FFN -> host, one of two ways:
- plain: gather the rows on the host, copy them over, compute, copy the answer back, all in the call;
- staged (the default on CUDA; forceable on the CPU): `launch(parts)` gathers each chunk into a
  double-buffered slot, copies it on a stream of its own, enqueues the compute and the copy of
  the answer into pinned memory, and returns a Pending that waits on one event
  (app/engine/staging.py). The batcher launches the next batch before it waits, so the copy of
  batch k+1 overlaps the compute of batch k.
Either way the FFN runs through BucketedForward (app/engine/graphs.py): at a padded batch-size
bucket replayed from a CUDA graph once warm on CUDA, eager at the batch's own size otherwise.
Batch-invariant mode runs every chunk at one fixed row count.

Rows travel to the device in the requests' dtype when they share one, and the answer comes back
in the wider of that and the compute dtype: a float32 client of a bfloat16 model sends and gets
float32, converted on the device; a bfloat16 request to a float32 model gets float32, which its
codec rounds for a bfloat16 answer or keeps for a JSON one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from app.engine.graphs import BucketedForward, bucket_sizes, chunk_slices, relative_error, tolerance
from app.engine.montecarlo import MonteCarloRequest
from app.engine.staging import CudaStaging, HostStaging, Pending, Ready, copy_rows
from ffn_core import FeedForward, FusedGatedFeedForward, MonteCarloPasses

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


def set_tf32(enabled: bool) -> None:
    """TF32 tensor-core arithmetic for float32 matmuls and cuDNN convolutions, process-wide (CUDA only).

    torch's own two switches; TF32 keeps a 10-bit mantissa, so each product's relative error
    grows from ~1e-7 to ~1e-3.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


class ModelRunner:
    """Callable forward for the batcher: `runner(parts) -> output` for the rows of all parts."""

    def __init__(
        self,
        model: FeedForward,
        *,
        max_batch_rows: int,
        staging: bool | None = None,
        cuda_graphs: bool = True,
        batch_invariant_rows: int | None = None,
        pad: bool | None = None,
        tf32: bool = False,
    ) -> None:
        """`staging` (default: on for CUDA) runs the double-buffered staged path; forced on the CPU, tests run it.

        `cuda_graphs`: capture a graph per bucket at warm-up (CUDA only). `batch_invariant_rows`:
        every forward at that row count. `pad` (default: only in batch-invariant mode) pads
        batches to their bucket without graphs, which only tests want. `tf32`: the warm-up
        check allows TF32's error for a float32 model on CUDA (set_tf32 sets the switches).
        """
        self.model = model
        first = next(model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self.d_model = model.config.d_model
        self.tf32 = tf32 and self.dtype == torch.float32 and self.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.batch_invariant = batch_invariant_rows is not None
        buckets = [batch_invariant_rows] if batch_invariant_rows is not None else bucket_sizes(max_batch_rows)
        self.chunk_rows = buckets[-1]  # a batch larger than the largest bucket runs as several chunks
        if self.batch_invariant and self.device.type == "cpu" and torch.get_num_threads() > 1:
            # The service sets one thread already (Settings.intra_op_threads says why); a runner
            # built outside it, by a test or a benchmark, would otherwise answer by position.
            log.warning("batch-invariant passes on the CPU run with one torch thread, not %d", torch.get_num_threads())
            torch.set_num_threads(1)
        self.bucketed = BucketedForward(
            model,
            buckets,
            d_model=self.d_model,
            dtype=self.dtype,
            device=self.device,
            pad=self.batch_invariant if pad is None else pad,
            keep_shape=self.batch_invariant,
        )
        self._host = torch.device("cpu")
        self._staging: HostStaging | None = None
        if staging if staging is not None else self.device.type == "cuda":
            self._staging = (
                CudaStaging(self.d_model, self.chunk_rows, self.device)
                if self.device.type == "cuda"
                else HostStaging(self.d_model, self.chunk_rows)
            )

    @property
    def staged(self) -> bool:
        """True when `launch` returns before the answer is there, so a second batch may be launched meanwhile."""
        return self._staging is not None

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.launch(parts).wait()

    def computed_rows(self, rows: int) -> int:
        """The rows a batch of `rows` costs the device: each chunk at its padded bucket, or at its own size."""
        if rows <= self.chunk_rows:
            return self.bucketed.computed_rows(rows)
        return sum(self.bucketed.computed_rows(c.stop - c.start) for c in chunk_slices(rows, self.chunk_rows))

    def launch(self, parts: Sequence[torch.Tensor]) -> Pending:
        """Start the forward pass over the parts' rows; `.wait()` on the result gives (rows, d_model) on the host."""
        with torch.inference_mode():
            try:
                if self._staging is None:
                    return Ready(self._forward_plain(parts))
                return self._launch_staged(self._staging, parts)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()  # the batcher retries in halves: give them the cached blocks
                raise

    def start_monte_carlo(self, rows: torch.Tensor, request: MonteCarloRequest) -> MonteCarloPasses:
        """On the device thread: a Monte Carlo request's passes over `rows`, on the device in the compute dtype."""
        with torch.inference_mode():
            try:
                x = rows.to(device=self.device, dtype=self.dtype)  # (n, d_model)
                return MonteCarloPasses(self.model, x, passes=request.passes, p=request.dropout, seed=request.seed)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                raise

    def inline_rows(self, budget_s: float) -> int:
        """The most rows a batch may have to run on the event loop's thread instead of the model thread.

        The largest bucket whose forward pass took at most `budget_s` here (the best of three, after
        one untimed); 0 when not even one row did, or `budget_s` is 0. CPU only, and only on the
        plain path: staged and batch-invariant batches share buffers with the model thread's work.
        """
        if budget_s <= 0 or self.device.type != "cpu" or self.staged or self.batch_invariant:
            return 0
        fit = 0
        with torch.inference_mode():
            for rows in self.bucketed.buckets:
                parts = [torch.zeros((rows, self.d_model), dtype=self.dtype)]
                self._forward_plain(parts)
                if min(_seconds(self._forward_plain, parts) for _ in range(3)) > budget_s:
                    break
                fit = rows
        return fit

    def _forward_plain(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        x = self._gather_on_host(parts)  # (N, d_model)
        dtype = self._answer_dtype(x.dtype)
        if x.shape[0] <= self.chunk_rows:  # the common case, kept short: a one-row batch is ~150 µs in all
            return self.bucketed(x.to(self.device)).to(self._host, dtype)
        answers = [
            self.bucketed(x[chunk].to(self.device)).to(self._host, dtype)
            for chunk in chunk_slices(len(x), self.chunk_rows)
        ]
        return torch.cat(answers)

    def _gather_on_host(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parts' rows as one tensor: in their dtype when they share one, else in the compute dtype."""
        if len(parts) == 1:
            return parts[0]
        if _shared_dtype(parts) is not None:
            return torch.cat(list(parts))
        out = torch.empty((sum(p.shape[0] for p in parts), self.d_model), dtype=self.dtype)
        copy_rows(out, parts)
        return out

    def _launch_staged(self, staging: HostStaging, parts: Sequence[torch.Tensor]) -> Pending:
        rows = sum(p.shape[0] for p in parts)
        dtype = _shared_dtype(parts) or self.dtype  # staged in the wire dtype, converted on the device
        output = staging.output(rows, self._answer_dtype(dtype))
        with staging.computing():
            for chunk in chunk_slices(rows, self.chunk_rows):
                y = self.bucketed(staging.stage(parts, chunk.start, chunk.stop, dtype))  # (n, d_model)
                staging.consumed()
                staging.copy_out(output[chunk], y)
        return staging.finish(output)

    def _answer_dtype(self, wire: torch.dtype) -> torch.dtype:
        """The wider of the rows' dtype and the compute dtype: no answer loses precision on the way back."""
        return wire if wire.itemsize > self.dtype.itemsize else self.dtype

    def warm_up(self) -> list[int]:
        """Check the fused gate, capture and check the CUDA graphs, then run every bucket once through the whole path.

        Returns the bucket sizes. A check that fails leaves that part eager, with a warning.
        """
        generator = torch.Generator().manual_seed(0)
        bound = tolerance(self.dtype, tf32=self.tf32)
        with torch.inference_mode():
            self._check_fused_gate(generator, bound)
            if self.cuda_graphs:
                self._capture_graphs()
            self.bucketed.check(self.bucketed.forward, bound, generator)
            # In the compute dtype and in float32 (the common wire dtype), so that the pinned
            # answers of both sizes are in the host allocator's cache before the first request.
            for dtype in dict.fromkeys((self.dtype, torch.float32)):
                for rows in self.bucketed.buckets:
                    self([torch.zeros((rows, self.d_model), dtype=dtype)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # warm-up only: the request path waits on its own events
        log.info(
            "%s on %s: buckets %s; CUDA graphs at %s; padded without graphs at %s; staged %s",
            type(self.model).__name__,
            self.device,
            self.bucketed.buckets,
            self.bucketed.graphed or "none",
            [b for b in self.bucketed.padded if b not in self.bucketed.graphed] or "none",
            self.staged,
        )
        return self.bucketed.buckets

    def release(self) -> None:
        """Let the weights go with the last reference to this runner (a reloaded or unloaded model's copy)."""
        self.bucketed.release()

    def _check_fused_gate(self, generator: torch.Generator, bound: float) -> None:
        """The fused W1‖V GEMM against the two apart; past the bound, the model runs unfused."""
        if not isinstance(self.model, FusedGatedFeedForward):
            return
        x = torch.randn((self.chunk_rows, self.d_model), generator=generator).to(self.device, self.dtype)
        error = relative_error(self.model(x), self.model.unfused_forward(x))
        if error > bound:
            log.warning(
                "the fused gate differs from the unfused one by %.3g (bound %.3g): running unfused", error, bound
            )
            self.bucketed.forward = self.model.unfused_forward

    def _capture_graphs(self) -> None:
        try:
            self.bucketed.capture()
        except RuntimeError as exc:  # an op that cannot be captured: stay eager rather than fail the start
            log.warning("CUDA graph capture failed, every batch runs eager: %s", exc)
            self.bucketed = BucketedForward(
                self.bucketed.forward,
                self.bucketed.buckets,
                d_model=self.d_model,
                dtype=self.dtype,
                device=self.device,
                pad=self.batch_invariant,
                keep_shape=self.batch_invariant,
            )


def _shared_dtype(parts: Sequence[torch.Tensor]) -> torch.dtype | None:
    dtype = parts[0].dtype
    return dtype if all(p.dtype == dtype for p in parts) else None


def _seconds(forward: Callable[[Sequence[torch.Tensor]], torch.Tensor], parts: Sequence[torch.Tensor]) -> float:
    started = time.perf_counter()
    forward(parts)
    return time.perf_counter() - started


def device_executor(device: torch.device) -> ThreadPoolExecutor:
    """The one thread that runs every forward pass for a device."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ffn-{device}")
