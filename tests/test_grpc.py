"""The gRPC door against a real ffn-serve, with real clients (grpc.aio stubs of Triton's service, tritonclient).

- gRPC and HTTP rows share a batch; both are counted, each under its protocol label.
- Every bad request is refused over gRPC where its HTTP twin is refused, with the same message,
  the table's gRPC code and the HTTP answer's error_type in the trailing metadata.
- Typed contents (fp32_contents) in, typed contents out; FP16 answers numpy's float16 FFN.
- Deadlines (the call's own, and Triton's `timeout` parameter), overload (RESOURCE_EXHAUSTED with
  a retry hint), the message size limit, the API key (health open), health and reflection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from tritonclient.grpc import service_pb2 as pb

from app.protocol.errors import ERRORS
from ffn_client.encodings import as_wire_values
from ffn_testing import ServerProcess, metric_value, start_server, wait_for_metrics
from tests.grpc_helpers import D_MODEL, infer_request, output_of, stub, trailers
from tests.reference import demo_reference
from tests.slow_model import slow_model_config
from tests.test_overload import SLOW_ROWS, SlowRequest, metrics, only_the_slow_and_follow_up_computed

GRPC_CODE_OF = {kind.error_type: grpc.StatusCode[kind.grpc] for kind in ERRORS.values()}


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


# ----- one batch, two doors ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def batching_server() -> Iterator[ServerProcess]:
    # A batch is cut when 8 rows wait, or a second after its first: the two requests below make 8.
    env = {"FFN_MAX_WAIT_MS": "1000", "FFN_MAX_BATCH_ROWS": "8", "FFN_LOG_LEVEL": "warning"}
    with start_server(env=env) as server:
        yield server


async def test_grpc_and_http_rows_share_a_batch(batching_server: ServerProcess) -> None:
    x_grpc, x_http = rows(3, 1), rows(5, 2)
    body = orjson.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [5, D_MODEL], "data": x_http.ravel().tolist()}]}
    )
    async with httpx.AsyncClient(base_url=batching_server.url, timeout=60) as http:
        before = await metrics(http)
        stats_before = (await http.get("/v2/models/demo/stats")).json()["model_stats"][0]
        async with stub(batching_server.grpc_target) as grpc_stub:
            grpc_answer, http_answer = await asyncio.gather(
                grpc_stub.ModelInfer(infer_request(x_grpc)), http.post("/v2/models/demo/infer", content=body)
            )
        after = await metrics(http)
        stats_after = (await http.get("/v2/models/demo/stats")).json()["model_stats"][0]
    np.testing.assert_allclose(output_of(grpc_answer), demo_reference(x_grpc), rtol=1e-5, atol=1e-5)
    assert http_answer.status_code == 200, http_answer.text
    y_http = np.asarray(http_answer.json()["outputs"][0]["data"]).reshape(5, D_MODEL)
    np.testing.assert_allclose(y_http, demo_reference(x_http), rtol=1e-5, atol=1e-5)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("ffn_batch_rows_count", model="demo") == 1  # one forward pass ...
    assert delta("ffn_batch_rows_sum", model="demo") == 8  # ... of both requests' rows
    assert stats_after["execution_count"] - stats_before["execution_count"] == 1
    assert stats_after["inference_count"] - stats_before["inference_count"] == 8
    for protocol in ("grpc", "http"):
        assert delta("ffn_requests_total", model="demo", outcome="ok", protocol=protocol) == 1, protocol


# ----- refused where HTTP refuses ---------------------------------------------------------------


def case(**changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "input",
        "datatype": "FP32",
        "shape": [2, D_MODEL],
        "data": np.ones((2, D_MODEL), "<f4").tobytes(),
        "parameters": {},
        "outputs": [],
        "inputs": 1,
    }
    return {**spec, **changes}


def as_grpc(spec: dict[str, Any]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="demo")
    for _ in range(spec["inputs"]):
        request.inputs.add(name=spec["name"], datatype=spec["datatype"], shape=spec["shape"])
        request.raw_input_contents.append(spec["data"])
    for name in spec["outputs"]:
        request.outputs.add(name=name)
    for key, value in spec["parameters"].items():
        which = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], which, value)
    return request


def as_http(spec: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The same request with the binary tensor data extension (raw bytes, as gRPC sends them)."""
    tensor = {
        "name": spec["name"],
        "datatype": spec["datatype"],
        "shape": spec["shape"],
        "parameters": {"binary_data_size": len(spec["data"])},
    }
    header = {
        "inputs": [tensor] * spec["inputs"],
        "parameters": spec["parameters"],
        "outputs": [{"name": name} for name in spec["outputs"]],
    }
    json_part = orjson.dumps(header)
    return json_part + spec["data"] * spec["inputs"], {"inference-header-content-length": str(len(json_part))}


