"""ffn-loadtest over gRPC: prebuilt ModelInferRequests sent as unary calls or on streams, statuses as HTTP's.

Requests are serialized once, up front (tensors in raw_input_contents, as tritonclient.grpc sends
them), and sent as bytes on a method with no serializer, so a request costs the tester no
protobuf work. A gRPC status is counted as the HTTP status the server gives the same error
(RESOURCE_EXHAUSTED 429 or 413, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, ...), read from the
`ffn-error-type` trailing metadata (an error_type, as HTTP answers carry) where the server sent
one, so that the tables, the error rates and the thresholds mean the same for both protocols.

Needs the `grpc` extra (grpcio, and tritonclient's generated messages); imported only for
`--protocol grpc` or `grpc-stream`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ffn_client.encodings import V2_DATATYPES, V2_INPUT, float32_to_bf16
from ffn_client.report import CONNECT_ERROR, TIMEOUT, TRANSPORT_ERROR
from ffn_client.senders import note_failure

if TYPE_CHECKING:  # load.py imports this module when a run is over gRPC
    from ffn_client.load import LoadConfig

SERVICE = "/inference.GRPCInferenceService/"
ERROR_TYPE_KEY = "ffn-error-type"
CALLS_PER_CHANNEL = 16  # concurrent calls per connection; more calls open more channels
# The HTTP status of each error_type (docs/api.md's error table), for gRPC answers that carry one.
HTTP_STATUS_OF_ERROR_TYPE = {
    "invalid_input": 400,
    "unsupported_extension": 400,
    "unauthorized": 401,
    "model_not_found": 404,
    "not_found": 404,
    "payload_too_large": 413,
    "non_finite_output": 422,
    "overloaded": 429,
    "client_closed_request": 499,
    "model_error": 500,
    "internal": 500,
    "unavailable": 503,
    "deadline_exceeded": 504,
    "insufficient_memory": 507,
}
# And of each gRPC code, for answers without one (grpc's own refusals: message too large, ...).
HTTP_STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.OUT_OF_RANGE: 422,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def target_of(url: str) -> str:
    """host:port of a grpc://host:port or grpcs://host:port URL (or of a bare host:port)."""
    return url.removeprefix("grpc://").removeprefix("grpcs://").rstrip("/")


def channel_tls(config: LoadConfig) -> grpc.ChannelCredentials:
    """TLS credentials from the load's CA (None: grpc's own roots) and client certificate and key, read once."""
    root = Path(config.cacert).read_bytes() if config.cacert else None
    if config.cert is None:
        return grpc.ssl_channel_credentials(root_certificates=root)
    chain = Path(config.cert).read_bytes()
    key = Path(config.key).read_bytes() if config.key else chain  # one PEM file may hold both, as curl's --cert
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)


def infer_request(model: str, array: np.ndarray, dtype: str, timeout_ms: float | None) -> bytes:
    """A serialized ModelInferRequest carrying `array` in `dtype` as raw_input_contents."""
    if dtype == "bfloat16":
        raw = float32_to_bf16(array).tobytes()
    else:
        raw = np.ascontiguousarray(array, dtype={"float32": "<f4", "float16": "<f2"}[dtype]).tobytes()
    request = pb.ModelInferRequest(model_name=model, raw_input_contents=[raw])
    request.inputs.add(name=V2_INPUT, datatype=V2_DATATYPES[dtype], shape=list(array.shape))
    if timeout_ms is not None:
        request.parameters["timeout"].int64_param = math.ceil(timeout_ms * 1000)  # microseconds, as Triton
    return bytes(request.SerializeToString())


