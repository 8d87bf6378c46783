"""Native wire formats: request bodies -> a (rows, d_model) tensor, outputs -> response bodies.

Everything a client can get wrong is checked here, before the batcher, and raised as
InvalidInput (400), UnsupportedMediaType (415) or NotAcceptable (406). Binary bodies are
decoded without a copy: the tensor is a view of the request's bytearray.
"""

from __future__ import annotations

import ast
import io
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import orjson
import torch

from app.errors import InvalidInput, NotAcceptable, UnsupportedMediaType

WireDtype = Literal["float32", "float16", "bfloat16"]
Encoding = Literal["json", "raw", "npy"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# .npy descriptors we accept; numpy has no bfloat16, so bfloat16 travels as raw bytes only.
NPY_DTYPES = {"<f4": "float32", "<f2": "float16"}

MEDIA_TYPES: dict[str, Encoding] = {
    "application/json": "json",
    "application/octet-stream": "raw",
    "application/x-npy": "npy",
}
MAX_RANK = 3


@dataclass(frozen=True)
class DecodedInput:
    """A request's rows, flattened to (rows, d_model), and the shape and dtype to answer in."""

    rows: torch.Tensor
    shape: tuple[int, ...]
    dtype: WireDtype


# ----- content negotiation ------------------------------------------------------------------


def request_encoding(content_type: str | None, content_encoding: str | None) -> Encoding:
    """The body's encoding from Content-Type; no Content-Type is read as JSON."""
    if content_encoding and content_encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaType(
            f"Content-Encoding {content_encoding!r} is not supported; send the body uncompressed"
        )
    if not content_type:
        return "json"
    media = content_type.split(";", 1)[0].strip().lower()
    try:
        return MEDIA_TYPES[media]
    except KeyError:
        raise UnsupportedMediaType(
            f"Content-Type {media!r} is not supported; use one of {sorted(MEDIA_TYPES)}"
        ) from None


def response_encoding(accept: str | None) -> Encoding:
    """The answer's encoding from Accept (highest q first); none or */* is JSON."""
    if not accept:
        return "json"
    ranges: list[tuple[float, int, str]] = []
    for position, item in enumerate(accept.split(",")):
        media, *params = (part.strip().lower() for part in item.split(";"))
        q = 1.0
        for param in params:
            if param.startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        if q > 0 and media:
            ranges.append((-q, position, media))
    for _, _, media in sorted(ranges):
        if media in MEDIA_TYPES:
            return MEDIA_TYPES[media]
        if media in ("*/*", "application/*"):
            return "json"
    raise NotAcceptable(f"cannot answer in {accept!r}; Accept one of {sorted(MEDIA_TYPES)}")


# ----- shapes -------------------------------------------------------------------------------


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


def parse_shape_header(value: str | None) -> tuple[int, ...]:
    """X-Shape: comma-separated positive decimal integers, e.g. '7,512'."""
    if value is None:
        raise InvalidInput("binary body needs an X-Shape header, e.g. 'X-Shape: 7,512'")
    parts = [part.strip() for part in value.split(",")]
    if len(parts) > MAX_RANK or not all(part.isdigit() and part.isascii() and len(part) <= 18 for part in parts):
        raise InvalidInput(f"X-Shape must be 2 or 3 positive integers separated by commas, got {value[:64]!r}")
    return tuple(int(part) for part in parts)


def parse_dtype_header(value: str | None) -> WireDtype:
    name = (value or "float32").strip().lower()
    if name not in TORCH_DTYPES:
        raise InvalidInput(f"X-Dtype must be one of {sorted(TORCH_DTYPES)} (little-endian), got {name[:32]!r}")
    return name  # type: ignore[return-value]


def check_finite(rows: torch.Tensor) -> None:
    # numpy where it can (far cheaper per call than torch's dispatch); bfloat16 has no numpy dtype.
    finite = np.isfinite(rows.numpy()).all() if rows.dtype != torch.bfloat16 else torch.isfinite(rows).all()
    if not finite:
        raise InvalidInput("inputs must be finite numbers: found NaN or Infinity")


# ----- decoding -----------------------------------------------------------------------------


def decode_raw(body: bytearray, shape_header: str | None, dtype_header: str | None, d_model: int) -> DecodedInput:
    """application/octet-stream + X-Shape + X-Dtype, little-endian, C order. No copy."""
    shape = parse_shape_header(shape_header)
    dtype = parse_dtype_header(dtype_header)
    rows = check_shape(shape, d_model)
    expected = rows * d_model * ITEMSIZE[dtype]  # Python ints: no overflow, checked before any allocation
    if len(body) != expected:
        raise InvalidInput(
            f"body is {len(body)} bytes but X-Shape {list(shape)} of {dtype} needs {expected} bytes"
        )
    tensor = torch.frombuffer(body, dtype=TORCH_DTYPES[dtype]).view(rows, d_model)
    check_finite(tensor)
    return DecodedInput(tensor, shape, dtype)


def decode_npy(body: bytearray, d_model: int) -> DecodedInput:
    """application/x-npy: a version 1-3 .npy file, float32 or float16, little-endian, C order. No copy."""
    header, offset = _read_npy_header(body)
    descr, fortran_order, shape = header["descr"], header["fortran_order"], header["shape"]
    if not isinstance(descr, str) or descr not in NPY_DTYPES:
        raise InvalidInput(f".npy dtype must be little-endian float32 ('<f4') or float16 ('<f2'), got {descr!r}")
    if fortran_order is not False:
        raise InvalidInput(".npy array must be in C order (fortran_order False)")
    if not isinstance(shape, tuple) or not all(isinstance(d, int) for d in shape):
        raise InvalidInput(f".npy shape must be a tuple of integers, got {shape!r}")
    dtype = NPY_DTYPES[descr]
    rows = check_shape(shape, d_model)
    expected = rows * d_model * ITEMSIZE[dtype]
    if len(body) - offset != expected:
        raise InvalidInput(f".npy data is {len(body) - offset} bytes but shape {list(shape)} of {dtype} needs {expected}")
    tensor = torch.frombuffer(body, dtype=TORCH_DTYPES[dtype], offset=offset).view(rows, d_model)
    check_finite(tensor)
    return DecodedInput(tensor, shape, dtype)


def _read_npy_header(body: bytearray) -> tuple[dict[str, object], int]:
    """Parse the .npy header ourselves with ast.literal_eval: never np.load, so never pickle."""
    stream = io.BytesIO(memoryview(body)[:65536 + 12].tobytes())
    try:
        major, _ = np.lib.format.read_magic(stream)
        length_bytes = 2 if major == 1 else 4
        header_len = int.from_bytes(stream.read(length_bytes), "little")
        raw = stream.read(header_len)
        if len(raw) != header_len:
            raise ValueError("truncated header")
        header = ast.literal_eval(raw.decode("latin1" if major < 3 else "utf8"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise InvalidInput(f"body is not a valid .npy file: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise InvalidInput("body is not a valid .npy file: bad header dictionary")
    return header, stream.tell()


def decode_json(body: bytearray, d_model: int) -> DecodedInput:
    """{"inputs": [[...], ...]} (or [batch, seq, d_model]), numbers only, finite in float32."""
    document = loads_json(body)
    if not isinstance(document, dict) or "inputs" not in document:
        raise InvalidInput('JSON body must be an object {"inputs": [[...], ...]}')
    unknown = set(document) - {"inputs"}
    if unknown:
        raise InvalidInput(f"unknown fields {sorted(unknown)}; the body is {{\"inputs\": [[...], ...]}}")
    if body.count(b'"inputs"') > 1:
        raise InvalidInput('duplicate key "inputs" in the JSON body')
    array = json_numbers_to_array(document["inputs"], "inputs")
    rows = check_shape(array.shape, d_model)
    tensor = torch.from_numpy(array).view(rows, d_model)
    return DecodedInput(tensor, array.shape, "float32")


def loads_json(body: bytes | bytearray) -> object:
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


# ----- encoding -----------------------------------------------------------------------------


def to_wire_dtype(output: torch.Tensor, dtype: WireDtype) -> torch.Tensor:
    return output.to(TORCH_DTYPES[dtype]).contiguous()


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, little-endian, without a copy (bfloat16 through its 16-bit pattern)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")


def encode_json(model: str, output: torch.Tensor, shape: tuple[int, ...]) -> bytes:
    array = output.to(torch.float32).numpy().reshape(shape)
    return orjson.dumps(
        {"model": model, "shape": list(shape), "dtype": "float32", "outputs": array},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def encode_npy(output: torch.Tensor, shape: tuple[int, ...], dtype: WireDtype) -> bytes:
    if dtype == "bfloat16":
        raise NotAcceptable("numpy has no bfloat16: ask for application/octet-stream to get bfloat16 back")
    buffer = io.BytesIO()
    np.save(buffer, to_wire_dtype(output, dtype).numpy().reshape(shape), allow_pickle=False)
    return buffer.getvalue()
