"""ModelInferRequest to rows and options, and rows to ModelInferResponse: the V2 codec's checks, on protobuf.

The request is read with the HTTP door's checks (app/protocol/v2/codec.py, app/protocol/tensors.py,
app/protocol/fields.py), so a request is refused over gRPC exactly where its HTTP twin is, with the
same message. Parameters (`InferParameter`) become the values their JSON twins parse to:
int64 and uint64 an integer, double a number, bool a boolean, string a string; then the same
field readers check them (`mc_passes` sent as a double is refused as it is in JSON).

Tensors come as `raw_input_contents` (little-endian, C order; FP32, FP16, BF16) or as typed
contents: `fp32_contents` for FP32, the protocol having no typed field for FP16 or BF16. The
answer is in raw_output_contents, as Triton answers, or in `fp32_contents` when the request sent
typed contents (a client reading JSON, such as grpcurl, then reads numbers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from app.engine.facade import ModelFacade
from app.grpc.wire import InferMessage
from app.protocol import tensors
from app.protocol.digest import ANSWER_PARAMETER
from app.protocol.errors import InvalidInput
from app.protocol.fields import number_field
from app.protocol.shared_memory import SharedMemoryRegions, turned_off
from app.protocol.v2 import codec as v2
from app.protocol.v2.codec import SHARED_MEMORY_REGION, SharedMemorySpan
from ffn_core.dtypes import DType

FP32 = "FP32"


@dataclass(frozen=True)
class GrpcInferRequest:
    rows: np.ndarray  # (rows, d_model), carrying its data's dtype (app/engine/facade.py)
    shape: tuple[int, ...]
    dtype: DType
    id: str
    outputs: tuple[str, ...] | None  # the outputs asked for; None: every output the answer has
    parameters: dict[str, Any]  # request parameters as JSON would carry them: timeout, mc_passes, ...
    timeout_us: float | None  # the `timeout` parameter, microseconds as in Triton; None when absent
    typed: bool  # the input came as typed contents: answered as typed contents too
    shared_memory_outputs: Mapping[str, SharedMemorySpan]  # outputs written to a region, not sent


def parameters_of(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """InferParameter map -> the values their JSON twins parse to (a parameter with no value is null)."""
    return {key: _value(parameter) for key, parameter in parameters.items()}


def _value(parameter: pb.InferParameter) -> Any:
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


def decode(
    message: InferMessage,
    d_model: int,
    shared_memory: SharedMemoryRegions | None = None,
    max_rows: int = 0,
    max_bytes: int = 0,
) -> GrpcInferRequest:
    """The request's one input tensor and its options; every field checked as the HTTP door checks it.

    `shared_memory`: the registered regions (None: the extension is off). An input read from one
    counts against `max_rows` and `max_bytes` as the HTTP door counts it: it is copied into memory.
    """
    request = message.request
    parameters = parameters_of(request.parameters)
    timeout_us = number_field(parameters, "timeout", "request parameter", minimum=0)
    v2.check_one_input(len(request.inputs))
    tensor = request.inputs[0]
    input_parameters = parameters_of(tensor.parameters)
    head = v2.check_head(tensor.name, tensor.datatype, tensor.shape, d_model, parameters, input_parameters)
    dtype, shape, rows = head.dtype, head.shape, head.rows
    # The outputs before the tensor's data, as the HTTP door checks them (protocol/v2/codec.py).
    requested = [(output.name, parameters_of(output.parameters)) for output in request.outputs]
    outputs, in_shared_memory = v2.check_outputs(requested, head, shared_memory)
    typed = not message.raw and SHARED_MEMORY_REGION not in input_parameters
    if SHARED_MEMORY_REGION in input_parameters:
        _check_shared_memory_input(message, tensor, shared_memory)
        values = v2.shared_memory_tensor(
            input_parameters, shared_memory, shape, rows, d_model, dtype, max_rows, max_bytes
        )
    elif typed:
        values = _typed(tensor, shape, rows, d_model, dtype)
    else:
        values = _raw(message, tensor, shape, rows, d_model, dtype)
    return GrpcInferRequest(
        values, shape, dtype, request.id, tuple(outputs) or None, parameters, timeout_us, typed, in_shared_memory
    )


def _check_shared_memory_input(
    message: InferMessage,
    tensor: pb.ModelInferRequest.InferInputTensor,
    regions: SharedMemoryRegions | None,
) -> None:
    """An input in a region carries no values of its own; with the extension off, its 400 comes first."""
    if regions is None:  # the extension is named first: nothing else about it matters then
        raise turned_off()
    if message.raw or tensor.HasField("contents"):
        raise InvalidInput("input 'input' names a shared_memory_region and also carries contents; send one of them")


def _raw(
    message: InferMessage,
    tensor: pb.ModelInferRequest.InferInputTensor,
    shape: tuple[int, ...],
    rows: int,
    d_model: int,
    dtype: DType,
) -> np.ndarray:
    if tensor.HasField("contents"):
        raise InvalidInput("input 'input' has both contents and raw_input_contents; send one of them")
    if len(message.raw) != 1:
        raise InvalidInput(f"raw_input_contents holds {len(message.raw)} tensors for 1 input")
    raw = message.raw[0]
    expected = rows * d_model * dtype.itemsize
    if len(raw) != expected:
        raise InvalidInput(
            f"raw_input_contents[0] is {len(raw)} bytes but shape {list(shape)} of {dtype.v2} needs {expected}"
        )
    # A view of the wire bytes, read-only as an HTTP body's is: nothing on the way to the model writes
    # into its input (wire.py: a large message's tensor is never copied).
    return tensors.view_rows(raw, dtype, rows, d_model)


def _typed(
    tensor: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, ...], rows: int, d_model: int, dtype: DType
) -> np.ndarray:
    contents = tensor.contents
    sent = [field.name for field, _ in contents.ListFields()]
    if not sent:
        raise InvalidInput("input 'input' has neither contents nor raw_input_contents")
    if dtype.v2 != FP32:
        raise InvalidInput(
            f"the protocol has no typed contents for {dtype.v2}: send {dtype.v2} tensors in raw_input_contents"
        )
    if sent != ["fp32_contents"]:
        raise InvalidInput(f"an FP32 input carries its values in fp32_contents, got {', '.join(sent)}")
    count = len(contents.fp32_contents)
    if count != rows * d_model:
        raise InvalidInput(f"fp32_contents holds {count} values; shape {list(shape)} needs {rows * d_model}")
    values = np.array(contents.fp32_contents, dtype=np.float32).reshape(rows, d_model)
    tensors.check_finite(values)
    return values


def encode(
    served: ModelFacade,
    request: GrpcInferRequest,
    answers: dict[str, np.ndarray],
    parameters: Mapping[str, int | float] | None = None,
) -> pb.ModelInferResponse:
    """The answer: every output asked for (all by default) in the request's dtype, raw or typed as it came.

    `answers` carry the request's dtype (the engine's answer); one holding inf or NaN is refused.
    """
    response = pb.ModelInferResponse(model_name=served.name, model_version=str(served.version), id=request.id)
    response.parameters[ANSWER_PARAMETER].string_param = served.digest  # which weights answered
    for key, value in (parameters or {}).items():
        if isinstance(value, int):
            response.parameters[key].int64_param = value
        else:
            response.parameters[key].double_param = value
    for name in request.outputs if request.outputs is not None else tuple(answers):
        wire = answers[name]
        tensors.check_finite_output(wire)
        output = response.outputs.add(name=name, datatype=request.dtype.v2, shape=request.shape)
        span = request.shared_memory_outputs.get(name)
        if span is not None:  # written to the region; an empty raw entry keeps the entries in order
            span.write(tensors.raw_bytes(wire), f"output {name!r}")
            if not request.typed:
                response.raw_output_contents.append(b"")
        elif request.typed:
            output.contents.fp32_contents.extend(wire.reshape(-1).tolist())
        else:
            response.raw_output_contents.append(bytes(tensors.raw_bytes(wire)))
    return response
