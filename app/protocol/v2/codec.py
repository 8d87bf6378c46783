"""Open Inference Protocol (KServe V2) infer bodies, with Triton's binary tensor data extension.

Request: a JSON object, optionally followed by raw tensor bytes when the header
`Inference-Header-Content-Length` gives the JSON part's length; an input whose parameters
hold `binary_data_size` takes its data from those bytes, in input order. Response: JSON, or a
JSON header followed by the outputs asked for with `binary_data` (or `binary_data_output`).

System shared memory: an input or output whose parameters name a registered region
(`shared_memory_region`, `shared_memory_byte_size`, optionally `shared_memory_offset`) is read
from or written to it instead (app/protocol/shared_memory.py), checked against the region before the
request is queued; such an output is described in the answer without data, as in Triton.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from app.observe import identity
from app.protocol import mc_parameters, tensors
from app.protocol.errors import InvalidInput, PayloadTooLarge, UnsupportedExtension, UnsupportedMediaType
from app.protocol.fields import (
    bool_field,
    header_int,
    int_field,
    list_field,
    media_type,
    number_field,
    parameters_field,
    str_field,
)
from app.protocol.shared_memory import Region, SharedMemoryRegions, turned_off
from ffn_core.dtypes import BY_V2, DType

SERVER_NAME = "ffn-serve"
PLATFORM = "pytorch_ffn"
INPUT_NAME = "input"
OUTPUT_NAME = "output"
# Monte Carlo dropout answers `output` (the mean over the passes) and this (their standard deviation).
STD_OUTPUT_NAME = "output_std"
OUTPUT_NAMES = (OUTPUT_NAME, STD_OUTPUT_NAME)
HEADER_LENGTH = "inference-header-content-length"
# JSON bodies; with the binary extension the body is a JSON header followed by raw bytes.
MEDIA_TYPES = ("application/json", "application/octet-stream")


@dataclass(frozen=True)
class SharedMemorySpan:
    """Where in a registered region a tensor is, checked to lie inside it."""

    region: Region
    offset: int
    byte_size: int

    def read(self, what: str) -> bytearray:
        """The span's bytes, copied out of the region (the client cannot change them under the batch)."""
        return self.region.read(self.offset, self.byte_size, what)

    def write(self, data: memoryview, what: str) -> None:
        """`data` written at the span's start (the caller has checked that it fits)."""
        self.region.write(self.offset, data, what)


@dataclass(frozen=True)
class V2Request:
    rows: np.ndarray  # (rows, d_model), carrying its data's dtype (app/engine/facade.py)
    shape: tuple[int, ...]
    dtype: DType
    id: str | None
    outputs: dict[str, bool] | None  # output name -> binary, as asked; None: every output the answer has
    binary_output: bool  # binary_data_output: the default for outputs that do not say
    parameters: dict[str, Any]  # the request's parameters: timeout, binary_data_output, mc_passes, ...
    timeout_us: float | None  # the `timeout` parameter, microseconds as in Triton; None when absent
    binary_input: bool  # `rows` is a view of the body's binary section (else an array of its own: JSON, shared memory)
    shared_memory_outputs: dict[str, SharedMemorySpan] = field(default_factory=dict)  # written there, not sent


def check_content(content_type: str | None) -> None:
    """Refuse bodies of another media type before reading them."""
    media = media_type(content_type)
    if media is not None and media not in MEDIA_TYPES:
        raise UnsupportedMediaType(f"Content-Type {media[:64]!r} is not supported; use one of {list(MEDIA_TYPES)}")


