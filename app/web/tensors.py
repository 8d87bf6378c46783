"""Tensor checks and conversions that both protocols share: shapes, JSON numbers, raw bytes.

Everything a client can get wrong is refused here with InvalidInput, before the batcher.
Raw tensors are little-endian and C order; they are viewed in the request's own buffer,
never copied.
"""

from __future__ import annotations

import math

import numpy as np
import orjson
import torch

from app.web.errors import InvalidInput
from ffn_core.dtypes import DType

MAX_RANK = 3


def check_shape(shape: tuple[int, ...], d_model: int) -> int:
    """Rows in a [rows, d_model] or [batch, seq, d_model] tensor; anything else is InvalidInput."""
    if not 2 <= len(shape) <= MAX_RANK:
        raise InvalidInput(
            f"expected a tensor of shape [rows, {d_model}] or [batch, seq, {d_model}], got rank {len(shape)} {list(shape)}"
        )
    if shape[-1] != d_model:
        raise InvalidInput(f"last dimension must be d_model={d_model}, got {shape[-1]} (shape {list(shape)})")
    if any(dim < 1 for dim in shape):
        raise InvalidInput(f"every dimension must be at least 1, got shape {list(shape)}")
    return math.prod(shape[:-1])


def check_finite(rows: torch.Tensor) -> None:
    # numpy where it can (far cheaper per call than torch's dispatch); bfloat16 has no numpy dtype.
    finite = np.isfinite(rows.numpy()).all() if rows.dtype != torch.bfloat16 else torch.isfinite(rows).all()
    if not finite:
        raise InvalidInput("inputs must be finite numbers: found NaN or Infinity")


def view_rows(buffer: bytearray, dtype: DType, rows: int, d_model: int, offset: int = 0) -> torch.Tensor:
    """(rows, d_model) of `dtype` viewed in `buffer` at `offset`, without a copy; checked finite.

    The caller has checked that the buffer holds exactly rows * d_model elements from `offset`.
    """
    tensor = torch.frombuffer(buffer, dtype=dtype.torch, offset=offset, count=rows * d_model).view(rows, d_model)
    check_finite(tensor)
    return tensor


def loads_json(body: bytes | bytearray | memoryview) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson refuses NaN/Infinity literals, integers beyond 64 bits and nesting deeper than 1024.
        raise InvalidInput(f"malformed JSON: {exc}") from None


def json_numbers_to_array(value: object, field: str) -> np.ndarray:
    """Nested lists of numbers -> a C-contiguous float32 array; ragged, non-numbers, NaN or overflow refused."""
    if not isinstance(value, list):
        raise InvalidInput(f"{field!r} must be a nested list of numbers")
    try:
        array = np.array(value)  # dtype inferred: float64/int64 for numbers, anything else is refused below
    except (ValueError, OverflowError, RecursionError) as exc:
        raise InvalidInput(f"{field!r} must be a rectangular nested list of numbers: {exc}") from None
    if array.dtype.kind not in "fiu":
        raise InvalidInput(f"{field!r} must contain only numbers (found {_kind_name(array.dtype)})")
    with np.errstate(over="ignore", invalid="ignore"):
        array32 = array.astype(np.float32)
    if not np.isfinite(array32).all():
        raise InvalidInput(f"{field!r} must be finite float32 numbers: a value is out of float32 range")
    return np.ascontiguousarray(array32)


def _kind_name(dtype: np.dtype) -> str:
    return {"U": "strings", "S": "strings", "O": "mixed or non-numeric values", "b": "booleans"}.get(
        dtype.kind, str(dtype)
    )


def to_wire_dtype(output: torch.Tensor, dtype: DType) -> torch.Tensor:
    return output.to(dtype.torch).contiguous()


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, little-endian, without a copy (bfloat16 through its 16-bit pattern)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    array: np.ndarray = tensor.numpy()
    return memoryview(array.data).cast("B")
