"""Traces at a real OTLP receiver: a real ffn-serve exports over OTLP/HTTP, the receiver decodes what came.

The receiver (bench/otlp_receiver.py) parses each ExportTraceServiceRequest with
opentelemetry-proto's classes. Each test sends requests with a traceparent or an X-Request-Id of
its own and waits for exactly those spans, so the tests share one server and one receiver.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest

from bench.otlp_receiver import OtlpReceiver, ReceivedSpan
from ffn_testing import ServerProcess, start_server
from tests.grpc_helpers import infer_request, output_of, stub, trailers
from tests.reference import demo_reference

D = 512
STAGES = ("decode", "queue", "compute", "encode")
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SpanKind
CLOCK_SLACK_NS = 1_000_000  # stage times come from two clocks (wall and perf_counter), matched to ~1 µs


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


# Every test of the `server` fixture runs against each layout: one process, and a front with its
# engine process (shared_engine), where the request spans are the front's and the batch spans the engine's.
LAYOUTS = {"one process": {}, "shared engine": {"FFN_SHARED_ENGINE": "true"}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(receiver: OtlpReceiver, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    env = {
        "FFN_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: spans leave soon after they end
        "OTEL_SERVICE_NAME": "ffn-under-test",
        "FFN_LOG_LEVEL": "warning",
        **LAYOUTS[request.param],
    }
    receiver.forget()  # the other layout's spans, whose request ids the tests use again
    with start_server(env=env) as running:
        yield running


def new_ids() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


def v2_body(rows: int, request_id: str | None = None, seed: int = 0) -> tuple[dict, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((rows, D)).astype(np.float32)
    body: dict = {"inputs": [{"name": "input", "shape": [rows, D], "datatype": "FP32", "data": x.ravel().tolist()}]}
    if request_id is not None:
        body["id"] = request_id
    return body, x


def spans_of(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [span for span in spans if span.trace_id == trace_id]


def by_request_id(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan | None:
    return next((s for s in spans if s.kind == SERVER_KIND and s.attributes.get("ffn.request_id") == request_id), None)


def test_a_traced_v2_request_has_its_parent_its_stages_and_its_batch(
    server: ServerProcess, receiver: OtlpReceiver
) -> None:
    trace_id, parent_id = new_ids()
    body, x = v2_body(3, request_id="v2-id-7")
    response = httpx.post(
        f"{server.url}/v2/models/demo/infer",
        json=body,
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-Id": "client-req-1"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(
        np.array(response.json()["outputs"][0]["data"]).reshape(x.shape), demo_reference(x), rtol=1e-4, atol=1e-4
    )
    assert response.headers["x-request-id"] == "client-req-1"

    spans = receiver.wait_for(lambda spans: len(spans_of(spans, trace_id)) >= 1 + len(STAGES))
    mine = spans_of(spans, trace_id)
    (request,) = [span for span in mine if span.kind == SERVER_KIND]
    assert request.name == "POST /v2/models/{name}/infer"
    assert request.parent_span_id == parent_id  # a child of the client's span
    assert request.attributes["ffn.request_id"] == "client-req-1"
    assert request.attributes["ffn.v2_id"] == "v2-id-7"
    assert request.attributes["ffn.model_name"] == "demo"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["http.route"] == "/v2/models/{name}/infer"
    assert request.resource["service.name"] == "ffn-under-test"
    # The answer names the request span, in the client's trace.
    assert response.headers["traceparent"] == f"00-{trace_id}-{request.span_id}-01"

    stages = {span.name: span for span in mine if span.name in STAGES}
    assert set(stages) == set(STAGES)
    for stage in stages.values():
        assert stage.parent_span_id == request.span_id
        assert stage.attributes["ffn.request_id"] == "client-req-1"
        assert stage.attributes["ffn.v2_id"] == "v2-id-7"
        assert request.start_ns - CLOCK_SLACK_NS <= stage.start_ns <= stage.end_ns <= request.end_ns + CLOCK_SLACK_NS
    order = [stages[name] for name in STAGES]
    for before, after in itertools.pairwise(order):
        assert before.end_ns <= after.start_ns + CLOCK_SLACK_NS, (before.name, after.name)
    assert stages["compute"].attributes["ffn.batches"] == 1

    # The batch it rode in: a span of its own trace, linked both ways.
    (link,) = request.links
    batch = receiver.wait_for(lambda spans: any(s.span_id == link[1] for s in spans))
    (batch_span,) = [s for s in batch if s.span_id == link[1]]
    assert batch_span.name == "batch" and batch_span.trace_id == link[0] != trace_id
    assert (trace_id, request.span_id) in batch_span.links
    assert batch_span.attributes["ffn.batch.rows"] >= 3
    assert batch_span.attributes["ffn.batch.bucket"] == batch_span.attributes["ffn.batch.rows"]  # CPU: unpadded
    assert batch_span.attributes["ffn.batch.device"] == "cpu"
    assert "client-req-1" in batch_span.attributes["ffn.request_ids"]
    assert (batch_span.start_ns, batch_span.end_ns) == (stages["compute"].start_ns, stages["compute"].end_ns)


def test_a_native_request_without_traceparent_starts_a_trace_and_gets_an_id(
    server: ServerProcess, receiver: OtlpReceiver
) -> None:
    x = np.ones((2, D), np.float32)
    response = httpx.post(
        f"{server.url}/v1/models/demo/transform",
        content=x.tobytes(),
        headers={"Content-Type": "application/octet-stream", "X-Shape": f"2,{D}"},
        timeout=60,
    )
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]  # generated, since the client sent none
    version, trace_id, span_id, flags = response.headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled (a new root's trace id also says "random": 03)
    spans = receiver.wait_for(lambda spans: by_request_id(spans, request_id) is not None)
    request = by_request_id(spans, request_id)
    assert request is not None
    assert (request.trace_id, request.span_id, request.parent_span_id) == (trace_id, span_id, "")
    assert request.name == "POST /v1/models/{name}/transform"
    assert "ffn.v2_id" not in request.attributes


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        f"00-{'0' * 32}-{'1' * 16}-01",  # an all-zero trace id is invalid
        f"00-{'a' * 32}-{'0' * 16}-01",  # so is an all-zero parent id
        f"ff-{'a' * 32}-{'b' * 16}-01",  # version ff is forbidden
        f"00-{'A' * 32}-{'b' * 16}-01",  # upper-case hex
        f"00-{'a' * 32}-{'b' * 16}-01-extra",  # version 00 has exactly four fields
        "00-" + "a" * 5000,
    ],
)
def test_an_invalid_traceparent_starts_a_new_trace(
    server: ServerProcess, receiver: OtlpReceiver, traceparent: str
) -> None:
    request_id = "bad-parent-" + secrets.token_hex(4)
    body, _ = v2_body(1)
    response = httpx.post(
        f"{server.url}/v2/models/demo/infer",
        json=body,
        headers={"traceparent": traceparent, "X-Request-Id": request_id},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    spans = receiver.wait_for(lambda spans: by_request_id(spans, request_id) is not None)
    request = by_request_id(spans, request_id)
    assert request is not None and request.parent_span_id == ""
    assert request.trace_id not in traceparent
    assert response.headers["traceparent"].startswith(f"00-{request.trace_id}-{request.span_id}-")


def test_two_traceparent_headers_start_a_new_trace(server: ServerProcess, receiver: OtlpReceiver) -> None:
    trace_id, parent_id = new_ids()
    request_id = "two-parents"
    body, _ = v2_body(1)
    value = f"00-{trace_id}-{parent_id}-01"
    headers = [("traceparent", value), ("traceparent", value), ("X-Request-Id", request_id)]
    response = httpx.post(f"{server.url}/v2/models/demo/infer", json=body, headers=headers, timeout=60)
    assert response.status_code == 200
    request = by_request_id(receiver.wait_for(lambda s: by_request_id(s, request_id) is not None), request_id)
    assert request is not None and request.trace_id != trace_id and request.parent_span_id == ""


def test_a_parent_that_is_not_sampled_is_followed(server: ServerProcess, receiver: OtlpReceiver) -> None:
    """The default sampler, parentbased_always_on, records nothing under a parent that was not sampled."""
    body, _ = v2_body(1)
    trace_id, parent_id = new_ids()
    quiet = httpx.post(
        f"{server.url}/v2/models/demo/infer",
        json=body,
        headers={"traceparent": f"00-{trace_id}-{parent_id}-00", "X-Request-Id": "not-sampled"},
        timeout=60,
    )
    assert quiet.status_code == 200 and "traceparent" not in quiet.headers
    # A sampled request after it: spans leave in the order they end, so once its spans are in,
    # the first request's would be too, had it any.
    loud = httpx.post(f"{server.url}/v2/models/demo/infer", json=body, headers={"X-Request-Id": "sampled"}, timeout=60)
    assert loud.status_code == 200
    spans = receiver.wait_for(lambda spans: by_request_id(spans, "sampled") is not None)
    assert by_request_id(spans, "not-sampled") is None
    assert spans_of(spans, trace_id) == []


def test_a_failed_request_is_traced_with_its_error(server: ServerProcess, receiver: OtlpReceiver) -> None:
    body, _ = v2_body(1, request_id="short-row")
    body["inputs"][0]["data"] = body["inputs"][0]["data"][:-1]
    response = httpx.post(
        f"{server.url}/v2/models/demo/infer", json=body, headers={"X-Request-Id": "fails-400"}, timeout=60
    )
    assert response.status_code == 400
    assert response.json()["request_id"] == "fails-400" and response.json()["id"] == "short-row"
    spans = receiver.wait_for(lambda spans: by_request_id(spans, "fails-400") is not None)
    request = by_request_id(spans, "fails-400")
    assert request is not None
    assert request.attributes["http.response.status_code"] == 400
    assert request.attributes["error.type"] == "invalid_input"
    assert request.attributes["ffn.v2_id"] == "short-row"
    assert request.status_code == 0  # a client's error leaves a server span's status unset
    # It never reached a batch: no stage ran to its end.
    assert [s.name for s in spans_of(spans, request.trace_id) if s.span_id != request.span_id] == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.server
def test_a_monte_carlo_request_has_one_compute_span_with_an_event_per_slice(
    receiver: OtlpReceiver, layout: str
) -> None:
    """max_batch_rows 8 and 4 rows: 2 passes a slice, so 6 passes run in 3 slices."""
    env = {
        "FFN_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "FFN_MAX_BATCH_ROWS": "8",
        "FFN_LOG_LEVEL": "warning",
        **LAYOUTS[layout],
    }
    request_id = "mc-" + layout.replace(" ", "-")
    with start_server(env=env) as server:
        x = np.ones((4, D), np.float32)
        response = httpx.post(
            f"{server.url}/v1/models/demo/transform?mc_passes=6&mc_seed=3&mc_dropout=0.1",
            content=x.tobytes(),
            headers={"Content-Type": "application/octet-stream", "X-Shape": f"4,{D}", "X-Request-Id": request_id},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        spans = receiver.wait_for(lambda spans: by_request_id(spans, request_id) is not None)
        request = by_request_id(spans, request_id)
        assert request is not None and request.links == []  # Monte Carlo requests ride in no batch
        stages = {s.name: s for s in spans_of(spans, request.trace_id) if s.parent_span_id == request.span_id}
        assert set(stages) == set(STAGES)
        compute = stages["compute"]
        assert compute.attributes["ffn.mc.passes"] == 6 and compute.attributes["ffn.mc.slices"] == 3
        assert [(name, attributes["ffn.mc.passes_done"]) for name, _, attributes in compute.events] == [
            ("slice", 2),
            ("slice", 4),
            ("slice", 6),
        ]
        assert compute.start_ns <= compute.events[0][1] <= compute.events[-1][1] == compute.end_ns


async def test_requests_that_share_a_batch_all_link_to_its_one_span(
    receiver: OtlpReceiver, start_app, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process, four 1-row requests against a batch of 4 rows cut only when full (or after a second)."""
    from app.config.settings import Settings

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    served = await start_app(Settings(otlp_endpoint=receiver.url, max_batch_rows=4, max_wait_ms=1000, warmup=False))
    ids = [f"shared-{i}" for i in range(4)]
    bodies = [v2_body(1, seed=i)[0] for i in range(4)]
    responses = await asyncio.gather(
        *(
            served.client.post("/v2/models/demo/infer", json=body, headers={"X-Request-Id": request_id})
            for body, request_id in zip(bodies, ids, strict=True)
        )
    )
    assert [r.status_code for r in responses] == [200] * 4
    spans = await asyncio.to_thread(
        receiver.wait_for, lambda spans: all(by_request_id(spans, i) is not None for i in ids)
    )
    requests = [by_request_id(spans, i) for i in ids]
    links = {tuple(r.links) for r in requests if r is not None}
    assert len(links) == 1  # one batch for the four
    ((batch_trace, batch_id),) = links.pop()
    batch = await asyncio.to_thread(receiver.wait_for, lambda spans: any(s.span_id == batch_id for s in spans))
    (batch_span,) = [s for s in batch if s.span_id == batch_id]
    assert batch_span.trace_id == batch_trace
    assert batch_span.attributes["ffn.batch.rows"] == 4 and batch_span.attributes["ffn.batch.requests"] == 4
    assert sorted(batch_span.attributes["ffn.request_ids"]) == ids
    assert sorted(batch_span.links) == sorted((r.trace_id, r.span_id) for r in requests if r is not None)


