"""The lean path (app/http/transport/lean.py) keeps every rule of the full one.

The differential test sends each case of the suite's bad-input catalogues (tests/test_hostile.py)
and a set of the protocol's own (negotiation, auth, limits, framing, escapes, Monte Carlo,
compression) to two real servers, one serving plain tensor requests below ASGI (the default) and
one with `FFN_LEAN_PATH=false`, where FastAPI answers everything, in both layouts (one process, and
a front with the engine process); status, error body and the
headers that carry meaning must be equal. The in-process tests prove that the lean path is the one
answering, that its answers are right (numpy's FFN), and that a client hanging up gives back what
its request held.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import numpy as np
import orjson
import pytest
import uvicorn

from app.config.settings import Settings
from app.http.transport import lean
from app.http.transport.direct_body import DIRECT_BODY_BYTES
from app.http.transport.protocol import BODY_PAST_PARSER_BYTES, uvicorn_options
from app.main import create_app
from ffn_client.http1 import Response, read_response
from ffn_testing import ServerProcess, http_request, raw_request, start_server
from tests.reference import assert_close, demo_reference
from tests.test_hostile import JSON_CASES, NPY_CASES, RAW_CASES, V2_BINARY_CASES, V2_JSON_CASES, v2_binary
from tests.wire import npy_bytes, raw_headers

D = 512
KEY = "lean-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20
V1 = "/v1/models/demo/transform"
V2 = "/v2/models/demo/infer"
PREDICT = "/v1/models/demo:predict"
ID = {"X-Request-Id": "one-id-for-both"}  # else error bodies differ by their ids
x = np.random.default_rng(7).standard_normal((3, D)).astype(np.float32)
RAW = raw_headers((3, D))
LARGE = np.random.default_rng(8).standard_normal((-(-BODY_PAST_PARSER_BYTES // (4 * D)) + 8, D)).astype(np.float32)
# Most of its body is read straight into the request's buffer (app/http/transport/direct_body.py).
HUGE = np.random.default_rng(9).standard_normal((8 * DIRECT_BODY_BYTES // (4 * D), D)).astype(np.float32)
COMPARED = (
    "content-type",
    "x-shape",
    "x-dtype",
    "retry-after",
    "x-model-digest",
    "x-request-id",
    "content-encoding",
    "inference-header-content-length",
)
JSON = {"Content-Type": "application/json"}


def _v2(**fields: object) -> bytes:
    tensor = {"name": "input", "shape": [3, D], "datatype": "FP32", "data": x.ravel().tolist()}
    return orjson.dumps({"inputs": [tensor], **fields})


def _v2_binary(array: np.ndarray, datatype: str = "FP32", **fields: object) -> tuple[dict[str, str], bytes]:
    tensor = {"name": "input", "shape": list(array.shape), "datatype": datatype}
    tensor["parameters"] = {"binary_data_size": array.nbytes}
    header = orjson.dumps({"inputs": [tensor], **fields})
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    return headers, header + array.tobytes()


Case = tuple[str, dict[str, str], bytes]  # path, headers, body: a POST
CASES: dict[str, Case] = {
    **{f"json {name}": (V1, {"Content-Type": "application/json"}, body) for name, body in JSON_CASES.items()},
    **{f"raw {name}": (V1, headers, body) for name, (headers, body) in RAW_CASES.items()},
    **{f"npy {name}": (V1, {"Content-Type": "application/x-npy"}, body) for name, body in NPY_CASES.items()},
    **{f"v2 json {name}": (V2, JSON, body) for name, body in V2_JSON_CASES.items()},
    **{f"v2 binary {name}": (V2, headers, body) for name, (headers, body) in V2_BINARY_CASES.items()},
    "v2 json": (V2, JSON, _v2(id="7")),
    "v2 json, no content type": (V2, {}, _v2()),
    "v2 json answered binary": (V2, JSON, _v2(parameters={"binary_data_output": True})),
    "v2 json output asked by name": (V2, JSON, _v2(outputs=[{"name": "output", "parameters": {"binary_data": True}}])),
    "v2 json timeout": (V2, JSON, _v2(parameters={"timeout": 60_000_000})),
    "v2 json monte carlo": (V2, JSON, _v2(parameters={"mc_passes": 3, "mc_seed": 1, "mc_dropout": 0.1})),
    "v2 json monte carlo too many passes": (V2, JSON, _v2(parameters={"mc_passes": 100_000})),
    "v2 json sequence extension": (V2, JSON, _v2(parameters={"sequence_id": 1})),
    "v2 json text/plain": (V2, {"Content-Type": "text/plain"}, _v2()),
    "v2 binary": (V2, *_v2_binary(x)),
    "v2 binary fp16": (V2, *_v2_binary(x.astype(np.float16), "FP16")),
    "v2 binary bf16": (V2, *_v2_binary((x.view(np.uint32) >> 16).astype(np.uint16), "BF16")),
    "v2 binary answered binary": (V2, *_v2_binary(x, parameters={"binary_data_output": True})),
    "v2 binary with an id": (V2, *_v2_binary(x, id="req-1")),
    "v2 binary header length not a number": (
        V2,
        {**v2_binary(4 * D, np.ones(D, np.float32).tobytes())[0], "Inference-Header-Content-Length": "-1"},
        v2_binary(4 * D, np.ones(D, np.float32).tobytes())[1],
    ),
    "v2 versioned": ("/v2/models/demo/versions/1/infer", *_v2_binary(x)),
    "v2 wrong version": ("/v2/models/demo/versions/2/infer", *_v2_binary(x)),
    "v2 unknown model": ("/v2/models/nope/infer", JSON, _v2()),
    "v2 compressed answer": (V2, {**JSON, "Accept-Encoding": "gzip"}, _v2()),
    "kserve v1": (PREDICT, JSON, orjson.dumps({"instances": x.tolist()})),
    "kserve v1 instances of sequences": (PREDICT, JSON, orjson.dumps({"instances": [x.tolist()]})),
    "kserve v1 ragged instances": (PREDICT, JSON, orjson.dumps({"instances": [x[0].tolist(), x[1, :7].tolist()]})),
    "kserve v1 inputs, not instances": (PREDICT, JSON, orjson.dumps({"inputs": x.tolist()})),
    "kserve v1 nan": (PREDICT, JSON, orjson.dumps({"instances": [x[0].tolist()]}).replace(b"[[", b"[[NaN,", 1)),
    "kserve v1 not json": (PREDICT, JSON, b"instances"),
    "kserve v1 text/plain": (PREDICT, {"Content-Type": "text/plain"}, orjson.dumps({"instances": x.tolist()})),
    "kserve v1 unknown model": ("/v1/models/nope:predict", JSON, orjson.dumps({"instances": x.tolist()})),
    "kserve v1 compressed answer": (
        PREDICT,
        {**JSON, "Accept-Encoding": "deflate"},
        orjson.dumps({"instances": x.tolist()}),
    ),
    "raw": (V1, RAW, x.tobytes()),
    "raw answered as json": (V1, {**RAW, "accept": "application/json"}, x.tobytes()),
    "raw answered as npy": (V1, {**RAW, "accept": "application/x-npy"}, x.tobytes()),
    "raw float16": (V1, raw_headers((3, D), "float16"), x.astype(np.float16).tobytes()),
    "raw float16 answered as json": (
        V1,
        {**raw_headers((3, D), "float16"), "accept": "application/json"},
        x.astype(np.float16).tobytes(),
    ),
    "raw bfloat16": (V1, raw_headers((3, D), "bfloat16"), (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()),
    "raw bfloat16 answered as npy": (
        V1,
        {**raw_headers((3, D), "bfloat16"), "accept": "application/x-npy"},
        (x.view(np.uint32) >> 16).astype(np.uint16).tobytes(),
    ),
    "raw batch, seq": (V1, raw_headers((1, 3, D)), x.tobytes()),
    "json": (V1, {"Content-Type": "application/json"}, orjson.dumps({"inputs": x.tolist()})),
    "json answered raw": (
        V1,
        {"Content-Type": "application/json", "accept": "application/octet-stream"},
        orjson.dumps({"inputs": x.tolist()}),
    ),
    "no content type": (V1, {}, orjson.dumps({"inputs": x.tolist()})),
    "npy": (V1, {"Content-Type": "application/x-npy", "accept": "application/x-npy"}, npy_bytes(x)),
    "npy float16 answered raw": (
        V1,
        {"Content-Type": "application/x-npy", "accept": "application/octet-stream"},
        npy_bytes(x.astype(np.float16)),
    ),
    "accept with q-values": (V1, {**RAW, "accept": "text/html;q=1, application/x-npy;q=0.5"}, x.tobytes()),
    "accept text/html": (V1, {**RAW, "accept": "text/html"}, x.tobytes()),
    "npy answer of bfloat16": (
        V1,
        {**raw_headers((3, D), "bfloat16"), "accept": "application/x-npy"},
        x[:, :-1].tobytes(),
    ),
    "content type text/plain": (V1, {"Content-Type": "text/plain"}, x.tobytes()),
    "x-shape wrong d_model": (V1, raw_headers((3, 7)), x.tobytes()),
    "unknown model": ("/v1/models/nope/transform", RAW, x.tobytes()),
    "escaped model name": ("/v1/models/de%6Do/transform", RAW, x.tobytes()),
    "trailing slash": (V1 + "/", RAW, x.tobytes()),
    "monte carlo query": (V1 + "?mc_passes=3&mc_seed=1", RAW, x.tobytes()),
    "unknown query": (V1 + "?passes=3", RAW, x.tobytes()),
    "timeout header not a number": (V1, {**RAW, "X-Timeout-Ms": "soon"}, x.tobytes()),
    "timeout header zero": (V1, {**RAW, "X-Timeout-Ms": "0"}, x.tobytes()),
    "timeout header generous": (V1, {**RAW, "X-Timeout-Ms": "60000"}, x.tobytes()),
    "answer compressed": (V1, {**RAW, "Accept-Encoding": "gzip"}, x.tobytes()),
    "answer identity": (V1, {**RAW, "Accept-Encoding": "identity"}, x.tobytes()),
    "content-encoding br": (V1, {**RAW, "Content-Encoding": "br"}, x.tobytes()),
    "transfer-encoding gzip": (V1, {**RAW, "Transfer-Encoding": "gzip, chunked"}, b"0\r\n\r\n"),
    "body over max_body_bytes": (V1, raw_headers((700, D)), np.zeros((700, D), np.float32).tobytes()),
    # Bodies of BODY_PAST_PARSER_BYTES or more: the lean path takes them past the parser (protocol.py).
    "large raw": (V1, raw_headers(LARGE.shape), LARGE.tobytes()),
    "large raw answered as json": (V1, {**raw_headers(LARGE.shape), "accept": "application/json"}, LARGE.tobytes()),
    "large raw a row short": (V1, raw_headers(LARGE.shape), LARGE[:-1].tobytes()),
    "large raw with a nan": (V1, raw_headers(LARGE.shape), np.where(LARGE > 2.5, np.nan, LARGE).tobytes()),
    "large npy": (V1, {"Content-Type": "application/x-npy"}, npy_bytes(LARGE)),
    "large json": (V1, JSON, orjson.dumps({"inputs": LARGE.tolist()})),
    "large v2 binary": (V2, *_v2_binary(LARGE)),
    "large kserve v1": (PREDICT, JSON, orjson.dumps({"instances": LARGE.tolist()})),
    "huge raw": (V1, raw_headers(HUGE.shape), HUGE.tobytes()),
    "huge raw a row short": (V1, raw_headers(HUGE.shape), HUGE[:-1].tobytes()),
    "huge raw with a nan": (V1, raw_headers(HUGE.shape), np.where(HUGE > 3.5, np.nan, HUGE).tobytes()),
    "huge npy": (V1, {"Content-Type": "application/x-npy"}, npy_bytes(HUGE)),
    "huge v2 binary": (V2, *_v2_binary(HUGE)),
    "huge v2 binary answered binary": (V2, *_v2_binary(HUGE, parameters={"binary_data_output": True})),
}
NO_KEY: dict[str, Case] = {  # sent without the key (the rest carry it)
    "no key": (V1, RAW, x.tobytes()),
    "wrong key": (V1, {**RAW, "Authorization": "Bearer nope"}, x.tobytes()),
    "other scheme": (V1, {**RAW, "Authorization": f"Basic {KEY}"}, x.tobytes()),
}


@pytest.fixture(scope="module", params=["one process", "a front and the engine"])
def servers(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A server with the lean path and one without; one process each, or one front and an engine process each."""
    env = {"FFN_API_KEY": KEY, "FFN_MAX_BODY_BYTES": str(BODY_LIMIT), "FFN_WARMUP": "0", "FFN_ACCESS_LOG": "true"}
    if request.param == "a front and the engine":
        env |= {"FFN_SHARED_ENGINE": "true", "FFN_WORKERS": "1"}
    with start_server(env=env) as lean_server, start_server(env={**env, "FFN_LEAN_PATH": "false"}) as full_server:
        yield lean_server, full_server


