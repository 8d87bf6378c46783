"""ModelInferRequest to rows and options, and rows to ModelInferResponse: the V2 codec's checks, on protobuf.

The request is read with the HTTP door's checks (app/web/v2/codec.py, app/web/tensors.py,
app/web/fields.py), so a request is refused over gRPC exactly where its HTTP twin is, with the
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
import torch
from tritonclient.grpc import service_pb2 as pb

from app.engine.service import ServedModel
from app.web import mc_parameters, tensors
from app.web.errors import InvalidInput, UnsupportedExtension
from app.web.fields import number_field
from app.web.v2 import codec as v2
from app.web.v2.codec import INPUT_NAME
from ffn_core.dtypes import DType

FP32 = "FP32"


@dataclass(frozen=True)
class GrpcInferRequest:
    rows: torch.Tensor  # (rows, d_model)
    shape: tuple[int, ...]
    dtype: DType
    id: str
    outputs: tuple[str, ...] | None  # the outputs asked for; None: every output the answer has
    parameters: dict[str, Any]  # request parameters as JSON would carry them: timeout, mc_passes, ...
    timeout_us: float | None  # the `timeout` parameter, microseconds as in Triton; None when absent
    typed: bool  # the input came as typed contents: answered as typed contents too


def parameters_of(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """InferParameter map -> the values their JSON twins parse to (a parameter with no value is null)."""
    return {key: _value(parameter) for key, parameter in parameters.items()}


def _value(parameter: pb.InferParameter) -> Any:
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


def decode(request: pb.ModelInferRequest, d_model: int) -> GrpcInferRequest:
    """The request's one input tensor and its options; every field checked as the HTTP door checks it."""
    parameters = parameters_of(request.parameters)
    timeout_us = number_field(parameters, "timeout", "request parameter", minimum=0)
    if len(request.inputs) != 1:
        raise InvalidInput(f"expected exactly one input tensor named {INPUT_NAME!r}")
    tensor = request.inputs[0]
    dtype = v2.check_input(tensor.name, tensor.datatype)
    rows = tensors.check_shape(tensor.shape, d_model)
    shape = tuple(tensor.shape)
    v2.refuse_extensions(parameters, parameters_of(tensor.parameters))
    _refuse_shared_memory(tensor.parameters, *(output.parameters for output in request.outputs))
    typed = not request.raw_input_contents
    values = (
        _typed(tensor, shape, rows, d_model, dtype) if typed else _raw(request, tensor, shape, rows, d_model, dtype)
    )
    monte_carlo = mc_parameters.asks_for_monte_carlo(parameters)
    outputs = tuple(
        dict.fromkeys(
            v2.check_output(output.name, parameters_of(output.parameters), monte_carlo) for output in request.outputs
        )
    )
    return GrpcInferRequest(values, shape, dtype, request.id, outputs or None, parameters, timeout_us, typed)


def _refuse_shared_memory(*parameter_maps: Any) -> None:
    """Tensors in shared memory are served over HTTP (the system_shared_memory extension), not over gRPC yet."""
    if any(v2.SHARED_MEMORY_REGION in parameters for parameters in parameter_maps):
        raise UnsupportedExtension(
            "system_shared_memory", "over gRPC, send tensors in raw_input_contents; shared memory is served over HTTP"
        )


def _raw(
    request: pb.ModelInferRequest,
    tensor: pb.ModelInferRequest.InferInputTensor,
    shape: tuple[int, ...],
    rows: int,
    d_model: int,
    dtype: DType,
) -> torch.Tensor:
    if tensor.HasField("contents"):
        raise InvalidInput("input 'input' has both contents and raw_input_contents; send one of them")
    if len(request.raw_input_contents) != 1:
        raise InvalidInput(f"raw_input_contents holds {len(request.raw_input_contents)} tensors for 1 input")
    raw = request.raw_input_contents[0]
    expected = rows * d_model * dtype.itemsize
    if len(raw) != expected:
        raise InvalidInput(
            f"raw_input_contents[0] is {len(raw)} bytes but shape {list(shape)} of {dtype.v2} needs {expected}"
        )
    # A writable copy: protobuf hands out immutable bytes, and torch tensors want a buffer they may write.
    return tensors.view_rows(bytearray(raw), dtype, rows, d_model)


def _typed(
    tensor: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, ...], rows: int, d_model: int, dtype: DType
) -> torch.Tensor:
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
    array = torch.from_numpy(values)
    tensors.check_finite(array)
    return array


def encode(
    served: ServedModel,
    request: GrpcInferRequest,
    answers: dict[str, torch.Tensor],
    parameters: Mapping[str, int | float] | None = None,
) -> pb.ModelInferResponse:
    """The answer: every output asked for (all by default) in the request's dtype, raw or typed as it came."""
    response = pb.ModelInferResponse(model_name=served.name, model_version=str(served.version), id=request.id)
    for key, value in (parameters or {}).items():
        if isinstance(value, int):
            response.parameters[key].int64_param = value
        else:
            response.parameters[key].double_param = value
    for name in request.outputs if request.outputs is not None else tuple(answers):
        wire = tensors.to_wire_dtype(answers[name], request.dtype)
        output = response.outputs.add(name=name, datatype=request.dtype.v2, shape=request.shape)
        if request.typed:
            output.contents.fp32_contents.extend(wire.numpy().reshape(-1).tolist())
        else:
            response.raw_output_contents.append(bytes(tensors.raw_bytes(wire)))
    return response