def metadata_of(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _channel(target: str, tls: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    # Answers of any size (as tritonclient), and a connection of its own (not one shared by channels).
    options = [("grpc.max_receive_message_length", 2**31 - 1), ("grpc.use_local_subchannel_pool", 1)]
    if tls is not None:
        return grpc.aio.secure_channel(target, tls, options=options)
    return grpc.aio.insecure_channel(target, options=options)


async def discover_d_model(
    target: str, model: str, api_key: str | None, timeout: float, tls: grpc.ChannelCredentials | None = None
) -> int:
    """The model's d_model from its gRPC ModelMetadata; LookupError or ConnectionError saying what went wrong."""
    async with _channel(target, tls) as channel:
        call = channel.unary_unary(
            SERVICE + "ModelMetadata",
            request_serializer=pb.ModelMetadataRequest.SerializeToString,
            response_deserializer=pb.ModelMetadataResponse.FromString,
        )
        try:
            answer = await call(pb.ModelMetadataRequest(name=model), timeout=timeout, metadata=metadata_of(api_key))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise ConnectionError(f"cannot reach grpc://{target}: {exc.details()}") from None
            hint = (
                "; pass its key with --api-key (or FFN_API_KEY)"
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED
                else ""
            )
            raise LookupError(
                f"cannot find d_model of model {model!r} at grpc://{target}: {exc.code().name}: {exc.details()}{hint}"
            ) from None
    return int(answer.inputs[0].shape[-1])


def _status(error: grpc.aio.AioRpcError, causes: dict[int, str]) -> int:
    error_type = dict(error.trailing_metadata() or ()).get(ERROR_TYPE_KEY)
    status = HTTP_STATUS_OF_ERROR_TYPE.get(str(error_type), HTTP_STATUS_OF_CODE.get(error.code(), 500))
    if (
        error_type is None
        and error.code() == grpc.StatusCode.UNAVAILABLE
        and "connect" in (error.details() or "").lower()
    ):
        status = CONNECT_ERROR
    return note_failure(causes, status, f"{error.code().name}: {error.details()}")


class _Channels:
    """Enough channels for `calls` concurrent calls, `CALLS_PER_CHANNEL` each, used in turn."""

    def __init__(self, target: str, calls: int, tls: grpc.ChannelCredentials | None) -> None:
        self.channels = [_channel(target, tls) for _ in range(max(1, math.ceil(calls / CALLS_PER_CHANNEL)))]
        self._next = 0

    def next(self) -> grpc.aio.Channel:
        self._next = (self._next + 1) % len(self.channels)
        return self.channels[self._next]

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.channels))


class GrpcSender:
    """Unary ModelInfer calls; a prepared request is its serialized bytes. `tls`: credentials, else cleartext."""

    def __init__(
        self,
        url: str,
        connections: int,
        timeout: float,
        api_key: str | None,
        tls: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._channels = _Channels(target_of(url), connections, tls)
        self._calls = [channel.unary_unary(SERVICE + "ModelInfer") for channel in self._channels.channels]
        self._turn = 0
        self._timeout = timeout
        self._metadata = metadata_of(api_key)
        self.causes: dict[int, str] = {}

    def prepare(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        return body

    async def send(self, request: bytes) -> int:
        self._turn = (self._turn + 1) % len(self._calls)
        try:
            await self._calls[self._turn](request, timeout=self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not exc.trailing_metadata():
                return note_failure(self.causes, TIMEOUT, f"no whole answer within --timeout {self._timeout:g} s")
            return _status(exc, self.causes)
        return 200

    async def aclose(self) -> None:
        await self._channels.close()


class _Stream:
    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]]) -> None:
        method = channel.stream_stream(SERVICE + "ModelStreamInfer", response_deserializer=_StreamAnswer.parse)
        self.call = method(metadata=metadata)


class _StreamAnswer:
    """A stream's answer, parsed only as far as the tester needs: its error, if any."""

    @staticmethod
    def parse(data: bytes) -> pb.ModelStreamInferResponse:
        answer = pb.ModelStreamInferResponse()
        answer.ParseFromString(data)
        return answer


class GrpcStreamSender:
    """ModelStreamInfer: each request on a stream with nothing else outstanding, at most `connections` streams."""

    def __init__(
        self,
        url: str,
        connections: int,
        timeout: float,
        api_key: str | None,
        tls: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._channels = _Channels(target_of(url), connections, tls)
        self._metadata = metadata_of(api_key)
        self._idle: list[_Stream] = []
        self._streams: list[_Stream] = []
        self._timeout = timeout
        self.causes: dict[int, str] = {}

    def prepare(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        return body

    async def send(self, request: bytes) -> int:
        stream = self._idle.pop() if self._idle else self._open()
        try:
            async with asyncio.timeout(self._timeout):
                await stream.call.write(request)
                answer: Any = await stream.call.read()
        except TimeoutError:
            stream.call.cancel()  # its answer may still come: this stream is not reused
            return note_failure(self.causes, TIMEOUT, f"no whole answer within --timeout {self._timeout:g} s")
        except grpc.aio.AioRpcError as exc:
            return _status(exc, self.causes)
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            return note_failure(self.causes, TRANSPORT_ERROR, exc)
        if answer is grpc.aio.EOF:
            code = await stream.call.code()
            return note_failure(
                self.causes, HTTP_STATUS_OF_CODE.get(code, TRANSPORT_ERROR), f"stream ended: {code.name}"
            )
        self._idle.append(stream)
        if answer.error_message:
            error_type = answer.infer_response.parameters["error_type"].string_param
            return note_failure(self.causes, HTTP_STATUS_OF_ERROR_TYPE.get(error_type, 400), answer.error_message)
        return 200

    def _open(self) -> _Stream:
        stream = _Stream(self._channels.next(), self._metadata)
        self._streams.append(stream)
        return stream

    async def aclose(self) -> None:
        for stream in self._streams:
            stream.call.cancel()
        await self._channels.close()
