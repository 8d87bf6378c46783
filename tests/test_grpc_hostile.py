"""Hostile gRPC clients against a real ffn-serve: each gets a clear status, nothing leaks, batch mates are unharmed.

Malformed protobuf, requests whose non-tensor fields would cost the parser far more than their
size, absurd shapes, bad requests in a stream, many concurrent streams, a stream that never reads
its answers, and a stream cancelled with work queued. Each with a real grpc.aio client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from ffn_testing import ServerProcess, metric_value, start_server, wait_for_metrics
from tests.grpc_helpers import D_MODEL, infer_request, output_of, stub, trailers
from tests.reference import demo_reference
from tests.slow_model import slow_model_config
from tests.test_hostile import LAYOUTS
from tests.test_overload import SlowRequest, metrics

INFER = "/inference.GRPCInferenceService/ModelInfer"


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Every case against both layouts: one process, and a front with the engine process (issue 40)."""
    env = {"FFN_LOG_LEVEL": "warning", "FFN_MAX_CONNECTIONS": "48", **LAYOUTS[request.param]}
    with start_server(env=env) as srv:
        yield srv


async def raw_call(target: str, method: str, body: bytes) -> grpc.aio.AioRpcError:
    """Send `body` as the request of `method` exactly as given, and return the error it ends with."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(method)  # no serializer: the bytes go as they are
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(body)
    return info.value


async def test_malformed_protobuf_is_invalid_argument(server: ServerProcess) -> None:
    for method in (
        INFER,
        "/inference.GRPCInferenceService/ServerMetadata",
        "/inference.GRPCInferenceService/ModelReady",
        "/grpc.health.v1.Health/Check",
    ):
        for body in (b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x2a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"):
            error = await raw_call(server.grpc_target, method, body)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, body)
            assert error.details().startswith("malformed protobuf"), error.details()
            assert trailers(error)["ffn-error-type"] == "invalid_input"


async def test_non_tensor_fields_over_the_parse_budget_are_refused_before_parsing(server: ServerProcess) -> None:
    x = rows(2)
    long_name = infer_request(x)
    long_name.id = "i" * 70_000  # 70 KB of request id
    many_parameters = infer_request(x)
    for i in range(8000):  # 110 KB: each one a field, and objects once parsed
        many_parameters.parameters[f"p{i}"].bool_param = True
    empty_outputs = pb.ModelInferRequest(model_name="demo")  # 40,000 empty outputs: 80 KB, megabytes once parsed
    empty_outputs.MergeFromString(b"\x32\x00" * 40_000)
    many_dimensions = infer_request(x)
    many_dimensions.inputs[0].shape.extend([1] * 40_000)  # packed: 40 KB of varints
    many_dimensions.id = "x" * 30_000
    async with stub(server.grpc_target) as s:
        for request, says in (
            (long_name, "more than 65536 bytes besides its tensor data"),
            (many_parameters, "more than 1024 protobuf fields"),
            (empty_outputs, "more than 1024 protobuf fields"),
            (many_dimensions, "more than 65536 bytes besides its tensor data"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.ModelInfer(request)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert says in info.value.details()
            assert trailers(info.value)["grpc-retry-pushback-ms"] == "-1"
        big = rows(256, 1)  # 512 KiB of tensor data and a few small fields: within the budget
        np.testing.assert_allclose(
            output_of(await s.ModelInfer(infer_request(big))), demo_reference(big), rtol=1e-5, atol=1e-5
        )


async def test_absurd_shapes_are_refused_with_short_messages(server: ServerProcess) -> None:
    async with stub(server.grpc_target) as s:
        for shape in ([1] * 10_000 + [D_MODEL], [-1, D_MODEL], [2**63 - 1, D_MODEL], []):
            request = pb.ModelInferRequest(model_name="demo", raw_input_contents=[b"\0" * 8])
            request.inputs.add(name="input", datatype="FP32", shape=shape)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.ModelInfer(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, shape
            assert len(info.value.details()) < 300, shape


async def test_bad_requests_do_not_harm_their_batch_mates(server: ServerProcess) -> None:
    good = [rows(1 + i % 5, 10 + i) for i in range(12)]
    nan = rows(3)
    nan[1, 7] = np.nan
    bad = [infer_request(nan), infer_request(rows(2)[:, :100]), infer_request(rows(2), parameters={"mc_passes": 0})]
    async with stub(server.grpc_target) as s:
        answers = await asyncio.gather(
            *(s.ModelInfer(infer_request(x)) for x in good),
            *(s.ModelInfer(request) for request in bad * 4),
            return_exceptions=True,
        )
    for x, answer in zip(good, answers[: len(good)], strict=True):
        assert isinstance(answer, pb.ModelInferResponse), answer
        np.testing.assert_allclose(output_of(answer), demo_reference(x), rtol=1e-5, atol=1e-5)
    refusals = answers[len(good) :]
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.INVALID_ARGUMENT for r in refusals)


# ----- streams ----------------------------------------------------------------------------------


async def test_a_stream_answers_each_request_by_id_and_survives_bad_ones(server: ServerProcess) -> None:
    async with stub(server.grpc_target) as s:
        call = s.ModelStreamInfer()
        sent = {f"r{i}": rows(1 + i, 20 + i) for i in range(4)}
        for request_id, x in sent.items():
            await call.write(infer_request(x, request_id=request_id))
        await call.write(infer_request(rows(1)[:, :3], request_id="bad"))
        await call.write(infer_request(rows(2), model="nope", request_id="unknown"))
        await call.done_writing()
        answers = [answer async for answer in call]
    assert await call.code() == grpc.StatusCode.OK
    by_id = {a.infer_response.id: a for a in answers}
    assert set(by_id) == {*sent, "bad", "unknown"}
    for request_id, x in sent.items():
        assert by_id[request_id].error_message == ""
        np.testing.assert_allclose(output_of(by_id[request_id].infer_response), demo_reference(x), rtol=1e-5, atol=1e-5)
    assert by_id["bad"].error_message == "last dimension must be d_model=512, got 3 (shape [1, 3])"
    assert by_id["unknown"].error_message.startswith("model 'nope' is not served here")


async def test_malformed_messages_in_a_stream_are_answered_and_the_stream_goes_on(server: ServerProcess) -> None:
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        call = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )()  # requests as raw bytes
        await call.write(b"\xff\xff\xff")
        await call.write(infer_request(rows(2), request_id="after").SerializeToString())
        await call.done_writing()
        answers = [answer async for answer in call]
    assert answers[0].error_message.startswith("malformed protobuf")
    assert answers[1].infer_response.id == "after" and answers[1].error_message == ""


async def test_many_concurrent_streams_are_all_answered_or_refused_past_the_call_limit(server: ServerProcess) -> None:
    """48 calls in flight at most (max_connections): 60 streams held open, the rest RESOURCE_EXHAUSTED; then all fine."""
    x = rows(2, 3)
    async with stub(server.grpc_target) as s:
        calls = [s.ModelStreamInfer() for _ in range(60)]

        async def one_round(call: grpc.aio.StreamStreamCall) -> object:
            try:
                await call.write(infer_request(x))
                return await call.read()
            except grpc.aio.AioRpcError as exc:
                return exc
            except asyncio.InvalidStateError:
                return await call.code()

        outcomes = await asyncio.gather(*(one_round(call) for call in calls))
        answered = [o for o in outcomes if isinstance(o, pb.ModelStreamInferResponse)]
        # A refused call's status may land after its read returned (EOF): wait for each one's status.
        unanswered = [c for c, o in zip(calls, outcomes, strict=True) if not isinstance(o, pb.ModelStreamInferResponse)]
        codes = [await c.code() for c in unanswered]
        details = [await c.details() for c in unanswered]
        # A call the server refuses at once can lose the race with the client's own write of its
        # request; grpc then reports the failed write (INTERNAL, "Internal error from Core")
        # instead of the server's RESOURCE_EXHAUSTED. Anything else is a wrong answer.
        refused = [
            code
            for code, detail in zip(codes, details, strict=True)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED
            or (code == grpc.StatusCode.INTERNAL and detail == "Internal error from Core")
        ]
        assert len(answered) + len(refused) == 60, list(zip(codes, details, strict=True))
        assert 0 < len(answered) <= 48 and refused
        for answer in answered:
            np.testing.assert_allclose(output_of(answer.infer_response), demo_reference(x), rtol=1e-5, atol=1e-5)
        for call in calls:
            call.cancel()
    async with stub(server.grpc_target) as s:  # the slots are freed as the server sees the cancellations
        give_up = asyncio.get_running_loop().time() + 60
        while True:
            answers = await asyncio.gather(*(s.ModelInfer(infer_request(x)) for _ in range(40)), return_exceptions=True)
            if all(isinstance(a, pb.ModelInferResponse) for a in answers):
                break
            assert all(
                isinstance(a, pb.ModelInferResponse) or a.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for a in answers
            )
            assert asyncio.get_running_loop().time() < give_up, "the cancelled streams' slots were never freed"
            await asyncio.sleep(0.1)
        assert all(output_of(a).shape == (2, D_MODEL) for a in answers)


async def test_a_stream_that_never_reads_its_answers_is_held_back(server: ServerProcess) -> None:
    """The server stops reading a stream whose answers pile up: it accepts a bounded number of its requests."""
    x = rows(64, 4)  # 128 KiB a request, 128 KiB an answer
    sent = 0
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        before = await metrics(http)
        async with stub(server.grpc_target) as s:
            call = s.ModelStreamInfer()
            request = infer_request(x)
            for _ in range(400):  # 50 MiB of answers, if the server took them all
                try:
                    await asyncio.wait_for(call.write(request), timeout=5)  # a write that waits 5 s: held back
                except TimeoutError:
                    break
                sent += 1
            accepted = metric_value(await metrics(http), "ffn_request_rows_count", model="demo") - metric_value(
                before, "ffn_request_rows_count", model="demo"
            )
            call.cancel()
        assert sent < 400, "the server read all 400 requests of a stream whose answers nobody read"
        # A batch's worth of rows in flight (16 requests), the rest in the transport's flow-control windows.
        assert accepted <= 200, f"the server accepted {accepted} requests of a stream that reads nothing"
        await wait_for_metrics(
            http, lambda m: metric_value(m, "ffn_queue_rows", model="demo") == 0, "the stream's work to be gone"
        )
    async with stub(server.grpc_target) as s:
        assert output_of(await s.ModelInfer(infer_request(x))).shape == (64, D_MODEL)


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = slow_model_config(
        tmp_path_factory.mktemp("slow-stream"), "max_wait_ms = 0\nmax_batch_rows = 4096\nwarmup = false"
    )
    with start_server(config=config) as server:
        yield server


async def test_a_stream_cancelled_with_work_queued_leaves_nothing_behind(slow_server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=slow_server.url, timeout=60) as http:
        before = await metrics(http)
        slow = SlowRequest(http)
        await slow.started(before)
        async with stub(slow_server.grpc_target) as s:
            call = s.ModelStreamInfer()
            for i in range(3):
                await call.write(infer_request(np.ones((5, D_MODEL), np.float32), "slow", request_id=str(i)))
            await wait_for_metrics(
                http, lambda m: metric_value(m, "ffn_queue_rows", model="slow") == 15, "the stream's rows queued"
            )
            call.cancel()
        await wait_for_metrics(
            http, lambda m: metric_value(m, "ffn_queue_rows", model="slow") == 0, "the cancelled stream's rows gone"
        )
        await slow.answered()
        after = await metrics(http)
    computed = metric_value(after, "ffn_batch_rows_sum", model="slow") - metric_value(
        before, "ffn_batch_rows_sum", model="slow"
    )
    assert computed == 3072  # the slow request's rows only
