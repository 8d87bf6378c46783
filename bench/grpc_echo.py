"""A bare grpc.aio servicer that echoes each ModelInfer request's tensors: the gRPC floor that
bench/grpc_cpu.py measures ffn-serve's gRPC door against (issue 39: at most 2x its CPU per call).

    python3 -m bench.grpc_echo --port 8101

It parses the request and builds the answer as a servicer must (protobuf both ways), and nothing
else: no model, no batching, no budgets, no options beyond grpc's defaults.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc


class EchoServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        answer = pb.ModelInferResponse(model_name=request.model_name, raw_output_contents=request.raw_input_contents)
        for tensor in request.inputs:
            answer.outputs.add(name="output", datatype=tensor.datatype, shape=tensor.shape)
        return answer


async def serve(port: int) -> None:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(EchoServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
