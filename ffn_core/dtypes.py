"""The one table of floating-point dtypes: weights, compute and the wire all name them here.

Each row says how a dtype is called, how many bytes an element takes, which numpy dtype reads it
little-endian (numpy has no bfloat16), which numpy array carries it, its largest finite value and
its Open Inference Protocol (KServe V2 / Triton) datatype name. Every other list of dtypes in the
project is derived from this one, or held equal to it by a test.

No torch here: the doors read this table in processes that never import torch. Torch names its
dtypes as this table does; ffn_core/torch_dtypes.py is the torch side.

Arrays: float32 and float16 travel as numpy arrays of their own dtype, bfloat16 as a uint16 array
of its 16-bit patterns (the upper half of the float32 of the same value), which torch views as
bfloat16 without a copy. An array's dtype thus names its row (`BY_ARRAY`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One floating-point dtype under all the names the project meets it by."""

    name: str  # "float32": settings, X-Dtype headers, weight files, and torch's name for it
    itemsize: int  # bytes per element
    numpy: str | None  # little-endian numpy descriptor ('<f4'); None: numpy has no such dtype
    array: str  # the numpy descriptor of the arrays that carry it: its own, else its bit pattern's ('<u2')
    largest: float  # the largest finite value
    v2: str  # the V2 / Triton datatype ("FP32")


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 4, "<f4", "<f4", 3.4028234663852886e38, "FP32"),
        DType("float16", 2, "<f2", "<f2", 65504.0, "FP16"),
        DType("bfloat16", 2, None, "<u2", 3.3895313892515355e38, "BF16"),
    )
}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)
BY_V2: dict[str, DType] = {d.v2: d for d in DTYPES.values()}
BY_NUMPY: dict[str, DType] = {d.numpy: d for d in DTYPES.values() if d.numpy is not None}
BY_ARRAY: dict[str, DType] = {d.array: d for d in DTYPES.values()}  # keyed by an array's `dtype.str`


def dtype_named(name: str) -> DType:
    """The row called `name` ('float32' or 'torch.float32'); an unknown name lists the choices."""
    row = DTYPES.get(name.removeprefix("torch."))
    if row is None:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {list(DTYPE_NAMES)}")
    return row