async def _both(servers: tuple[ServerProcess, ServerProcess], case: Case, key: bool = True) -> list[Response]:
    path, headers, body = case
    sent = {**(AUTH if key else {}), **ID, **headers}
    # One connection each, kept open: an answer given before the body is read is not lost to a reset.
    return [await raw_request(server.port, http_request("POST", path, sent, body, close=False)) for server in servers]


def _assert_alike(lean_answer: Response, full_answer: Response) -> None:
    assert lean_answer.status == full_answer.status, (lean_answer.body[:300], full_answer.body[:300])
    assert {h: lean_answer.headers.get(h) for h in COMPARED} == {h: full_answer.headers.get(h) for h in COMPARED}
    assert lean_answer.body == full_answer.body


@pytest.mark.parametrize("case", list(CASES))
async def test_the_lean_path_answers_as_fastapi_does(servers, case: str) -> None:
    lean_answer, full_answer = await _both(servers, CASES[case])
    _assert_alike(lean_answer, full_answer)


@pytest.mark.parametrize("case", list(NO_KEY))
async def test_the_lean_path_asks_for_the_key_as_fastapi_does(servers, case: str) -> None:
    lean_answer, full_answer = await _both(servers, NO_KEY[case], key=False)
    assert lean_answer.status == 401
    _assert_alike(lean_answer, full_answer)


