"""Wire codecs: numpy arrays to request bodies and answers back to numpy, for every encoding.

Pure functions over bytes, shared by the `Client` and the load tester (which encodes a few
requests once and then only sends bytes). Raw tensors are little-endian, C order; bfloat16 is
the upper 16 bits of a float32, rounded to nearest even, and comes back as float32 because
numpy has no bfloat16.

Encodings:
    json       POST /v1/models/{m}/transform  {"inputs": [[...]]}; float32 only
    binary     same route, application/octet-stream + X-Shape/X-Dtype; float32/float16/bfloat16
    npy        same route, application/x-npy (an np.save file); float32/float16
    v2-json    POST /v2/models/{m}/infer, Open Inference Protocol JSON tensors; FP32/FP16/BF16
    v2-binary  same route, Triton's binary tensor data extension; FP32/FP16/BF16
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import numpy as np

from ffn_client.errors import ProtocolError

try:  # optional: several times faster for big JSON tensors; plain json otherwise
    import orjson

    HAVE_ORJSON = True
except ImportError:  # pragma: no cover - orjson is a server dependency, usually present
    HAVE_ORJSON = False

ENCODINGS = ("json", "binary", "npy", "v2-json", "v2-binary")
DTYPES = ("float32", "float16", "bfloat16")
SUPPORTED_DTYPES: dict[str, tuple[str, ...]] = {
    "json": ("float32",),
    "binary": DTYPES,
    "npy": ("float32", "float16"),
    "v2-json": DTYPES,
    "v2-binary": DTYPES,
}
V2_DATATYPES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}
DTYPE_OF_V2 = {v: k for k, v in V2_DATATYPES.items()}
V2_INPUT, V2_OUTPUT = "input", "output"  # tensor names in the server's V2 metadata

_WIRE: dict[str, np.dtype[Any]] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
_MEDIA = {"json": "application/json", "binary": "application/octet-stream", "npy": "application/x-npy"}


# -- bfloat16 ---------------------------------------------------------------------------------


def float32_to_bf16(array: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of `array`, rounded to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4")
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # no overflow: only NaNs are that big
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded = np.where(nan, (bits >> 16) | 0x0040, rounded)  # keep sign, force a quiet NaN
    return rounded.astype("<u2")


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact: bfloat16 is a truncated float32)."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def as_wire_values(array: np.ndarray, dtype: str) -> np.ndarray:
    """`array` as the server will see it in `dtype`: float32/float16, or bf16-rounded float32."""
    if dtype == "bfloat16":
        return bf16_to_float32(float32_to_bf16(array))
    return np.asarray(array, dtype=_WIRE[dtype].newbyteorder("="))


# -- raw bytes and .npy -----------------------------------------------------------------------


def to_bytes(array: np.ndarray, dtype: str) -> bytes:
    """Little-endian C-order bytes of `array` in `dtype` (float32, float16 or bfloat16)."""
    if dtype == "bfloat16":
        return float32_to_bf16(array).tobytes()
    return np.ascontiguousarray(array, dtype=_WIRE[dtype]).tobytes()


def from_bytes(buffer: bytes | memoryview, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The array in `buffer` (no copy for float32/float16); bfloat16 comes back as float32."""
    wire = _WIRE[dtype]
    expected = math.prod(shape) * wire.itemsize
    if len(buffer) != expected:
        raise ProtocolError(f"{dtype} tensor of shape {list(shape)} needs {expected} bytes, got {len(buffer)}")
    values = np.frombuffer(buffer, dtype=wire).reshape(shape)
    return bf16_to_float32(values) if dtype == "bfloat16" else values


def to_npy(array: np.ndarray) -> bytes:
    """An .npy file (np.save format) holding `array`."""
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(array), allow_pickle=False)
    return out.getvalue()


