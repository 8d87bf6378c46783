"""Native wire formats: request bodies -> a (rows, d_model) tensor, outputs -> response bodies.

JSON `{"inputs": [[...]]}`, raw little-endian bytes with X-Shape and X-Dtype, or an .npy file;
the Accept header picks the answer's encoding among the same three. Everything a client can
get wrong is refused here, before the batcher. Binary bodies are decoded without a copy.

Monte Carlo dropout is asked for in the query string (`?mc_passes=32&mc_seed=7&mc_dropout=0.1`),
whatever the body's encoding. Its answer: JSON `{"model", "shape", "dtype", "mc_passes",
"mc_dropout", "mc_seed", "mean", "std"}`; raw bytes or `.npy` hold the two stacked, shape
[2, *shape] (index 0 the mean, 1 the std). Every encoding carries the parameters used as X-MC-* headers.
"""

from __future__ import annotations

import ast
import io
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl

import numpy as np
import orjson

from app.engine.montecarlo import MonteCarloRequest, MonteCarloResult
from app.protocol import mc_parameters
from app.protocol.errors import InvalidInput, NotAcceptable, UnsupportedMediaType
from app.protocol.fields import media_type, quality_rated
from app.protocol.limits import NPY_MAX_HEADER
from app.protocol.tensors import (
    MAX_RANK,
    check_finite_output,
    check_shape,
    json_numbers_to_array,
    raw_bytes,
    read_json_body,
    view_rows,
)
from ffn_core.dtypes import BY_NUMPY, DTYPE_NAMES, DTYPES, DType

Encoding = Literal["json", "raw", "npy"]

MEDIA_TYPES: dict[str, Encoding] = {
    "application/json": "json",
    "application/octet-stream": "raw",
    "application/x-npy": "npy",
}
MEDIA_TYPE_OF: dict[Encoding, str] = {encoding: media for media, encoding in MEDIA_TYPES.items()}
FLOAT32 = DTYPES["float32"]
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # an object's repr names where it lives


@dataclass(frozen=True)
class DecodedInput:
    """A request's rows, flattened to (rows, d_model), and its shape and dtype.

    `rows` carries the body's dtype (app/engine/facade.py): a view of a binary body, or the array a JSON body was parsed to.
    """

    rows: np.ndarray
    shape: tuple[int, ...]
    dtype: DType


# ----- content negotiation ------------------------------------------------------------------


def request_encoding(content_type: str | None) -> Encoding:
    """The body's encoding from Content-Type; no Content-Type is read as JSON."""
    media = media_type(content_type)
    if media is None:
        return "json"
    try:
        return MEDIA_TYPES[media]
    except KeyError:
        raise UnsupportedMediaType(
            f"Content-Type {media[:64]!r} is not supported; use one of {sorted(MEDIA_TYPES)}"
        ) from None


def response_encoding(accept: str | None) -> Encoding:
    """The answer's encoding from Accept (highest q first); none or */* is JSON."""
    if not accept:
        return "json"
    ranges = [(-q, position, media) for position, (media, q) in enumerate(quality_rated(accept)) if q > 0 and media]
    for _, _, media in sorted(ranges):
        if media in MEDIA_TYPES:
            return MEDIA_TYPES[media]
        if media in ("*/*", "application/*"):
            return "json"
    raise NotAcceptable(f"cannot answer in {accept[:128]!r}; Accept one of {sorted(MEDIA_TYPES)}")


# ----- headers ------------------------------------------------------------------------------


def parse_shape_header(value: str | None) -> tuple[int, ...]:
    """X-Shape: comma-separated positive decimal integers, e.g. '7,512'."""
    if value is None:
        raise InvalidInput("binary body needs an X-Shape header, e.g. 'X-Shape: 7,512'")
    parts = [part.strip() for part in value.split(",")]
    if len(parts) > MAX_RANK or not all(part.isdigit() and part.isascii() and len(part) <= 18 for part in parts):
        raise InvalidInput(f"X-Shape must be 2 or 3 positive integers separated by commas, got {value[:64]!r}")
    return tuple(int(part) for part in parts)


def parse_dtype_header(value: str | None) -> DType:
    name = (value or "float32").strip().lower()
    if name not in DTYPES:
        raise InvalidInput(f"X-Dtype must be one of {sorted(DTYPE_NAMES)} (little-endian), got {name[:32]!r}")
    return DTYPES[name]