NAN = np.full((2, D_MODEL), np.nan, "<f4").tobytes()
REFUSED_BOTH_WAYS = {
    "wrong input name": case(name="x"),
    "integer datatype": case(datatype="INT32"),
    "rank 1": case(shape=[D_MODEL], data=np.ones(D_MODEL, "<f4").tobytes()),
    "rank 4": case(shape=[1, 1, 2, D_MODEL]),
    "wrong d_model": case(shape=[2, 4], data=np.ones((2, 4), "<f4").tobytes()),
    "a zero dimension": case(shape=[0, D_MODEL], data=b""),
    "NaN": case(data=NAN),
    "two inputs": case(inputs=2),
    "mc_passes as a double": case(parameters={"mc_passes": 3.0, "mc_dropout": 0.1}),
    "mc_passes as a string": case(parameters={"mc_passes": "3", "mc_dropout": 0.1}),
    "mc_passes too many": case(parameters={"mc_passes": 100_000, "mc_dropout": 0.1}),
    "mc_seed alone": case(parameters={"mc_seed": 3}),
    "mc without a dropout rate": case(parameters={"mc_passes": 4}),
    "output_std without mc_passes": case(outputs=["output_std"]),
    "unknown output": case(outputs=["logits"]),
    "sequence_id": case(parameters={"sequence_id": 7}),
    "priority": case(parameters={"priority": 1}),
    "negative timeout": case(parameters={"timeout": -5}),
    "timeout as a string": case(parameters={"timeout": "100"}),
    "timeout beyond an hour": case(parameters={"timeout": 4_000_000_000}),
}


async def test_every_bad_request_is_refused_as_over_http(demo_server: ServerProcess) -> None:
    """Same message, the table's gRPC code for the HTTP answer's error_type, which rides in the trailers."""
    async with httpx.AsyncClient(base_url=demo_server.url, timeout=60) as http, stub(demo_server.grpc_target) as s:
        for what, spec in REFUSED_BOTH_WAYS.items():
            body, headers = as_http(spec)
            answer = await http.post("/v2/models/demo/infer", content=body, headers=headers)
            assert answer.status_code == 400, (what, answer.text)
            expected = answer.json()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.ModelInfer(as_grpc(spec))
            assert info.value.code() == GRPC_CODE_OF[expected["error_type"]], what
            assert info.value.details() == expected["error"], what
            assert trailers(info.value)["ffn-error-type"] == expected["error_type"], what


async def test_shared_memory_while_off_is_refused_naming_the_setting(demo_server: ServerProcess) -> None:
    """An input or an output naming a region, with the extension off: the HTTP door's refusal, on either."""
    async with stub(demo_server.grpc_target) as s:
        for where in ("input", "output"):
            request = as_grpc(case())
            tensor = request.inputs[0] if where == "input" else request.outputs.add(name="output")
            tensor.parameters["shared_memory_region"].string_param = "r"
            tensor.parameters["shared_memory_byte_size"].int64_param = 2 * D_MODEL * 4
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.ModelInfer(request)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, where
            assert "system_shared_memory" in info.value.details() and "shared_memory = true" in info.value.details()