def test_health_probes_are_not_traced(server: ServerProcess, receiver: OtlpReceiver) -> None:
    # The probes take the fast path, as the tensor routes do; an orchestrator's probes every few
    # seconds would otherwise fill the traces. A traced request sent after them marks the moment
    # by which their spans, had there been any, would have arrived.
    for path in ("/v2/health/live", "/v2/health/ready"):
        response = httpx.get(f"{server.url}{path}", headers={"X-Request-Id": "probe-" + path[-4:]}, timeout=60)
        assert response.status_code == 200 and "traceparent" not in response.headers
    request_id = "after-the-probes-" + secrets.token_hex(4)
    body, _ = v2_body(1)
    response = httpx.post(
        f"{server.url}/v2/models/demo/infer", json=body, headers={"X-Request-Id": request_id}, timeout=60
    )
    assert response.status_code == 200
    spans = receiver.wait_for(lambda spans: by_request_id(spans, request_id) is not None)
    assert not [s for s in spans if str(s.attributes.get("ffn.request_id", "")).startswith("probe-")]
    assert not [s for s in spans if "health" in s.name]


# ----- the gRPC door: the same request ids and the same traces ----------------------------------

GRPC_REQUEST = "inference.GRPCInferenceService/ModelInfer"
GENERATED = re.compile(r"[0-9a-f]{20}")  # 12 hex digits of the process, 8 of its counter


