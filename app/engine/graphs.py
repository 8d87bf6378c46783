"""Batch-size buckets, and BucketedForward: the model run at them, padded up, by CUDA graph replay where it can be.

The buckets first, as arithmetic with no device: a batch of n rows runs at its bucket, the
smallest bucket size >= n, padded; rows are independent in the FFN, so the padding rows never
touch the real ones and are sliced off. A batch larger than the largest bucket is cut into chunks
of at most that many rows. The tolerance a bucket is checked to at warm-up is here too.

Each bucket has a call that computes the model over the first `bucket` rows of one static input
buffer: a captured CUDA graph on CUDA, the eager model at the padded size elsewhere. A batch of
n rows is copied into the buffer (converting its dtype), its bucket's call runs, and the first
n rows of the answer are kept. Rows are independent, so whatever the padding rows hold (zeros
at first, earlier batches' rows later) reaches only padding rows of the answer.

The padded eager call is the same bookkeeping as a graph replay without the graph: the CPU tests
run the padding and slicing through it, and batch-invariant mode uses it where graphs are off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("ffn_serve.runner")

# Largest ‖actual − eager‖ / ‖eager‖ a bucket may show at warm-up. Two float32 computations of one
# FFN at different batch shapes differ by ~1e-7; TF32 rounds the matmul inputs to a 10-bit mantissa
# (~1e-3 each, ~3e-4 on the output); float16 and bfloat16 keep 10 and 7 bits (~1e-3, ~4e-3). A
# bucket past these is broken (garbage, stale memory), not merely rounded differently.
TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
TF32_TOLERANCE = 5e-3


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to `max_rows`, which is always the last (a bucket of its own if not a power of two)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    sizes = []
    rows = 1
    while rows < max_rows:
        sizes.append(rows)
        rows *= 2
    sizes.append(max_rows)
    return sizes


def bucket_for(rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `rows` (`buckets` ascending), or None when none does."""
    for size in buckets:
        if size >= rows:
            return size
    return None


def fewest_rows(bucket: int, buckets: list[int]) -> int:
    """The smallest batch that runs at `bucket` (`buckets` ascending): one more than the bucket below it."""
    below = [size for size in buckets if size < bucket]
    return below[-1] + 1 if below else 1