def decode(
    body: bytes | bytearray,
    header_length: str | None,
    d_model: int,
    max_rows: int,
    shared_memory: SharedMemoryRegions | None = None,
    max_bytes: int = 0,
) -> V2Request:
    """An infer request's one input tensor and its options; every field type-checked (400).

    A JSON part with more arrays or values than `max_rows` rows, or more than MAX_OTHER_BYTES
    besides the input's `data` array, is refused before it is parsed (413); the envelope is
    parsed and checked (parameters are scalars: 400) before the input's data is parsed.
    `shared_memory`: the registered regions (None: the extension is off). An input read from one
    counts against `max_bytes`, the body limit, as a body would: it is copied into memory too.
    """
    json_end = _json_length(header_length, len(body))
    json_part = memoryview(body)[:json_end] if json_end < len(body) else body
    parsed = tensors.read_json_body(json_part, "data", max_rows, d_model)
    document = parsed.envelope
    if not isinstance(document, dict):
        raise InvalidInput("infer request must be a JSON object")
    request_id = str_field(document, "id", "request")
    identity.named(request_id)  # from here on, an error answer carries the request's `id` too
    parameters = parameters_field(document, "request")
    timeout_us = number_field(parameters, "timeout", "request parameter", minimum=0)
    inputs = list_field(document, "inputs", "request") or []
    check_one_input(len(inputs))
    tensor = inputs[0]
    if not isinstance(tensor, dict):
        raise InvalidInput(f"expected exactly one input tensor named {INPUT_NAME!r}")
    name, datatype = str_field(tensor, "name", "input"), str_field(tensor, "datatype", "input")
    input_parameters = parameters_field(tensor, "input")
    head = check_head(name, datatype, _shape(tensor.get("shape")), d_model, parameters, input_parameters)
    dtype, shape, rows = head.dtype, head.shape, head.rows
    binary_output = bool_field(parameters, "binary_data_output", "request parameter") or False
    # Before any tensor data is parsed: every field of the envelope is checked first.
    outputs, in_shared_memory = _requested_outputs(document, binary_output, head, shared_memory)
    binary_size = int_field(input_parameters, "binary_data_size", "input parameter", minimum=0)
    if SHARED_MEMORY_REGION in input_parameters:
        if shared_memory is None:  # the extension is named first: nothing else about it matters then
            raise turned_off()
        if "data" in tensor or binary_size is not None:
            raise InvalidInput("an input must set only one of 'data', 'binary_data_size' and 'shared_memory_region'")
        if json_end != len(body):
            raise InvalidInput("binary data follows the JSON header but the input is in shared memory")
        values = shared_memory_tensor(input_parameters, shared_memory, shape, rows, d_model, dtype, max_rows, max_bytes)
    elif binary_size is not None:
        if "data" in tensor:
            raise InvalidInput("an input with binary_data_size must not also carry 'data'")
        values = _binary_tensor(body, json_end, binary_size, shape, rows, d_model, dtype)
    else:
        if json_end != len(body):
            raise InvalidInput("binary data follows the JSON header but no input declares binary_data_size")
        values = _json_tensor(parsed.tensor(tensor.get("data")), parsed.tensor_text, shape, rows, d_model, dtype)
    return V2Request(
        values,
        shape,
        dtype,
        request_id,
        outputs,
        binary_output,
        parameters,
        timeout_us,
        binary_size is not None,
        in_shared_memory,
    )


@dataclass(frozen=True)
class InputHead:
    """What the V2 check order settles before any tensor data is read (check_head)."""

    dtype: DType
    shape: tuple[int, ...]
    rows: int
    monte_carlo: bool  # the request's parameters ask for Monte Carlo dropout
    output_bytes: int  # one output's size: rows x d_model of the dtype


def check_one_input(count: int) -> None:
    """The V2 check order's first step (both doors): a request carries exactly one input tensor."""
    if count != 1:
        raise InvalidInput(f"expected exactly one input tensor named {INPUT_NAME!r}")


def check_head(
    name: str | None,
    datatype: str | None,
    shape: Sequence[int],
    d_model: int,
    parameters: Mapping[str, Any],
    input_parameters: Mapping[str, Any],
) -> InputHead:
    """The V2 check order, written once for both doors: after check_one_input, the input's name and
    datatype, its shape, then no extension asked for; then check_outputs; only then its data."""
    dtype = check_input(name, datatype)
    rows = tensors.check_shape(shape, d_model)
    refuse_extensions(parameters, input_parameters)
    monte_carlo = bool(parameters) and mc_parameters.asks_for_monte_carlo(parameters)
    return InputHead(dtype, tuple(shape), rows, monte_carlo, rows * d_model * dtype.itemsize)


def check_input(name: str | None, datatype: str | None) -> DType:
    """The input's dtype, once its name is the model's input and its datatype one served (both doors)."""
    if name != INPUT_NAME:
        raise InvalidInput(f"unexpected input {str(name)[:64]!r}; this model's input is {INPUT_NAME!r}")
    dtype = BY_V2.get(datatype) if datatype is not None else None
    if dtype is None:
        raise InvalidInput(f"datatype must be one of {sorted(BY_V2)}, got {str(datatype)[:16]!r}")
    return dtype


SHARED_MEMORY_REGION = "shared_memory_region"
# Request parameters of extensions this server does not implement: refused, never ignored.
_SEQUENCE = ("sequence", "an FFN is position-wise and keeps no sequence state")
_EXTENSION_PARAMETERS = {
    "sequence_id": _SEQUENCE,
    "sequence_start": _SEQUENCE,
    "sequence_end": _SEQUENCE,
    "priority": ("schedule_policy", "each model has one first-come queue; of its parameters only 'timeout' is served"),
}