# ----- decoding -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RawLayout:
    """What a raw body's headers say it holds: its shape, dtype, rows and size in bytes (checked against d_model)."""

    shape: tuple[int, ...]
    dtype: DType
    rows: int
    d_model: int
    nbytes: int

    def rows_of(self, body: bytes | bytearray | memoryview) -> DecodedInput:
        """The body's rows, viewed in it without a copy: refused unless it is exactly `nbytes` of finite numbers."""
        if len(body) != self.nbytes:
            raise InvalidInput(
                f"body is {len(body)} bytes but X-Shape {list(self.shape)} of {self.dtype.name} needs {self.nbytes} bytes"
            )
        return DecodedInput(view_rows(body, self.dtype, self.rows, self.d_model), self.shape, self.dtype)


def raw_layout(shape_header: str | None, dtype_header: str | None, d_model: int) -> RawLayout:
    """X-Shape and X-Dtype read and checked against the model: what a raw body must then hold."""
    shape = parse_shape_header(shape_header)
    dtype = parse_dtype_header(dtype_header)
    rows = check_shape(shape, d_model)
    # Python ints: no overflow, checked before any allocation.
    return RawLayout(shape, dtype, rows, d_model, rows * d_model * dtype.itemsize)


def decode_raw(
    body: bytes | bytearray, shape_header: str | None, dtype_header: str | None, d_model: int
) -> DecodedInput:
    """application/octet-stream + X-Shape + X-Dtype, little-endian, C order. No copy."""
    return raw_layout(shape_header, dtype_header, d_model).rows_of(body)


def decode_npy(body: bytes | bytearray, d_model: int) -> DecodedInput:
    """application/x-npy: a version 1-3 .npy file, float32 or float16, little-endian, C order. No copy."""
    header, offset = _read_npy_header(body)
    dtype, shape = _npy_fields(header)
    rows = check_shape(shape, d_model)
    expected = rows * d_model * dtype.itemsize
    if len(body) - offset != expected:
        raise InvalidInput(
            f".npy data is {len(body) - offset} bytes but shape {list(shape)} of {dtype.name} needs {expected}"
        )
    return DecodedInput(view_rows(body, dtype, rows, d_model, offset), shape, dtype)