async def test_a_grpc_infer_with_a_traceparent_joins_the_callers_trace(
    server: ServerProcess, receiver: OtlpReceiver
) -> None:
    trace_id, parent_id = new_ids()
    x = np.random.default_rng(3).standard_normal((3, D)).astype(np.float32)
    metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"), ("x-request-id", "grpc-client-1"))
    async with stub(server.grpc_target) as client:
        call = client.ModelInfer(infer_request(x, request_id="v2-grpc-7"), metadata=metadata, timeout=60)
        response = await call
        answered = dict(await call.trailing_metadata())
    np.testing.assert_allclose(output_of(response), demo_reference(x), rtol=1e-4, atol=1e-4)
    assert answered["x-request-id"] == "grpc-client-1"

    spans = await asyncio.to_thread(receiver.wait_for, lambda spans: len(spans_of(spans, trace_id)) >= 1 + len(STAGES))
    mine = spans_of(spans, trace_id)
    (request,) = [span for span in mine if span.kind == SERVER_KIND]
    assert request.name == GRPC_REQUEST
    assert request.parent_span_id == parent_id  # a child of the client's span, as over HTTP
    assert request.attributes["rpc.system"] == "grpc"
    assert request.attributes["rpc.service"] == "inference.GRPCInferenceService"
    assert request.attributes["rpc.method"] == "ModelInfer"
    assert request.attributes["rpc.grpc.status_code"] == 0
    assert request.attributes["ffn.request_id"] == "grpc-client-1"
    assert request.attributes["ffn.model_name"] == "demo"
    assert answered["traceparent"] == f"00-{trace_id}-{request.span_id}-01"
    stages = {span.name for span in mine if span.parent_span_id == request.span_id}
    assert stages == set(STAGES)
    assert len(request.links) == 1  # the batch it rode in