def refuse_extensions(parameters: Mapping[str, Any], input_parameters: Mapping[str, Any]) -> None:
    """Refuse a request that relies on an extension we do not implement, naming it (both doors)."""
    for name, (extension, detail) in _EXTENSION_PARAMETERS.items():
        if name in parameters:
            raise UnsupportedExtension(extension, f"parameter {name!r} was sent, but {detail}")


def shared_memory_span(parameters: dict[str, Any], regions: SharedMemoryRegions | None, where: str) -> SharedMemorySpan:
    """The registered region, offset and size a tensor's parameters name, checked to lie in the region.

    `parameters` is the tensor's parameters as a dict: the gRPC door reads its own into one and calls this.
    """
    if regions is None:
        raise turned_off()
    name = str_field(parameters, SHARED_MEMORY_REGION, f"{where} parameter")
    size = int_field(parameters, "shared_memory_byte_size", f"{where} parameter", minimum=0)
    offset = int_field(parameters, "shared_memory_offset", f"{where} parameter", minimum=0) or 0
    if name is None or size is None:
        raise InvalidInput(f"{where}: shared_memory_region and shared_memory_byte_size go together")
    region = regions.get(name)  # 404 when not registered
    region.check_span(offset, size, where)
    return SharedMemorySpan(region, offset, size)


def shared_memory_output_span(
    name: str, parameters: dict[str, Any], regions: SharedMemoryRegions | None, output_bytes: int
) -> SharedMemorySpan:
    """Where output `name` is to be written, checked to hold its `output_bytes` (both doors)."""
    span = shared_memory_span(parameters, regions, f"output {name!r}")
    if span.byte_size < output_bytes:
        raise InvalidInput(
            f"output {name!r}: shared_memory_byte_size is {span.byte_size} but the output needs {output_bytes}"
        )
    return span


def shared_memory_tensor(
    parameters: dict[str, Any],
    regions: SharedMemoryRegions | None,
    shape: tuple[int, ...],
    rows: int,
    d_model: int,
    dtype: DType,
    max_rows: int,
    max_bytes: int,
) -> np.ndarray:
    """The input's rows, copied out of its region (the client cannot change them under the batch)."""
    span = shared_memory_span(parameters, regions, "input")
    expected = rows * d_model * dtype.itemsize
    if span.byte_size != expected:
        raise InvalidInput(
            f"shared_memory_byte_size is {span.byte_size} but shape {list(shape)} of {dtype.v2} needs {expected}"
        )
    if rows > max_rows or expected > max_bytes:
        raise PayloadTooLarge(
            f"an input of {rows} rows ({expected} bytes) in shared memory exceeds what a request may hold "
            f"({max_rows} rows, {max_bytes} bytes: the body limit)"
        )
    data = span.read("input")
    return tensors.view_rows(data, dtype, rows, d_model)


def _json_length(header_length: str | None, body_length: int) -> int:
    length = header_int(header_length, "Inference-Header-Content-Length")
    if length is None:
        return body_length
    if length > body_length:
        raise InvalidInput(f"Inference-Header-Content-Length {length} exceeds the body's {body_length} bytes")
    return length


def _shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise InvalidInput("input 'shape' must be a list of integers")
    return tuple(value)


def _binary_tensor(
    body: bytes | bytearray, json_end: int, size: int, shape: tuple[int, ...], rows: int, d_model: int, dtype: DType
) -> np.ndarray:
    expected = rows * d_model * dtype.itemsize
    if size != expected:
        raise InvalidInput(f"binary_data_size is {size} but shape {list(shape)} of {dtype.v2} needs {expected}")
    if len(body) - json_end != size:
        raise InvalidInput(f"binary section is {len(body) - json_end} bytes but binary_data_size says {size}")
    return tensors.view_rows(body, dtype, rows, d_model, json_end)


def _json_tensor(
    data: object, source: bytes | bytearray | memoryview, shape: tuple[int, ...], rows: int, d_model: int, dtype: DType
) -> np.ndarray:
    if data is None:
        raise InvalidInput("input has neither 'data' nor parameters.binary_data_size")
    array = tensors.json_numbers_to_array(data, "data", source, dtype)
    if array.size != math.prod(shape) or (array.ndim > 1 and array.shape != shape):
        raise InvalidInput(f"'data' holds {array.size} values in shape {list(array.shape)}; shape says {list(shape)}")
    return array.reshape(rows, d_model)  # float32, whatever the datatype: the answer is rounded to it