def chunk_slices(rows: int, chunk: int) -> list[slice]:
    """Consecutive slices of at most `chunk` rows that cover `rows` rows."""
    return [slice(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


def tolerance(dtype: torch.dtype, *, tf32: bool = False) -> float:
    """The warm-up check's bound for a model computing in `dtype` (float32 with TF32 when `tf32`)."""
    if dtype == torch.float32 and tf32:
        return TF32_TOLERANCE
    return TOLERANCE[dtype]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; inf when either holds a NaN or an infinity."""
    a, e = actual.double(), expected.double()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    scale = e.norm().item()
    error = (a - e).norm().item()
    return error / scale if scale > 0 else error


Forward = Callable[[torch.Tensor], torch.Tensor]  # (n, d_model) -> (n, d_model), in the compute dtype


class BucketedForward:
    """`forward` at the bucket sizes: pad, run the bucket's call, slice. Batches past the largest bucket run eager."""

    def __init__(
        self,
        forward: Forward,
        buckets: Sequence[int],
        *,
        d_model: int,
        dtype: torch.dtype,
        device: torch.device,
        pad: bool,
        keep_shape: bool = False,
    ) -> None:
        """`pad` false: every batch runs eager at its own size (no buckets). `keep_shape`: a bucket that fails
        its check falls back to the eager model at the padded size, never at the batch's own size
        (batch-invariant mode, where the shape is what makes rows bit-identical)."""
        self.forward = forward
        self.buckets = sorted(buckets)
        self.dtype = dtype
        self.device = device
        self.keep_shape = keep_shape
        self.d_model = d_model
        self.graphed: list[int] = []  # buckets replayed from a CUDA graph
        self._input: torch.Tensor | None = None  # (largest bucket, d_model): the static input of every call
        self._calls: dict[int, Callable[[], torch.Tensor]] = {}
        if pad:
            self._calls = {bucket: self._padded_eager(bucket) for bucket in self.buckets}

    @property
    def padded(self) -> list[int]:
        """The buckets a batch is padded up to; a batch whose bucket is not here runs eager at its own size."""
        return sorted(self._calls)

    def computed_rows(self, n: int) -> int:
        """The rows the device computes for a batch of `n`: its bucket where it is padded, else `n`."""
        bucket = bucket_for(n, self.buckets)
        return bucket if bucket is not None and bucket in self._calls else n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) for x (n, d_model) on the device, in any dtype: (n, d_model) in the compute dtype.

        The answer may be a view of a buffer the next call overwrites: copy it out (or enqueue
        the copy on the same stream) before calling again.
        """
        n = x.shape[0]
        bucket = bucket_for(n, self.buckets)
        call = self._calls.get(bucket) if bucket is not None else None
        if call is None:
            return self.forward(x.to(self.dtype))
        self._static_input()[:n].copy_(x)  # converts the dtype where the wire's differs
        return call()[:n]

    def _static_input(self) -> torch.Tensor:
        if self._input is None:
            # Zeros, not torch.empty's leftovers: padding rows are computed too, so keep them finite.
            self._input = torch.zeros((self.buckets[-1], self.d_model), dtype=self.dtype, device=self.device)
        return self._input

    def _padded_eager(self, bucket: int) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            return self.forward(self._static_input()[:bucket])

        return call

    def release(self) -> None:
        """Drop the padded calls and graphs: they refer back to this object and its model, a cycle that
        would keep the weights alive past their model's retirement (gc.freeze hides it from the collector)."""
        self._calls.clear()
        self.graphed.clear()
        self._input = None

    def capture(self) -> None:
        """Capture one CUDA graph per bucket, largest first, sharing one memory pool; every batch is then padded.

        The graphs run one at a time on one stream, so they can share the pool: a bucket's
        output is consumed (copied out) before the next replay reuses that memory.
        """
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device; this is a bug."
        static_input = self._static_input()
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device):
            # Run each bucket eagerly first, on the capture stream: cuBLAS picks its kernels and
            # allocates its workspace outside the capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for bucket in self.buckets:
                    self.forward(static_input[:bucket])
            torch.cuda.current_stream(self.device).wait_stream(stream)
            pool = torch.cuda.graph_pool_handle()
            for bucket in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    output = self.forward(static_input[:bucket])
                self._calls[bucket] = _replay(graph, output)
                self.graphed.append(bucket)

    def check(self, reference: Forward, bound: float, generator: torch.Generator) -> list[int]:
        """Compare every padded bucket with `reference` (the eager model) on random rows; return the failures.

        Each bucket is checked full and at the fewest rows that reach it (the most padding). A
        bucket past `bound`, or not finite, is taken off graphs with a warning: it runs eager
        at the batch's size, or at the padded size when `keep_shape`.
        """
        failed = []
        for bucket in self.padded:
            worst = 0.0
            for rows in sorted({bucket, fewest_rows(bucket, self.buckets)}):
                x = torch.randn((rows, self.d_model), generator=generator).to(self.device, self.dtype)
                expected = reference(x)
                worst = max(worst, relative_error(self(x), expected))
            if worst <= bound:
                continue
            failed.append(bucket)
            fallback = "eager at the padded size" if self.keep_shape else "eager"
            log.warning(
                "batch bucket %d differs from the eager model by %.3g (bound %.3g): it runs %s",
                bucket,
                worst,
                bound,
                fallback,
            )
            if bucket in self.graphed:
                self.graphed.remove(bucket)
            if self.keep_shape:
                self._calls[bucket] = self._padded_eager(bucket)
            else:
                del self._calls[bucket]
        return failed


def _replay(graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        graph.replay()  # on the current stream
        return output

    return call