async def test_a_grpc_call_gets_an_id_of_the_servers_unless_it_sent_a_valid_one(server: ServerProcess) -> None:
    x = np.ones((1, D), np.float32)
    async with stub(server.grpc_target) as client:
        for metadata in ((), (("x-request-id", "has space"),), (("x-request-id", "x" * 201),)):
            call = client.ModelInfer(infer_request(x), metadata=metadata, timeout=60)
            response = await call  # a bad id never costs the request
            np.testing.assert_allclose(output_of(response), demo_reference(x), rtol=1e-4, atol=1e-4)
            assert GENERATED.fullmatch(dict(await call.trailing_metadata())["x-request-id"]), metadata


async def test_a_failed_grpc_call_carries_its_id_and_is_traced_with_its_error(
    server: ServerProcess, receiver: OtlpReceiver
) -> None:
    async with stub(server.grpc_target) as client:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await client.ModelInfer(
                infer_request(np.ones((1, 3), np.float32)), metadata=(("x-request-id", "grpc-fails"),), timeout=60
            )
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailers(failed.value)["x-request-id"] == "grpc-fails"
    assert trailers(failed.value)["ffn-error-type"] == "invalid_input"
    spans = await asyncio.to_thread(receiver.wait_for, lambda spans: by_request_id(spans, "grpc-fails") is not None)
    request = by_request_id(spans, "grpc-fails")
    assert request is not None and request.name == GRPC_REQUEST
    assert request.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert request.attributes["error.type"] == "invalid_input"
    assert request.status_code != 2  # the caller's mistake is not the server span's error


