"""The one table of floating-point dtypes: weights, compute and the wire all name them here.

Each row says how a dtype is called, how many bytes an element takes, which torch dtype holds
it, which numpy dtype reads it little-endian (numpy has no bfloat16), and its Open Inference
Protocol (KServe V2 / Triton) datatype name. Every other list of dtypes in the project is
derived from this one, or held equal to it by a test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    """One floating-point dtype under all the names the project meets it by."""

    name: str  # "float32": settings, X-Dtype headers, weight files
    itemsize: int  # bytes per element
    torch: torch.dtype
    numpy: str | None  # little-endian numpy descriptor ('<f4'); None: numpy has no such dtype
    v2: str  # the V2 / Triton datatype ("FP32")


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 4, torch.float32, "<f4", "FP32"),
        DType("float16", 2, torch.float16, "<f2", "FP16"),
        DType("bfloat16", 2, torch.bfloat16, None, "BF16"),
    )
}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)
BY_V2: dict[str, DType] = {d.v2: d for d in DTYPES.values()}
BY_NUMPY: dict[str, DType] = {d.numpy: d for d in DTYPES.values() if d.numpy is not None}


def dtype_named(name: str) -> DType:
    """The row called `name` ('float32' or 'torch.float32'); an unknown name lists the choices."""
    row = DTYPES.get(name.removeprefix("torch."))
    if row is None:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {list(DTYPE_NAMES)}")
    return row