async def test_the_access_log_has_the_same_line_for_a_lean_request(servers) -> None:
    path, headers, body = CASES["raw"]
    for server in servers:
        sent = {**AUTH, **headers, "X-Request-Id": "access-line-1"}
        answer = await raw_request(server.port, http_request("POST", path, sent, body, close=False))
        assert answer.status == 200
    for server in servers:
        lines = [line for line in server.logs().splitlines() if "access-line-1" in line]
        assert len(lines) == 1 and f'"POST {V1} HTTP/1.1" 200' in lines[0], server.logs()[-2000:]


async def test_a_hostile_case_leaves_the_lean_server_serving_right(servers) -> None:
    for case in ("json nan", "raw body-shorter-than-shape", "npy code-in-header"):
        await _both(servers, CASES[case])
    lean_answer, _ = await _both(servers, CASES["raw"])
    assert lean_answer.status == 200
    assert_close(np.frombuffer(lean_answer.body, np.float32).reshape(3, D), demo_reference(x))


# ----- in-process: the lean path is the one answering, right, and gives back what it held ------------


@asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[tuple[int, object]]:
    """The app under uvicorn with our protocol, on a real socket of 127.0.0.1, in this process; (port, app)."""
    app = create_app(settings)
    config = uvicorn.Config(app, log_config=None, lifespan="on", proxy_headers=False, **uvicorn_options(settings))
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            async with asyncio.timeout(120):
                while not server.started or (await client.get("/v2/health/ready")).status_code != 200:
                    await asyncio.sleep(0.02)
        yield port, app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)
        sock.close()


