"""One V2 check order for both doors (app/protocol/v2/codec.py: check_one_input, check_head, check_outputs).

A request with two faults is refused for the one the order reaches first, and the same one over
HTTP (JSON) and gRPC: one input; its name and datatype; its shape; no extension asked for; the
outputs asked for; only then the tensor's data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from ffn_testing import ServerProcess, start_server
from tests.grpc_helpers import D_MODEL, stub

V2_INFER = "/v2/models/demo/infer"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_server(env={"FFN_WARMUP": "0", "FFN_LOG_LEVEL": "warning"}) as srv:
        yield srv


def case(
    *,
    name: str = "input",
    datatype: str = "FP32",
    shape: tuple[int, ...] = (1, D_MODEL),
    values: int = D_MODEL,
    parameters: dict[str, Any] | None = None,
    outputs: tuple[str, ...] = (),
) -> tuple[dict[str, Any], pb.ModelInferRequest]:
    """The same request as V2 JSON and as a gRPC ModelInferRequest (its data as typed contents)."""
    data = [0.5] * values
    body: dict[str, Any] = {"inputs": [{"name": name, "datatype": datatype, "shape": list(shape), "data": data}]}
    request = pb.ModelInferRequest(model_name="demo")
    tensor = request.inputs.add(name=name, datatype=datatype, shape=list(shape))
    tensor.contents.fp32_contents.extend(data)
    for key, value in (parameters or {}).items():
        body.setdefault("parameters", {})[key] = value
        request.parameters[key].int64_param = value
    if outputs:
        body["outputs"] = [{"name": output} for output in outputs]
        for output in outputs:
            request.outputs.add(name=output)
    return body, request


# (what is wrong, twice over, and the words of the fault the order reaches first)
CASES = {
    "a bad output and too few values": (case(values=D_MODEL - 1, outputs=("nope",)), "unknown output 'nope'"),
    "a bad datatype and a bad output": (case(datatype="INT8", outputs=("nope",)), "datatype must be one of"),
    "a bad name and a bad shape": (case(name="x", shape=(1, 7)), "unexpected input 'x'"),
    "a bad shape and an extension": (case(shape=(1, 7), values=7, parameters={"sequence_id": 3}), "d_model=512"),
    "an extension and a bad output": (case(parameters={"sequence_id": 3}, outputs=("nope",)), "sequence"),
    "output_std without Monte Carlo, and too few values": (
        case(values=3, outputs=("output_std",)),
        "output 'output_std' is answered only by Monte Carlo",
    ),
}


@pytest.mark.parametrize("fault", list(CASES))
async def test_both_doors_refuse_the_same_fault_first(server: ServerProcess, fault: str) -> None:
    (body, request), words = CASES[fault]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        answer = await http.post(V2_INFER, json=body)
    assert answer.status_code == 400, answer.text
    http_error = answer.json()["error"]
    assert words in http_error, http_error
    async with stub(server.grpc_target) as grpc_stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await grpc_stub.ModelInfer(request)
    assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)
    assert refused.value.details() == http_error  # the same words: the same check, reached in the same order


async def test_a_right_request_is_answered_alike_on_both_doors(server: ServerProcess) -> None:
    """The order refuses nothing a right request carries: both doors answer it, the same numbers."""
    body, request = case(outputs=("output",))
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        answer = await http.post(V2_INFER, json=body)
    assert answer.status_code == 200, answer.text
    over_http = np.array(answer.json()["outputs"][0]["data"], dtype=np.float32)
    async with stub(server.grpc_target) as grpc_stub:
        response = await grpc_stub.ModelInfer(request)
    over_grpc = np.array(response.outputs[0].contents.fp32_contents, dtype=np.float32)  # typed in, typed out
    np.testing.assert_array_equal(over_http, over_grpc)
