"""What the gRPC tests share: requests built as tritonclient builds them, an async stub, trailing metadata."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

D_MODEL = 512


def infer_request(
    x: np.ndarray,
    model: str = "demo",
    *,
    datatype: str = "FP32",
    request_id: str = "",
    parameters: dict[str, object] | None = None,
    outputs: tuple[str, ...] = (),
) -> pb.ModelInferRequest:
    """A ModelInferRequest with `x` in raw_input_contents, as tritonclient.grpc sends one."""
    wire = {"FP32": "<f4", "FP16": "<f2"}[datatype]
    request = pb.ModelInferRequest(model_name=model, id=request_id, raw_input_contents=[x.astype(wire).tobytes()])
    request.inputs.add(name="input", datatype=datatype, shape=list(x.shape))
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        elif isinstance(value, float):
            request.parameters[key].double_param = value
        else:
            request.parameters[key].string_param = str(value)
    return request


def output_of(response: pb.ModelInferResponse, index: int = 0) -> np.ndarray:
    tensor = response.outputs[index]
    dtype = {"FP32": "<f4", "FP16": "<f2"}[tensor.datatype]
    return np.frombuffer(response.raw_output_contents[index], dtype=dtype).reshape(tuple(tensor.shape))


@asynccontextmanager
async def stub(target: str, **options: object) -> AsyncIterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    """A stub on a fresh channel (its own connection), closed after the block; answers of any size, as tritonclient."""
    options = {"grpc.max_receive_message_length": 2**31 - 1, **options}
    async with grpc.aio.insecure_channel(target, options=list(options.items())) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


async def infer_or_error(target: str, request: pb.ModelInferRequest) -> pb.ModelInferResponse | grpc.aio.AioRpcError:
    """One ModelInfer on a channel of its own: its answer, or the error it ended with (a flood counts both)."""
    async with stub(target) as client:
        try:
            return await client.ModelInfer(request, timeout=600)
        except grpc.aio.AioRpcError as error:
            return error


@dataclass(frozen=True)
class StreamEnd:
    """How a ModelStreamInfer call went: the answers it got, then its status."""

    answers: list[pb.ModelStreamInferResponse]
    code: grpc.StatusCode
    details: str
    trailers: dict[str, str]


def stream_once(target: str, request: pb.ModelInferRequest) -> StreamEnd:
    """One ModelStreamInfer of one message, then half-closed, on a channel of its own: what it got and its end.

    grpcio's blocking API, as tritonclient.grpc streams: it reports the status the server ended the call with
    even when that came while the message was still being sent. (The asyncio API reports its failed write
    instead: INTERNAL, "Internal error from Core".)
    """
    options = [("grpc.max_receive_message_length", 2**31 - 1)]
    with grpc.insecure_channel(target, options=options) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]), timeout=600)
        answers = []
        try:
            answers.extend(call)
        except grpc.RpcError:  # the server ended the call: its status follows
            pass
        metadata = call.trailing_metadata() or ()
        return StreamEnd(answers, call.code(), call.details() or "", {key: value for key, value in metadata})


def trailers(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {key: value for key, value in (error.trailing_metadata() or ())}