@pytest.fixture
def taken(monkeypatch) -> list[bool]:
    """Whether the lean path took each request whose head it was offered."""
    offered: list[bool] = []
    admit = lean.LeanDoor.admit

    def recording(self, protocol, match):
        request = admit(self, protocol, match)
        offered.append(request is not None)
        return request

    monkeypatch.setattr(lean.LeanDoor, "admit", recording)
    return offered


async def test_the_lean_path_serves_plain_requests_right(taken) -> None:
    async with serving(Settings(max_batch_rows=64)) as (port, app):
        headers = {"accept-encoding": "identity"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers) as client:
            raw = await client.post(V1, content=x.tobytes(), headers=RAW)
            as_json = await client.post(V1, json={"inputs": x.tolist()})
            bad = await client.post(V1, content=x.tobytes()[:-4], headers=RAW)
            compressed = await client.post(V1, content=x.tobytes(), headers={**RAW, "accept-encoding": "gzip"})
            v2_headers, v2_body = _v2_binary(x, id="v2-1", parameters={"binary_data_output": True})
            v2 = await client.post(V2, content=v2_body, headers=v2_headers)
            v2_json = await client.post(V2, content=_v2(), headers=JSON)
            mc = _v2(parameters={"mc_passes": 4, "mc_seed": 3, "mc_dropout": 0.1})
            v2_mc = await client.post("/v2/models/demo/versions/1/infer", content=mc, headers=JSON)
            predicted = await client.post(PREDICT, json={"instances": x.tolist()})
            metrics = (await client.get("/metrics")).text
    assert taken == [True, True, True, False, True, True, True, True]  # the compressed answer is the full path's
    assert raw.status_code == 200 and raw.headers["x-shape"] == f"3,{D}" and raw.headers["x-dtype"] == "float32"
    assert_close(np.frombuffer(raw.content, np.float32).reshape(3, D), demo_reference(x))
    assert_close(np.asarray(as_json.json()["outputs"]), demo_reference(x))
    assert bad.status_code == 400 and bad.json()["error_type"] == "invalid_input"
    assert bad.json()["request_id"] == bad.headers["x-request-id"]
    assert compressed.status_code == 200 and compressed.headers["content-encoding"] == "gzip"
    header_length = int(v2.headers["inference-header-content-length"])
    header = orjson.loads(v2.content[:header_length])
    assert header["id"] == "v2-1" and header["outputs"][0]["parameters"]["binary_data_size"] == x.nbytes
    assert_close(np.frombuffer(v2.content[header_length:], np.float32).reshape(3, D), demo_reference(x))
    assert_close(np.asarray(v2_json.json()["outputs"][0]["data"]).reshape(3, D), demo_reference(x))
    answered = {output["name"]: output for output in v2_mc.json()["outputs"]}
    assert set(answered) == {"output", "output_std"} and v2_mc.json()["parameters"]["mc_passes"] == 4
    assert_close(np.asarray(predicted.json()["predictions"]), demo_reference(x))
    # Every request counted once, by outcome and by its whole time, as the full path counts them.
    assert 'ffn_requests_total{model="demo",outcome="ok",protocol="http"} 7.0' in metrics
    assert 'ffn_requests_total{model="demo",outcome="invalid_input",protocol="http"} 1.0' in metrics
    route = 'protocol="native",route="/v1/models/{name}/transform"'
    assert f'ffn_http_request_seconds_count{{{route},status="2xx"}} 3.0' in metrics
    assert f'ffn_http_request_seconds_count{{{route},status="4xx"}} 1.0' in metrics
    assert 'ffn_http_request_seconds_count{protocol="v2",route="/v2/models/{name}/infer",status="2xx"} 2.0' in metrics
    versioned = 'protocol="v2",route="/v2/models/{name}/versions/{version}/infer"'
    assert f'ffn_http_request_seconds_count{{{versioned},status="2xx"}} 1.0' in metrics
    predict = 'protocol="kserve_v1",route="/v1/models/{name}:predict"'
    assert f'ffn_http_request_seconds_count{{{predict},status="2xx"}} 1.0' in metrics
    assert app.state.service.held.held == 0