def _requested_outputs(
    document: dict[str, Any], binary_output: bool, head: InputHead, regions: SharedMemoryRegions | None
) -> tuple[dict[str, bool] | None, dict[str, SharedMemorySpan]]:
    """Output name -> binary for each output asked for (its binary_data, else binary_data_output), and
    the outputs to write to shared memory instead, each span checked to hold one output."""
    outputs = list_field(document, "outputs", "request")
    if not outputs:  # none named: every output, as in Triton
        return None, {}
    if not all(isinstance(o, dict) for o in outputs):
        raise InvalidInput("'outputs' must be a list of objects")
    named = [(str_field(output, "name", "output"), parameters_field(output, "output")) for output in outputs]
    return check_outputs(named, head, regions, binary_output=binary_output)


def check_outputs(
    outputs: Sequence[tuple[str | None, dict[str, Any]]],
    head: InputHead,
    regions: SharedMemoryRegions | None,
    *,
    binary_output: bool | None = None,
) -> tuple[dict[str, bool], dict[str, SharedMemorySpan]]:
    """The outputs asked for, in the V2 check order's second step (both doors; before any tensor data).

    Each output's name and extensions (check_output), then, where `binary_output` is given (HTTP:
    the request's binary_data_output), its `binary_data` choice; then its shared-memory span, checked
    to hold one output. Returns output name -> binary (False where the door has no such choice),
    and the outputs to write to shared memory.
    """
    wanted: dict[str, bool] = {}
    in_shared_memory: dict[str, SharedMemorySpan] = {}
    for given, output_parameters in outputs:
        name = check_output(given, output_parameters, head.monte_carlo)
        chosen = None
        if binary_output is not None:
            chosen = bool_field(output_parameters, "binary_data", "output parameter")
        if SHARED_MEMORY_REGION in output_parameters:
            if chosen:
                raise InvalidInput(f"output {name!r} cannot set both shared_memory_region and binary_data")
            in_shared_memory[name] = shared_memory_output_span(name, output_parameters, regions, head.output_bytes)
        wanted[name] = bool(binary_output) if chosen is None else chosen
    return wanted, in_shared_memory


def check_output(name: str | None, output_parameters: Mapping[str, Any], monte_carlo: bool) -> str:
    """A requested output's name, once it is one this request answers and asks for no extension (both doors)."""
    if name not in OUTPUT_NAMES:
        raise InvalidInput(
            f"unknown output {str(name)[:64]!r}; this model's outputs are {list(OUTPUT_NAMES)} "
            f"({STD_OUTPUT_NAME!r} with Monte Carlo dropout only)"
        )
    if name == STD_OUTPUT_NAME and not monte_carlo:
        raise InvalidInput(
            f"output {STD_OUTPUT_NAME!r} is answered only by Monte Carlo dropout requests: "
            f"add parameters.{mc_parameters.PASSES}"
        )
    if "classification" in output_parameters:
        raise UnsupportedExtension("classification", "outputs are embeddings, not class scores")
    return name


def encode(
    model: str,
    version: int,
    request: V2Request,
    answers: dict[str, np.ndarray],
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The response body and headers: JSON, or a JSON header followed by the binary outputs.

    `answers` holds every output the answer has, by name, carrying the request's dtype (the engine's
    answer); the request's `outputs` pick among them, and one holding inf or NaN is refused (422).
    """
    wanted = request.outputs if request.outputs is not None else dict.fromkeys(answers, request.binary_output)
    described_outputs: list[dict[str, Any]] = []
    answer: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": described_outputs}
    if request.id is not None:
        answer["id"] = request.id
    if parameters:
        answer["parameters"] = parameters
    blobs: list[memoryview] = []
    for name, binary in wanted.items():
        wire = answers[name]
        tensors.check_finite_output(wire)
        described: dict[str, Any] = {"name": name, "datatype": request.dtype.v2, "shape": list(request.shape)}
        span = request.shared_memory_outputs.get(name)
        if span is not None:  # written to the region; the answer describes it without data, as Triton's
            span.write(tensors.raw_bytes(wire), f"output {name!r}")
        elif binary:
            blob = tensors.raw_bytes(wire)
            described["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            described["data"] = tensors.as_float32(wire).reshape(-1)
        described_outputs.append(described)
    header = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, {"content-type": "application/json"}
    return b"".join([header, *blobs]), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
