"""Batch-size buckets, chunks and the tolerance a bucket is checked to: arithmetic with no device.

A batch of n rows runs at its bucket, the smallest bucket size >= n, padded; rows are
independent in the FFN, so the padding rows never touch the real ones and are sliced off. A
batch larger than the largest bucket is cut into chunks of at most that many rows.
"""

from __future__ import annotations

import torch

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