async def test_a_client_that_hangs_up_gives_back_what_it_held(taken) -> None:
    async with serving(Settings(max_batch_rows=64)) as (port, app):
        body = x.tobytes()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        head = http_request("POST", V1, RAW, body, close=False)
        writer.write(head[: len(head) - len(body) // 2])  # the head and half the body
        await writer.drain()
        state = app.state.service
        async with asyncio.timeout(30):
            while state.held.held != len(body):  # the declared length is held as soon as the head is in
                await asyncio.sleep(0.01)
        writer.close()
        async with asyncio.timeout(30):
            while state.held.held:
                await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            metrics = (await client.get("/metrics")).text
    assert taken == [True]
    assert 'ffn_requests_total{model="demo",outcome="client_closed_request",protocol="http"} 1.0' in metrics


async def test_pipelined_requests_are_answered_in_order(taken) -> None:
    """A request pipelined behind a lean one goes the full way, after it; both answered right."""
    async with serving(Settings(max_batch_rows=64)) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        one, two = x[:1], x[1:]
        writer.write(
            http_request("POST", V1, raw_headers((1, D)), one.tobytes(), close=False)
            + http_request("POST", V1, raw_headers((2, D)), two.tobytes())
        )
        await writer.drain()
        async with asyncio.timeout(30):
            data = await reader.read(-1)
        writer.close()
    first, _, rest = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and b"x-shape: 1,512" in first
    answer_one, second = rest[: one.nbytes], rest[one.nbytes :]
    head_two, _, answer_two = second.partition(b"\r\n\r\n")
    assert head_two.startswith(b"HTTP/1.1 200") and b"x-shape: 2,512" in head_two
    assert_close(np.frombuffer(answer_one, np.float32).reshape(1, D), demo_reference(one))
    assert_close(np.frombuffer(answer_two, np.float32).reshape(2, D), demo_reference(two))
    assert taken == [True]  # the second is not offered to the lean path: it waits behind the first


async def test_a_lean_body_in_any_cut_is_answered_right_and_the_next_request_read_right(taken) -> None:
    """A lean request's large body reaches it without the parser (protocol.py: _take_lean_body), as views
    of the reads or copies, whole or in pieces; the connection's next request is read by a fresh parser.
    A small body (the first) goes through the parser as before, on the same connection."""
    rng = np.random.default_rng(11)
    rows_past_parser = -(-BODY_PAST_PARSER_BYTES // (D * 4))  # the fewest float32 rows taken past the parser
    cases = [rng.standard_normal((rows, D)).astype(np.float32) for rows in (1, *[rows_past_parser + 3] * 3)]
    async with serving(Settings(max_batch_rows=64)) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for index, rows in enumerate(cases):
            message = http_request("POST", V1, raw_headers(rows.shape), rows.tobytes(), close=False)
            if index == 0:  # the head and the body in one write
                pieces = [message]
            elif index == 1:  # a few bytes at a time, the body cut inside its rows
                pieces = [message[at : at + 997] for at in range(0, len(message), 997)]
            elif index == 2:  # the head alone, then the body in two uneven parts
                head_end = message.index(b"\r\n\r\n") + 4
                pieces = [message[:head_end], message[head_end : head_end + 5], message[head_end + 5 :]]
            else:  # the body, then the next request's head in the same write
                pieces = [message + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"]
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.005)
            async with asyncio.timeout(30):
                answers.append(await read_response(reader))
        async with asyncio.timeout(30):
            live = await read_response(reader)
        writer.close()
    assert taken == [True, True, True, True]
    for rows, answer in zip(cases, answers, strict=True):
        assert answer.status == 200, answer.body[:200]
        assert_close(np.frombuffer(answer.body, np.float32).reshape(rows.shape), demo_reference(rows))
    assert live.status == 200