def from_npy(buffer: bytes) -> np.ndarray:
    """The array in an .npy file."""
    try:
        return np.load(io.BytesIO(buffer), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ProtocolError(f"answer is not a valid .npy file: {exc}") from None


def dumps(value: object) -> bytes:
    """Compact JSON bytes; numpy arrays are written as nested lists."""
    if HAVE_ORJSON:
        return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(value, separators=(",", ":"), default=lambda a: a.tolist()).encode()


def loads(data: bytes | memoryview) -> object:
    """Parsed JSON; a body that is not JSON is a ProtocolError."""
    try:
        return orjson.loads(data) if HAVE_ORJSON else json.loads(bytes(data))
    except ValueError as exc:
        raise ProtocolError(f"answer is not valid JSON: {exc}") from None


# -- whole requests -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodedRequest:
    """A ready-to-send POST: path, body and headers, plus what the answer must look like."""

    encoding: str
    path: str
    body: bytes
    headers: dict[str, str]
    shape: tuple[int, ...]  # the caller's shape; the answer comes back in it
    dtype: str

    @property
    def rows(self) -> int:
        """Rows (positions) in the request: every dimension but the last."""
        return math.prod(self.shape[:-1]) if self.shape else 0


def resolve_dtype(array: np.ndarray, encoding: str, dtype: str | None) -> str:
    """The wire dtype: `dtype` if given, else float16 for float16 arrays (a ValueError where the encoding has no
    float16: `json`), else float32."""
    if encoding not in SUPPORTED_DTYPES:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
    if dtype is None:
        if array.dtype == np.float16 and "float16" not in SUPPORTED_DTYPES[encoding]:
            # As documented (docs/client.md): never a silent change of type; the caller says float32 if it means it.
            raise ValueError(
                f"encoding {encoding!r} carries {', '.join(SUPPORTED_DTYPES[encoding])}, not this float16 array: "
                "pass dtype='float32' to send it as float32, or use an encoding that carries float16"
            )
        dtype = "float16" if array.dtype == np.float16 else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if dtype not in SUPPORTED_DTYPES[encoding]:
        raise ValueError(f"encoding {encoding!r} carries {', '.join(SUPPORTED_DTYPES[encoding])}, not {dtype}")
    return dtype


def encode_request(
    model: str,
    array: np.ndarray,
    encoding: str = "binary",
    dtype: str | None = None,
    timeout_ms: float | None = None,
    *,
    parameters: Mapping[str, int | float] | None = None,
    outputs: Sequence[str] = (V2_OUTPUT,),
) -> EncodedRequest:
    """The request that sends `array` ([rows, d_model] or [batch, seq, d_model]) to `model`.

    timeout_ms: the server-side deadline; the native routes read it from `X-Timeout-Ms`, the V2
    route from the request parameter `timeout` (in microseconds, as Triton has it).
    parameters: request parameters both protocols name alike (Monte Carlo dropout's): the query
    string of the native route, the request `parameters` of V2. outputs: the V2 outputs asked for.
    """
    array = np.asarray(array)
    if array.dtype.kind != "f" and array.dtype.kind not in "iu":
        raise ValueError(f"expected a numeric array, got dtype {array.dtype}")
    dtype = resolve_dtype(array, encoding, dtype)
    shape = tuple(int(n) for n in array.shape)
    if encoding.startswith("v2-"):
        v2_parameters = {**(parameters or {})}
        if timeout_ms is not None:
            v2_parameters["timeout"] = math.ceil(timeout_ms * 1000)  # integer microseconds
        body, headers = _v2_request(array, dtype, encoding == "v2-binary", v2_parameters, outputs)
        return EncodedRequest(encoding, f"/v2/models/{quote(model, safe='')}/infer", body, headers, shape, dtype)

    headers = {"Content-Type": _MEDIA[encoding], "Accept": _MEDIA[encoding]}
    if encoding == "json":
        body = dumps({"inputs": np.ascontiguousarray(array, dtype=np.float32)})
    elif encoding == "npy":
        body = to_npy(np.asarray(array, dtype=_WIRE[dtype]))
    else:
        body = to_bytes(array, dtype)
        headers["X-Shape"] = ",".join(map(str, shape))
        headers["X-Dtype"] = dtype
    if timeout_ms is not None:
        headers["X-Timeout-Ms"] = f"{timeout_ms:g}"
    query = f"?{urlencode(parameters)}" if parameters else ""
    path = f"/v1/models/{quote(model, safe='')}/transform{query}"
    return EncodedRequest(encoding, path, body, headers, shape, dtype)


def _v2_request(
    array: np.ndarray, dtype: str, binary: bool, parameters: Mapping[str, int | float], outputs: Sequence[str]
) -> tuple[bytes, dict[str, str]]:
    """An Open Inference Protocol request; [batch, seq, d] goes as [batch*seq, d] (V2 metadata)."""
    flat = array.reshape(-1, array.shape[-1]) if array.ndim > 2 else array
    tensor: dict[str, object] = {"name": V2_INPUT, "shape": list(flat.shape), "datatype": V2_DATATYPES[dtype]}
    document: dict[str, object] = {
        "inputs": [tensor],
        "outputs": [{"name": name, "parameters": {"binary_data": binary}} for name in outputs],
    }
    if parameters:
        document["parameters"] = dict(parameters)
    if not binary:
        tensor["data"] = as_wire_values(flat, dtype).astype(np.float32).ravel()
        return dumps(document), {"Content-Type": "application/json"}
    raw = to_bytes(flat, dtype)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = dumps(document)
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + raw, headers


# -- answers --------------------------------------------------------------------------------


def decode_response(request: EncodedRequest, headers: Mapping[str, str], body: bytes) -> np.ndarray:
    """The output array of a 200 answer to `request`, in the request's shape.

    `headers` must look names up case-insensitively (httpx.Headers does).
    """
    if request.encoding.startswith("v2-"):
        values = _decode_v2(headers, body)
        if values.size != math.prod(request.shape):
            raise ProtocolError(f"V2 output has shape {list(values.shape)}, expected {list(request.shape)}")
        values = values.reshape(request.shape)
    else:
        media = headers.get("content-type", "").split(";")[0].strip()
        if media == "application/octet-stream":
            values = _decode_raw(headers, body)
        elif media == "application/x-npy":
            values = from_npy(body)
        else:
            answer = loads(body)
            if not isinstance(answer, dict) or "outputs" not in answer:
                raise ProtocolError(f"JSON answer has no `outputs`: {bytes(body[:200])!r}")
            values = np.asarray(answer["outputs"], dtype=np.float32)
    if values.shape != request.shape:
        raise ProtocolError(f"answer has shape {list(values.shape)}, expected {list(request.shape)}")
    return values if values.flags.writeable else values.copy()  # frombuffer views are read-only


def _decode_raw(headers: Mapping[str, str], body: bytes) -> np.ndarray:
    shape_header, dtype = headers.get("x-shape"), headers.get("x-dtype", "")
    if shape_header is None or dtype not in DTYPES:
        raise ProtocolError(f"binary answer needs X-Shape and X-Dtype, got {shape_header!r}, {dtype!r}")
    try:
        shape = tuple(int(n) for n in shape_header.split(","))
    except ValueError:
        raise ProtocolError(f"bad X-Shape header {shape_header!r}") from None
    return from_bytes(body, shape, dtype)


def _decode_v2(headers: Mapping[str, str], body: bytes) -> np.ndarray:
    """The `output` tensor of a V2 answer (or its only tensor, whatever its name)."""
    _, tensors = v2_answer(headers, body)
    if V2_OUTPUT in tensors:
        return tensors[V2_OUTPUT]
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    raise ProtocolError(f"V2 answer has no output named {V2_OUTPUT!r}")


def v2_answer(headers: Mapping[str, str], body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A V2 answer's JSON document and its output tensors by name, JSON data or binary
    (Inference-Header-Content-Length)."""
    header_length = headers.get("inference-header-content-length")
    view = memoryview(body)
    if header_length is not None:
        try:
            split = int(header_length)
        except ValueError:
            raise ProtocolError(f"bad Inference-Header-Content-Length {header_length!r}") from None
        answer, binary = loads(view[:split]), view[split:]
    else:
        answer, binary = loads(view), view[:0]
    outputs = answer.get("outputs") if isinstance(answer, dict) else None
    if not isinstance(answer, dict) or not outputs:
        raise ProtocolError(f"V2 answer has no outputs: {bytes(view[:200])!r}")
    tensors, offset = {}, 0
    for output in outputs:  # binary tensors follow the JSON header in the order of `outputs`
        dtype = DTYPE_OF_V2.get(output.get("datatype", ""))
        if dtype is None:
            raise ProtocolError(f"V2 output has unsupported datatype {output.get('datatype')!r}")
        shape = tuple(int(n) for n in output.get("shape", ()))
        size = (output.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            tensors[str(output.get("name"))] = from_bytes(binary[offset : offset + size], shape, dtype)
            offset += size
            continue
        data = np.asarray(output.get("data", []), dtype=np.float32)
        if data.size != math.prod(shape):
            raise ProtocolError(f"V2 output `data` has {data.size} values for shape {list(shape)}")
        tensors[str(output.get("name"))] = (
            data.reshape(shape) if dtype != "float16" else data.astype(np.float16).reshape(shape)
        )
    return answer, tensors