async def test_byte_counts_that_do_not_match_shape_and_dtype_are_invalid(demo_server: ServerProcess) -> None:
    x = np.ones((2, D_MODEL), "<f4")
    async with stub(demo_server.grpc_target) as s:
        for shape, data, needed in (
            ([2, D_MODEL], x.tobytes()[:-1], 2 * D_MODEL * 4),
            ([3, D_MODEL], x.tobytes(), 3 * D_MODEL * 4),
            ([2**40, 2**20, D_MODEL], x.tobytes(), 2**60 * D_MODEL * 4),  # absurd: refused before any allocation
        ):
            request = pb.ModelInferRequest(model_name="demo", raw_input_contents=[data])
            request.inputs.add(name="input", datatype="FP32", shape=shape)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.ModelInfer(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                info.value.details()
                == f"raw_input_contents[0] is {len(data)} bytes but shape {shape} of FP32 needs {needed}"
            )
        fp16 = infer_request(x, datatype="FP16")
        fp16.inputs[0].datatype = "FP32"  # two bytes an element, said to be four
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.ModelInfer(fp16)
        assert "needs 4096" in info.value.details()


# ----- tensors ----------------------------------------------------------------------------------


async def test_typed_contents_in_typed_contents_out(demo_server: ServerProcess) -> None:
    x = rows(3, 4)
    request = pb.ModelInferRequest(model_name="demo", id="typed")
    request.inputs.add(name="input", datatype="FP32", shape=[3, D_MODEL]).contents.fp32_contents.extend(x.ravel())
    async with stub(demo_server.grpc_target) as s:
        response = await s.ModelInfer(request)
        assert response.id == "typed" and not response.raw_output_contents
        y = np.array(response.outputs[0].contents.fp32_contents, dtype=np.float64).reshape(3, D_MODEL)
        np.testing.assert_allclose(y, demo_reference(x), rtol=1e-5, atol=1e-5)
        for datatype in ("FP16", "BF16"):  # the protocol has no typed field for them
            request.inputs[0].datatype = datatype
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.ModelInfer(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == (
                f"the protocol has no typed contents for {datatype}: send {datatype} tensors in raw_input_contents"
            )
        request.inputs[0].datatype = "FP32"
        request.inputs[0].contents.int_contents.append(1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.ModelInfer(request)
        assert (
            info.value.details() == "an FP32 input carries its values in fp32_contents, got int_contents, fp32_contents"
        )


async def test_fp16_raw_in_fp16_out_and_monte_carlo_parameters(demo_server: ServerProcess) -> None:
    x = rows(4, 5)
    async with stub(demo_server.grpc_target) as s:
        response = await s.ModelInfer(infer_request(x, datatype="FP16"))
        assert response.outputs[0].datatype == "FP16"
        seen = as_wire_values(x, "float16").astype(np.float64)
        np.testing.assert_allclose(output_of(response).astype(np.float64), demo_reference(seen), rtol=2e-2, atol=2e-2)
        parameters = {"mc_passes": 8, "mc_dropout": 0.25, "mc_seed": 11}
        first = await s.ModelInfer(infer_request(x, parameters=parameters))
        again = await s.ModelInfer(infer_request(x, parameters=parameters, outputs=("output_std",)))
    assert [o.name for o in first.outputs] == ["output", "output_std"]
    assert first.parameters["mc_passes"].int64_param == 8 and first.parameters["mc_seed"].int64_param == 11
    assert first.parameters["mc_dropout"].double_param == 0.25
    assert [o.name for o in again.outputs] == ["output_std"]
    np.testing.assert_array_equal(output_of(again), output_of(first, 1))  # the same seed: the same passes
    assert float(output_of(first, 1).max()) > 0  # dropout spreads the passes


# ----- deadlines, overload, cancellation (a slow model keeps the queue busy) ----------------------


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    settings = "max_wait_ms = 0\nmax_batch_rows = 4096\nmax_queue_rows = 4096\nwarmup = false"
    config = slow_model_config(tmp_path_factory.mktemp("slow-grpc"), settings)
    with start_server(config=config) as server:
        yield server


@pytest.mark.parametrize("how", ["timeout parameter", "grpc deadline"])
async def test_a_deadline_passing_in_the_queue_is_never_computed(slow_server: ServerProcess, how: str) -> None:
    x = np.ones((5, D_MODEL), np.float32)
    async with httpx.AsyncClient(base_url=slow_server.url, timeout=60) as http, stub(slow_server.grpc_target) as s:
        before = await metrics(http)
        slow = SlowRequest(http)
        await slow.started(before)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if how == "timeout parameter":  # microseconds, as tritonclient.grpc sends `timeout`
                await s.ModelInfer(infer_request(x, "slow", parameters={"timeout": 20_000}))
            else:  # the call's own deadline is the request's
                await s.ModelInfer(infer_request(x, "slow"), timeout=0.2)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if how == "timeout parameter":  # the server's answer, not the client's own expiry
            assert trailers(info.value)["ffn-error-type"] == "deadline_exceeded"
        await only_the_slow_and_follow_up_computed(http, slow, before, "deadline_exceeded")


async def test_overload_is_resource_exhausted_with_a_retry_hint(slow_server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=slow_server.url, timeout=60) as http, stub(slow_server.grpc_target) as s:
        before = await metrics(http)
        slow = SlowRequest(http)
        await slow.started(before)
        queued = asyncio.ensure_future(s.ModelInfer(infer_request(np.ones((4000, D_MODEL), np.float32), "slow")))
        await wait_for_metrics(
            http, lambda m: metric_value(m, "ffn_queue_rows", model="slow") == 4000, "4000 rows queued"
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.ModelInfer(infer_request(np.ones((200, D_MODEL), np.float32), "slow"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == "queue full for model 'slow': 4000 of 4096 rows waiting"
        assert trailers(info.value) == {
            "ffn-error-type": "overloaded",
            "retry-after": "1",
            "grpc-retry-pushback-ms": "1000",
            "x-request-id": trailers(info.value)["x-request-id"],  # every answer names its request
        }
        with pytest.raises(grpc.aio.AioRpcError) as info:  # never fits: do not retry
            await s.ModelInfer(infer_request(np.ones((4097, D_MODEL), np.float32), "slow"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert trailers(info.value)["grpc-retry-pushback-ms"] == "-1"
        await slow.answered()
        assert output_of(await queued).shape == (4000, D_MODEL)
        after = await metrics(http)
    counted = metric_value(after, "ffn_requests_total", model="slow", outcome="overloaded", protocol="grpc")
    assert (
        counted - metric_value(before, "ffn_requests_total", model="slow", outcome="overloaded", protocol="grpc") == 1
    )


async def test_a_call_cancelled_while_queued_is_dropped_and_its_batch_mates_answered(
    slow_server: ServerProcess,
) -> None:
    mate = rows(3, 6)
    async with httpx.AsyncClient(base_url=slow_server.url, timeout=60) as http, stub(slow_server.grpc_target) as s:
        before = await metrics(http)
        slow = SlowRequest(http)
        await slow.started(before)
        doomed = s.ModelInfer(infer_request(np.ones((7, D_MODEL), np.float32), "slow"))
        kept = asyncio.ensure_future(s.ModelInfer(infer_request(mate, "slow")))
        await wait_for_metrics(http, lambda m: metric_value(m, "ffn_queue_rows", model="slow") == 10, "both queued")
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        await wait_for_metrics(
            http, lambda m: metric_value(m, "ffn_queue_rows", model="slow") == 3, "the cancelled rows leave the queue"
        )
        await slow.answered()
        assert output_of(await kept).shape == (3, D_MODEL)
        after = await metrics(http)
    assert (
        metric_value(after, "ffn_batch_rows_sum", model="slow")
        - metric_value(before, "ffn_batch_rows_sum", model="slow")
        == SLOW_ROWS + 3
    )  # the cancelled call's 7 rows were never computed
    cancelled = metric_value(
        after, "ffn_requests_total", model="slow", outcome="client_closed_request", protocol="grpc"
    )
    assert (
        cancelled
        - metric_value(before, "ffn_requests_total", model="slow", outcome="client_closed_request", protocol="grpc")
        == 1
    )


# ----- limits, key, health, reflection ----------------------------------------------------------

KEY = "grpc-test-key"


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ServerProcess]:
    env = {"FFN_API_KEY": KEY, "FFN_MAX_BODY_BYTES": "65536", "FFN_LOG_LEVEL": "warning"}
    with start_server(env=env) as server:
        yield server


AUTH = (("authorization", f"Bearer {KEY}"),)


async def test_a_message_over_the_body_limit_is_resource_exhausted(keyed_server: ServerProcess) -> None:
    async with stub(keyed_server.grpc_target) as s:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.ModelInfer(infer_request(rows(40)), metadata=AUTH)  # 80 KiB of raw bytes
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details()
        answer = await s.ModelInfer(infer_request(rows(8)), metadata=AUTH)  # within it: served
        assert output_of(answer).shape == (8, D_MODEL)


async def test_the_key_is_read_from_authorization_metadata(keyed_server: ServerProcess) -> None:
    async with stub(keyed_server.grpc_target) as s:
        for metadata, reason in (((), "missing"), ((("authorization", "Bearer nope"),), "wrong")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.ModelInfer(infer_request(rows(1)), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert info.value.details() == f"{reason} API key: send the metadata 'authorization: Bearer <key>'"
            assert trailers(info.value)["ffn-error-type"] == "unauthorized"
        lower_scheme = (("authorization", f"bearer {KEY}"),)  # the scheme is case-insensitive, as over HTTP
        assert (await s.ServerLive(pb.ServerLiveRequest(), metadata=lower_scheme)).live


async def test_health_needs_no_key_and_follows_the_model_state(keyed_server: ServerProcess) -> None:
    async with grpc.aio.insecure_channel(keyed_server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService", "demo"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health.Check(health_pb2.HealthCheckRequest(service="no-such-model"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service="no-such-model"))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        watch.cancel()


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_needs_the_key_and_lists_the_services(keyed_server: ServerProcess, version: str) -> None:
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    async with grpc.aio.insecure_channel(keyed_server.grpc_target) as channel:
        # v1's messages are v1alpha's renamed (the same bytes): v1alpha's classes at v1's path.
        reflection = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        # The refused call sends nothing: a request written while the server answers can fail the
        # client's write first, and grpc then reports its own INTERNAL instead of the server's code.
        refused = reflection()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await refused.read()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answers = [a async for a in reflection(iter([ask]), metadata=AUTH)]
    names = {service.name for service in answers[0].list_services_response.service}
    assert names == {
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def test_error_kinds_each_have_a_grpc_code() -> None:
    """The one table's gRPC column: a code for every kind, never OK or UNKNOWN (a class without one fails here)."""
    for error, kind in ERRORS.items():
        assert kind.grpc in grpc.StatusCode.__members__, error  # a plain name: app.protocol imports no grpc
        assert kind.grpc not in ("OK", "UNKNOWN"), error


async def test_each_door_names_its_own_way_to_the_models_in_a_not_found_message(
    batching_server: ServerProcess,
) -> None:
    # The engine's error says what is missing; the hint is the door's: a gRPC client is never told to GET a path.
    async with httpx.AsyncClient(base_url=batching_server.url, timeout=60) as http:
        answer = await http.get("/v2/models/nope")
    assert answer.status_code == 404
    assert answer.json()["error"] == "model 'nope' is not served here; GET /v1/models lists the models"
    async with stub(batching_server.grpc_target) as s:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.ModelMetadata(pb.ModelMetadataRequest(name="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "model 'nope' is not served here; RepositoryIndex lists the models"