async def test_each_message_of_a_grpc_stream_is_a_traced_request_named_after_the_call(
    server: ServerProcess, receiver: OtlpReceiver
) -> None:
    sent = {name: np.random.default_rng(i).standard_normal((2, D)).astype(np.float32) for i, name in enumerate("ab")}
    async with stub(server.grpc_target) as client:
        call = client.ModelStreamInfer(metadata=(("x-request-id", "grpc-stream"),), timeout=60)
        for name, x in sent.items():
            await call.write(infer_request(x, request_id=name))
        await call.done_writing()
        answers = {answer.infer_response.id: answer async for answer in call}
        assert dict(await call.trailing_metadata())["x-request-id"] == "grpc-stream"
    for name, x in sent.items():
        assert answers[name].error_message == ""
        np.testing.assert_allclose(output_of(answers[name].infer_response), demo_reference(x), rtol=1e-4, atol=1e-4)
    ids = ["grpc-stream.1", "grpc-stream.2"]
    spans = await asyncio.to_thread(receiver.wait_for, lambda spans: all(by_request_id(spans, i) for i in ids))
    for request_id in ids:
        request = by_request_id(spans, request_id)
        assert request is not None and request.attributes["rpc.method"] == "ModelStreamInfer"


async def test_a_traced_request_handed_to_an_engine_links_to_the_batch_it_shared_with_untraced_ones(
    receiver: OtlpReceiver, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-off on its own (app/handoff): a front's traced request and three untraced ones, one row
    each, in the engine's one batch of 4 rows (cut only when full, or after a second). The engine's batch
    span names the traced request and counts all four; the front's request span links to it, and its
    queue and compute stages are the engine's times."""
    from app.config.settings import Settings
    from app.config.tracing import traces_export
    from app.engine.registry import Registry
    from app.engine.service import Engine
    from app.handoff.engine import EngineServer
    from app.handoff.front import Ask, EngineClient
    from app.observe.identity import CURRENT, RequestContext
    from app.observe.metrics import Metrics
    from app.tracing import TraceSettings
    from app.tracing.spans import Tracing
    from ffn_core.dtypes import DTYPES

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    export = traces_export(receiver.url, {})
    assert export is not None
    settings = Settings(max_batch_rows=4, max_wait_ms=1000, warmup=False)
    engine = Engine(settings, Registry(settings, Metrics()))
    engine_tracing, front_tracing = (
        Tracing(export, TraceSettings(tracing=True)),
        Tracing(export, TraceSettings(tracing=True)),
    )
    await engine.start()
    engine.on_serving(engine_tracing.observe)
    await engine.until_warm()
    server = EngineServer(engine, tmp_path / "engine.sock", engine_tracing)
    await server.start()
    client = EngineClient(tmp_path / "engine.sock")
    try:
        trace_id, parent_id = new_ids()
        traced = RequestContext("handed-off-1")
        token = CURRENT.set(traced)
        try:
            trace = front_tracing.begin(
                "POST traced", [(b"traceparent", f"00-{trace_id}-{parent_id}-01".encode())], {}, "demo"
            )
        finally:
            CURRENT.reset(token)
        assert trace is not None
        inputs = [np.random.default_rng(i).standard_normal((1, D)).astype(np.float32) for i in range(4)]
        f32 = DTYPES["float32"]
        answers = await asyncio.gather(
            client.infer(Ask("demo", None, inputs[0], f32, deadline=None, context=traced)),
            # Untraced, sent in one turn: they cross in one frame and the engine queues them as one group.
            *(
                client.infer(Ask("demo", None, x, f32, deadline=None, context=RequestContext(f"untraced-{i}")))
                for i, x in enumerate(inputs[1:], 1)
            ),
        )
        for x, y in zip(inputs, answers, strict=True):
            np.testing.assert_allclose(y, demo_reference(x), rtol=1e-4, atol=1e-4)
        trace.end()
        await front_tracing.shutdown()
        spans = await asyncio.to_thread(receiver.wait_for, lambda spans: len(spans_of(spans, trace_id)) >= 3)
        request = next(s for s in spans_of(spans, trace_id) if s.kind == SERVER_KIND)
        stages = {s.name: s for s in spans_of(spans, trace_id) if s.parent_span_id == request.span_id}
        assert set(stages) == {"queue", "compute"}  # this front decoded and encoded nothing
        ((batch_trace, batch_id),) = request.links
        batch = await asyncio.to_thread(receiver.wait_for, lambda spans: any(s.span_id == batch_id for s in spans))
        (batch_span,) = [s for s in batch if s.span_id == batch_id]
        assert batch_span.trace_id == batch_trace != trace_id
        assert batch_span.links == [(trace_id, request.span_id)]
        assert batch_span.attributes["ffn.batch.rows"] == 4 and batch_span.attributes["ffn.batch.requests"] == 4
        # Every request crosses with its id, traced or not: the batch span lists all four, as in one process.
        assert sorted(batch_span.attributes["ffn.request_ids"]) == [
            "handed-off-1",
            "untraced-1",
            "untraced-2",
            "untraced-3",
        ]
        assert (batch_span.start_ns, batch_span.end_ns) == (stages["compute"].start_ns, stages["compute"].end_ns)
        assert stages["queue"].end_ns == stages["compute"].start_ns
    finally:
        await client.close()
        await server.close()
        await engine.stop()
        await engine_tracing.shutdown()