def _read_npy_header(body: bytes | bytearray) -> tuple[object, int]:
    """Parse the .npy header ourselves with ast.literal_eval: never np.load, so never pickle."""
    stream = io.BytesIO(memoryview(body)[: NPY_MAX_HEADER + 12].tobytes())
    try:
        major, _ = np.lib.format.read_magic(stream)
        if major not in (1, 2, 3):
            raise ValueError(f"unknown format version {major}")
        length_bytes = 2 if major == 1 else 4
        header_len = int.from_bytes(stream.read(length_bytes), "little")
        raw = stream.read(header_len)
        if len(raw) != header_len:
            raise ValueError("truncated header")
        # TypeError: an unhashable key or set member ({[1]: 2}); the literal is built before we see it.
        header = ast.literal_eval(raw.decode("latin1" if major < 3 else "utf8"))
    except (ValueError, TypeError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        # ast's messages name a node by its repr, memory address included: never sent to a client.
        reason = _ADDRESS.sub("", str(exc))[:200]
        raise InvalidInput(f"body is not a valid .npy file: {reason}") from None
    return header, stream.tell()


def _npy_fields(header: object) -> tuple[DType, tuple[int, ...]]:
    """The dtype and shape of a .npy header dict, every field type-checked."""
    if (
        not isinstance(header, dict)
        or not all(isinstance(key, str) for key in header)
        or set(header) != {"descr", "fortran_order", "shape"}
    ):
        raise InvalidInput("body is not a valid .npy file: the header must be a dict of descr, fortran_order, shape")
    descr, fortran_order, shape = header["descr"], header["fortran_order"], header["shape"]
    if not isinstance(descr, str) or descr not in BY_NUMPY:
        raise InvalidInput(
            f".npy dtype must be one of {sorted(BY_NUMPY)} (little-endian float), got {str(descr)[:32]!r}"
        )
    if fortran_order is not False:
        raise InvalidInput(".npy array must be in C order (fortran_order False)")
    if not isinstance(shape, tuple) or not all(type(dim) is int for dim in shape):  # bool is not a dimension
        raise InvalidInput(f".npy shape must be a tuple of integers, got {str(shape)[:64]}")
    return BY_NUMPY[descr], shape


def decode_json(body: bytes | bytearray, d_model: int, max_rows: int) -> DecodedInput:
    """{"inputs": [[...], ...]} (or [batch, seq, d_model]), numbers only, finite in float32.

    A body with more arrays or values than `max_rows` rows, or more than MAX_OTHER_BYTES besides
    its "inputs" array, is refused before it is parsed.
    """
    parsed = read_json_body(body, "inputs", max_rows, d_model)
    document = parsed.envelope
    if not isinstance(document, dict) or "inputs" not in document:
        raise InvalidInput('JSON body must be an object {"inputs": [[...], ...]}')
    unknown = set(document) - {"inputs"}
    if unknown:
        raise InvalidInput(f'unknown fields {sorted(unknown)}; the body is {{"inputs": [[...], ...]}}')
    if parsed.sightings > 1:
        raise InvalidInput('duplicate key "inputs" in the JSON body')
    array = json_numbers_to_array(parsed.tensor(document["inputs"]), "inputs", parsed.tensor_text, FLOAT32)
    rows = check_shape(array.shape, d_model)
    return DecodedInput(array.reshape(rows, d_model), array.shape, FLOAT32)


# ----- encoding -----------------------------------------------------------------------------


def check_answerable(encoding: Encoding, dtype: DType) -> None:
    """Refuse, before any compute, an answer the encoding cannot carry (.npy has no bfloat16)."""
    if encoding == "npy" and dtype.numpy is None:
        raise NotAcceptable(f"numpy has no {dtype.name}: Accept application/octet-stream for a {dtype.name} answer")


def answer_dtype(decoded: DecodedInput, encoding: Encoding) -> DType:
    """The dtype the engine answers in: float32 for JSON, else the request's own."""
    return FLOAT32 if encoding == "json" else decoded.dtype


def encode(
    model: str, output: np.ndarray, decoded: DecodedInput, encoding: Encoding
) -> tuple[bytes | memoryview, dict[str, str]]:
    """The answer's body and headers (Content-Type included) in `encoding`; `output` carries answer_dtype's dtype.

    An answer holding inf or NaN is refused (422).
    """
    check_finite_output(output)
    if encoding == "json":
        body = orjson.dumps(
            {
                "model": model,
                "shape": list(decoded.shape),
                "dtype": "float32",
                "outputs": output.reshape(decoded.shape),
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        return body, {"content-type": MEDIA_TYPE_OF["json"]}
    if encoding == "npy":
        check_answerable(encoding, decoded.dtype)
        buffer = io.BytesIO()
        np.save(buffer, output.reshape(decoded.shape), allow_pickle=False)
        return buffer.getvalue(), {"content-type": MEDIA_TYPE_OF["npy"]}
    return raw_bytes(output), {
        "content-type": MEDIA_TYPE_OF["raw"],
        "x-shape": ",".join(map(str, decoded.shape)),
        "x-dtype": decoded.dtype.name,
    }


# ----- Monte Carlo dropout ------------------------------------------------------------------

MC_HEADERS = {
    mc_parameters.PASSES: "x-mc-passes",
    mc_parameters.DROPOUT: "x-mc-dropout",
    mc_parameters.SEED: "x-mc-seed",
}


def query_parameters(query: bytes) -> dict[str, str]:
    """The query string's Monte Carlo parameters; any other name, or one given twice, is refused."""
    try:
        pairs = parse_qsl(query.decode("ascii"), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        raise InvalidInput(f"malformed query string {query[:64]!r}") from None
    values: dict[str, str] = {}
    for name, value in pairs:
        if name not in mc_parameters.NAMES:
            raise InvalidInput(f"unknown query parameter {name[:32]!r}; this route takes {list(mc_parameters.NAMES)}")
        if name in values:
            raise InvalidInput(f"query parameter {name!r} given twice")
        values[name] = value
    return values


def encode_monte_carlo(
    model: str, result: MonteCarloResult, request: MonteCarloRequest, decoded: DecodedInput, encoding: Encoding
) -> tuple[bytes | memoryview, dict[str, str]]:
    """The answer's body and headers in `encoding`: JSON with mean and std, or the two stacked.

    `result` carries answer_dtype's dtype; inf or NaN in it is refused (422), as in a plain answer.
    """
    parameters = mc_parameters.echoed(request)
    headers = {MC_HEADERS[name]: str(value) for name, value in parameters.items()}
    if encoding == "json":
        check_finite_output(result.mean)
        check_finite_output(result.std)
        body = orjson.dumps(
            {
                "model": model,
                "shape": list(decoded.shape),
                "dtype": "float32",
                **parameters,
                "mean": result.mean.reshape(decoded.shape),
                "std": result.std.reshape(decoded.shape),
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        return body, {"content-type": MEDIA_TYPE_OF["json"], **headers}
    stacked = np.stack([result.mean, result.std])  # (2, rows, d_model)
    check_finite_output(stacked)
    shape = (2, *decoded.shape)
    if encoding == "npy":
        buffer = io.BytesIO()
        np.save(buffer, stacked.reshape(shape), allow_pickle=False)
        return buffer.getvalue(), {"content-type": MEDIA_TYPE_OF["npy"], **headers}
    return raw_bytes(stacked), {
        "content-type": MEDIA_TYPE_OF["raw"],
        "x-shape": ",".join(map(str, shape)),
        "x-dtype": decoded.dtype.name,
        **headers,
    }
