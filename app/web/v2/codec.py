"""Open Inference Protocol (KServe V2) infer bodies, with Triton's binary tensor data extension.

Request: a JSON object, optionally followed by raw tensor bytes when the header
`Inference-Header-Content-Length` gives the JSON part's length; an input whose parameters
hold `binary_data_size` takes its data from those bytes, in input order. Response: JSON, or a
JSON header followed by the outputs asked for with `binary_data` (or `binary_data_output`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from app.web import mc_parameters, tensors
from app.web.errors import InvalidInput, UnsupportedExtension, UnsupportedMediaType
from app.web.fields import bool_field, header_int, int_field, list_field, number_field, object_field, str_field
from app.web.http import media_type, refuse_content_encoding
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
class V2Request:
    rows: torch.Tensor  # (rows, d_model)
    shape: tuple[int, ...]
    dtype: DType
    id: str | None
    outputs: dict[str, bool] | None  # output name -> binary, as asked; None: every output the answer has
    binary_output: bool  # binary_data_output: the default for outputs that do not say
    parameters: dict[str, Any]  # the request's parameters: timeout, binary_data_output, mc_passes, ...
    timeout_us: float | None  # the `timeout` parameter, microseconds as in Triton; None when absent
    binary_input: bool  # `rows` is a view of the body's binary section (else parsed from JSON: a tensor of its own)


def check_content(content_type: str | None, content_encoding: str | None) -> None:
    """Refuse bodies of another media type, or compressed ones, before reading them."""
    refuse_content_encoding(content_encoding)
    media = media_type(content_type)
    if media is not None and media not in MEDIA_TYPES:
        raise UnsupportedMediaType(f"Content-Type {media[:64]!r} is not supported; use one of {list(MEDIA_TYPES)}")


def decode(body: bytearray, header_length: str | None, d_model: int, max_rows: int) -> V2Request:
    """An infer request's one input tensor and its options; every field type-checked (400).

    A JSON part with more arrays or values than `max_rows` rows is refused before it is parsed.
    """
    json_end = _json_length(header_length, len(body))
    json_part = memoryview(body)[:json_end] if json_end < len(body) else body
    tensors.check_json_counts(json_part, max_rows, d_model)
    document = tensors.loads_json(json_part)
    if not isinstance(document, dict):
        raise InvalidInput("infer request must be a JSON object")
    request_id = str_field(document, "id", "request")
    parameters = object_field(document, "parameters", "request")
    timeout_us = number_field(parameters, "timeout", "request parameter", minimum=0)
    inputs = list_field(document, "inputs", "request")
    if inputs is None or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InvalidInput(f"expected exactly one input tensor named {INPUT_NAME!r}")
    tensor = inputs[0]
    name = str_field(tensor, "name", "input")
    if name != INPUT_NAME:
        raise InvalidInput(f"unexpected input {str(name)[:64]!r}; this model's input is {INPUT_NAME!r}")
    datatype = str_field(tensor, "datatype", "input")
    dtype = BY_V2.get(datatype) if datatype is not None else None
    if dtype is None:
        raise InvalidInput(f"datatype must be one of {sorted(BY_V2)}, got {str(datatype)[:16]!r}")
    shape = _shape(tensor.get("shape"))
    rows = tensors.check_shape(shape, d_model)
    input_parameters = object_field(tensor, "parameters", "input")
    _refuse_extensions(parameters, input_parameters)
    binary_size = int_field(input_parameters, "binary_data_size", "input parameter", minimum=0)
    if binary_size is not None:
        if "data" in tensor:
            raise InvalidInput("an input with binary_data_size must not also carry 'data'")
        values = _binary_tensor(body, json_end, binary_size, shape, rows, d_model, dtype)
    else:
        if json_end != len(body):
            raise InvalidInput("binary data follows the JSON header but no input declares binary_data_size")
        values = _json_tensor(tensor.get("data"), json_part, shape, rows, d_model, dtype)
    binary_output = bool_field(parameters, "binary_data_output", "request parameter") or False
    outputs = _requested_outputs(document, binary_output, mc_parameters.asks_for_monte_carlo(parameters))
    return V2Request(
        values, shape, dtype, request_id, outputs, binary_output, parameters, timeout_us, binary_size is not None
    )


SHARED_MEMORY_REGION = "shared_memory_region"
# Request parameters of extensions this server does not implement: refused, never ignored.
_SEQUENCE = ("sequence", "an FFN is position-wise and keeps no sequence state")
_EXTENSION_PARAMETERS = {
    "sequence_id": _SEQUENCE,
    "sequence_start": _SEQUENCE,
    "sequence_end": _SEQUENCE,
    "priority": ("schedule_policy", "each model has one first-come queue; of its parameters only 'timeout' is served"),
}


def _refuse_extensions(parameters: dict[str, Any], input_parameters: dict[str, Any]) -> None:
    """Refuse a request that relies on an extension we do not implement, naming it."""
    if SHARED_MEMORY_REGION in input_parameters:
        raise _shared_memory_unsupported()
    for name, (extension, detail) in _EXTENSION_PARAMETERS.items():
        if name in parameters:
            raise UnsupportedExtension(extension, f"parameter {name!r} was sent, but {detail}")


def _shared_memory_unsupported() -> UnsupportedExtension:
    return UnsupportedExtension(
        "shared memory (system_shared_memory, cuda_shared_memory)",
        "send tensors in the request body (binary_tensor_data)",
    )


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
    body: bytearray, json_end: int, size: int, shape: tuple[int, ...], rows: int, d_model: int, dtype: DType
) -> torch.Tensor:
    expected = rows * d_model * dtype.itemsize
    if size != expected:
        raise InvalidInput(f"binary_data_size is {size} but shape {list(shape)} of {dtype.v2} needs {expected}")
    if len(body) - json_end != size:
        raise InvalidInput(f"binary section is {len(body) - json_end} bytes but binary_data_size says {size}")
    return tensors.view_rows(body, dtype, rows, d_model, json_end)


def _json_tensor(
    data: object, source: bytearray | memoryview, shape: tuple[int, ...], rows: int, d_model: int, dtype: DType
) -> torch.Tensor:
    if data is None:
        raise InvalidInput("input has neither 'data' nor parameters.binary_data_size")
    array = tensors.json_numbers_to_array(data, "data", source, dtype)
    if array.size != math.prod(shape) or (array.ndim > 1 and array.shape != shape):
        raise InvalidInput(f"'data' holds {array.size} values in shape {list(array.shape)}; shape says {list(shape)}")
    return torch.from_numpy(array.reshape(rows, d_model))


def _requested_outputs(document: dict[str, Any], binary_output: bool, monte_carlo: bool) -> dict[str, bool] | None:
    """Output name -> binary for each output asked for: its binary_data, else binary_data_output."""
    outputs = list_field(document, "outputs", "request")
    if not outputs:  # none named: every output, as in Triton
        return None
    if not all(isinstance(o, dict) for o in outputs):
        raise InvalidInput("'outputs' must be a list of objects")
    wanted: dict[str, bool] = {}
    for output in outputs:
        name = str_field(output, "name", "output")
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
        output_parameters = object_field(output, "parameters", "output")
        if "classification" in output_parameters:
            raise UnsupportedExtension("classification", "outputs are embeddings, not class scores")
        if SHARED_MEMORY_REGION in output_parameters:
            raise _shared_memory_unsupported()
        chosen = bool_field(output_parameters, "binary_data", "output parameter")
        wanted[name] = binary_output if chosen is None else chosen
    return wanted


def encode(
    model: str,
    version: int,
    request: V2Request,
    answers: dict[str, torch.Tensor],
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The response body and headers: JSON, or a JSON header followed by the binary outputs.

    `answers` holds every output the answer has, by name; the request's `outputs` pick among them.
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
        wire = tensors.to_wire_dtype(answers[name], request.dtype)
        described: dict[str, Any] = {"name": name, "datatype": request.dtype.v2, "shape": list(request.shape)}
        if binary:
            blob = tensors.raw_bytes(wire)
            described["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            described["data"] = wire.to(torch.float32).numpy().reshape(-1)
        described_outputs.append(described)
    header = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, {"content-type": "application/json"}
    return b"".join([header, *blobs]), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
