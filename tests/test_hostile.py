"""Hostile input against a real `ffn-serve` process: each gets a clear 4xx with the JSON error
body {"error", "error_type", "request_id"} (that id also its X-Request-Id), nothing internal
leaks, and the server serves the next request.

Requests go out as raw bytes (asyncio streams) so that nothing normalises them on the way:
dot segments stay in paths, headers keep their size, chunked framing is ours. Slow, greedy and
flooding clients are in test_hostile_connections.py; every decoder meets generated input in
test_hostile_properties.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import numpy as np
import orjson
import pytest

from ffn_client.http1 import Response
from ffn_testing import ServerProcess, http_request, raw_request, start_server
from tests.reference import assert_close, demo_reference, demo_weights
from tests.wire import npy_bytes, raw_headers

D_MODEL = 512
KEY = "hostile-test-key-7f3a9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20
V1 = "/v1/models/demo/transform"
V2 = "/v2/models/demo/infer"
JSON = {"Content-Type": "application/json"}
ZEROS = ", ".join(["0.0"] * (D_MODEL - 1))  # the rest of a row after its first value


LAYOUTS = {"one process": {}, "a front and the engine": {"FFN_SHARED_ENGINE": "true", "FFN_WORKERS": "1"}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Every case against both layouts: one process, and a front with the engine process (issue 40)."""
    env = {"FFN_API_KEY": KEY, "FFN_MAX_BODY_BYTES": str(BODY_LIMIT), "FFN_WARMUP": "0", **LAYOUTS[request.param]}
    with start_server(env=env) as srv:
        yield srv


async def send(
    server: ServerProcess,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    *,
    auth: bool = True,
) -> Response:
    all_headers = {**(AUTH if auth else {}), **(headers or {})}
    # Keep-alive: an answer sent before the body was read must not be lost to a reset (see http_request).
    return await raw_request(server.port, http_request(method, path, all_headers, body, close=False))


def assert_error(r: Response, status: int, error_type: str | None = None) -> dict[str, str]:
    assert r.status == status, f"expected {status}, got {r.status}: {r.body[:300]!r}"
    assert r.headers.get("content-type", "").startswith("application/json")
    body = r.json()
    assert isinstance(body, dict) and set(body) - {"id"} == {"error", "error_type", "request_id"}, body
    assert body["request_id"] == r.headers.get("x-request-id"), (body, r.headers)  # one id, in both places
    assert isinstance(body["error"], str) and body["error"]
    if error_type is not None:
        assert body["error_type"] == error_type, body
    for leak in ("Traceback", 'File "', "/work/", "site-packages", ".py", "root:"):
        assert leak not in body["error"], f"error message leaks {leak!r}: {body['error']}"
    return body


@pytest.fixture(autouse=True)
async def still_serving(server: ServerProcess) -> AsyncIterator[None]:
    """After every hostile request: the process is alive and answers a valid request right."""
    yield
    assert server.proc.poll() is None, f"server died; log:\n{server.logs()}"
    x = np.linspace(-1, 1, 2 * D_MODEL, dtype=np.float32).reshape(2, D_MODEL)
    r = await send(server, "POST", V1, JSON, orjson.dumps({"inputs": x.tolist()}))
    assert r.status == 200, r.body[:300]
    np.testing.assert_allclose(np.asarray(r.json()["outputs"]), demo_reference(x), rtol=1e-4, atol=1e-4)


def row_json(first: str) -> bytes:
    return f'{{"inputs": [[{first}, {ZEROS}]]}}'.encode()


# ----- JSON ---------------------------------------------------------------------------------

JSON_CASES = {
    "nan": row_json("NaN"),
    "infinity": row_json("Infinity"),
    "minus-infinity": row_json("-Infinity"),
    "1e39-overflows-float32": row_json("1e39"),
    "1e400-overflows-float64": row_json("1e400"),
    "5000-digit-integer": row_json("1" * 5000),
    "nested-10000-deep": b'{"inputs": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",  # past orjson's 1024 levels
    "nested-1000-deep": b'{"inputs": ' + b"[" * 1000 + b"0.5" + b"]" * 1000 + b"}",
    "duplicate-keys": f'{{"inputs": [[1.0, {ZEROS}]], "inputs": [[2.0, {ZEROS}]]}}'.encode(),
    "ragged-rows": f'{{"inputs": [[1.0, {ZEROS}], [1.0]]}}'.encode(),
    "rank-1": f'{{"inputs": [1.0, {ZEROS}]}}'.encode(),
    "rank-4": f'{{"inputs": [[[[1.0, {ZEROS}]]]]}}'.encode(),
    "wrong-d_model": b'{"inputs": [[1.0, 2.0, 3.0]]}',
    "empty-inputs": b'{"inputs": []}',
    "empty-row": b'{"inputs": [[]]}',
    "strings": row_json('"1.0"'),
    "all-booleans": f'{{"inputs": [[{", ".join(["true"] * D_MODEL)}]]}}'.encode(),
    "null": row_json("null"),
    "object-in-row": row_json('{"a": 1}'),
    "inputs-not-a-list": b'{"inputs": "AAAA"}',
    "unknown-field": f'{{"inputs": [[1.0, {ZEROS}]], "extra": 1}}'.encode(),
    "top-level-array": b"[[1.0, 2.0]]",
    "not-json": b"this is not json",
    "truncated-json": b'{"inputs": [[1.0, 2.0',
    "invalid-utf8": b'{"inputs": "\xff\xfe"}',
    "empty-body": b"",
}


@pytest.mark.parametrize("body", JSON_CASES.values(), ids=JSON_CASES.keys())
async def test_hostile_json_is_400(server: ServerProcess, body: bytes) -> None:
    assert_error(await send(server, "POST", V1, JSON, body), 400, "invalid_input")


# ----- raw binary and .npy ------------------------------------------------------------------

ONE_ROW = np.ones((1, D_MODEL), dtype=np.float32).tobytes()
RAW_CASES = {
    "shape-product-overflows-int64": (raw_headers("4294967296,4294967296,512"), ONE_ROW),
    "shape-20-digits": (raw_headers("99999999999999999999,512"), ONE_ROW),
    "shape-dim-0": (raw_headers("0,512"), b""),
    "shape-dim-minus-1": (raw_headers("-1,512"), ONE_ROW),
    "shape-dim-1.5": (raw_headers("1.5,512"), ONE_ROW),
    "shape-empty": (raw_headers(""), ONE_ROW),
    "shape-trailing-comma": (raw_headers("1,512,"), ONE_ROW),
    "shape-superscript-digit": (raw_headers("\u00b2,512"), ONE_ROW),  # '²'.isdigit() is True, int('²') fails
    "shape-rank-4": (raw_headers("1,1,1,512"), ONE_ROW),
    "shape-10^12-elements-tiny-body": (raw_headers("1953125000,512"), ONE_ROW),
    "shape-missing": ({"Content-Type": "application/octet-stream"}, ONE_ROW),
    "body-shorter-than-shape": (raw_headers("2,512"), ONE_ROW),
    "body-longer-than-shape": (raw_headers("1,512"), ONE_ROW + b"\0\0\0\0"),
    "dtype-big-endian": (raw_headers("1,512", ">f4"), ONE_ROW),
    "dtype-float64": (raw_headers("1,512", "float64"), ONE_ROW * 2),
    "dtype-int8": (raw_headers("1,512", "int8"), ONE_ROW[:512]),
    "nan-in-raw": (raw_headers("1,512"), np.full((1, D_MODEL), np.nan, dtype=np.float32).tobytes()),
    "inf-in-float16": (raw_headers("1,512", "float16"), np.full((1, D_MODEL), np.inf, dtype=np.float16).tobytes()),
}

NPY = {"Content-Type": "application/x-npy"}
_good_npy = npy_bytes(np.ones((1, D_MODEL), dtype=np.float32))
NPY_CASES = {
    "big-endian": npy_bytes(np.ones((1, D_MODEL), dtype=">f4")),
    "object-dtype-pickle": npy_bytes(np.array([[object()] * D_MODEL], dtype=object), allow_pickle=True),
    "float64": npy_bytes(np.ones((1, D_MODEL), dtype=np.float64)),
    "fortran-order": npy_bytes(np.asfortranarray(np.ones((2, D_MODEL), dtype=np.float32))),
    "truncated-data": _good_npy[:-4],
    "truncated-header": _good_npy[:20],
    "not-npy": b"\x93NUMPX" + _good_npy[6:],
    "code-in-header": _good_npy.replace(b"'shape': (1, 512)", b"'shape': __import__('os').getpid()"),
    "huge-shape": _good_npy.replace(b"'shape': (1, 512), ", b"'shape': (10**12, 512),"),
    "nan": npy_bytes(np.full((1, D_MODEL), np.nan, dtype=np.float32)),
    "wrong-d_model": npy_bytes(np.ones((1, 7), dtype=np.float32)),
}


@pytest.mark.parametrize(("headers", "body"), RAW_CASES.values(), ids=RAW_CASES.keys())
async def test_hostile_raw_binary_is_400(server: ServerProcess, headers: dict[str, str], body: bytes) -> None:
    assert_error(await send(server, "POST", V1, headers, body), 400, "invalid_input")


@pytest.mark.parametrize("body", NPY_CASES.values(), ids=NPY_CASES.keys())
async def test_hostile_npy_is_400(server: ServerProcess, body: bytes) -> None:
    assert_error(await send(server, "POST", V1, NPY, body), 400, "invalid_input")


# ----- headers, framing, negotiation --------------------------------------------------------


@pytest.mark.parametrize("coding", ["br", "compress", "zstd", "gzip, deflate"])
async def test_a_content_coding_other_than_gzip_or_deflate_is_415(server: ServerProcess, coding: str) -> None:
    # gzip and deflate are read (tests/test_compression.py); any other coding is refused unread.
    body = b"\x0b\x02\x80 not a body this server can read"
    for path in (V1, V2, "/v1/models/demo:predict"):
        r = await send(server, "POST", path, {**JSON, "Content-Encoding": coding}, body)
        assert_error(r, 415, "unsupported_media_type")


@pytest.mark.parametrize("content_type", ["text/plain", "application/xml", "multipart/form-data; boundary=x"])
async def test_unsupported_content_type_is_415(server: ServerProcess, content_type: str) -> None:
    r = await send(server, "POST", V1, {"Content-Type": content_type}, row_json("1.0"))
    assert_error(r, 415, "unsupported_media_type")


@pytest.mark.parametrize("accept", ["text/html", "application/xml", "application/json;q=0, text/csv"])
async def test_unsupported_accept_is_406(server: ServerProcess, accept: str) -> None:
    r = await send(server, "POST", V1, {**JSON, "Accept": accept}, row_json("1.0"))
    assert_error(r, 406, "not_acceptable")


async def test_64kb_header_is_431(server: ServerProcess) -> None:
    r = await send(server, "POST", V1, {**JSON, "X-Padding": "a" * 65536}, row_json("1.0"))
    assert_error(r, 431)
    r = await send(server, "GET", "/v2/health/ready", {"X-Padding": "a" * 65536}, auth=False)
    assert_error(r, 431)


async def test_body_over_limit_sent_chunked_is_413(server: ServerProcess) -> None:
    chunk = b"[" + b"0.0," * 16383 + b"0.0],"  # 64 KiB of JSON numbers a chunk
    head = http_request("POST", V1, {**AUTH, **JSON, "Transfer-Encoding": "chunked"}, close=False)
    pieces = [head, b'%x\r\n{"inputs": [\r\n' % len(b'{"inputs": [')]
    pieces += [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (BODY_LIMIT // len(chunk) + 2)
    pieces.append(b"0\r\n\r\n")
    r = await raw_request(server.port, pieces)
    assert_error(r, 413, "payload_too_large")


async def test_declared_content_length_over_limit_is_413_before_reading(server: ServerProcess) -> None:
    head = http_request("POST", V1, {**AUTH, **JSON, "Content-Length": str(BODY_LIMIT + 1)}, close=False)
    r = await raw_request(server.port, head + b'{"inputs": ')  # the rest never comes
    assert_error(r, 413, "payload_too_large")


@pytest.mark.parametrize("timeout", ["abc", "0", "-5", "nan", "inf", "1e400", "3600001"])
async def test_bad_timeout_header_is_400(server: ServerProcess, timeout: str) -> None:
    r = await send(server, "POST", V1, {**JSON, "X-Timeout-Ms": timeout}, row_json("1.0"))
    assert_error(r, 400, "invalid_input")


async def test_wrong_method_is_405_json(server: ServerProcess) -> None:
    assert_error(await send(server, "GET", V1), 405)


# ----- model names --------------------------------------------------------------------------

TRAVERSALS = [
    ("POST", "/v1/models/..%2F..%2F..%2Fetc%2Fpasswd/transform"),
    ("POST", "/v1/models/../../../etc/passwd/transform"),
    ("POST", "/v1/models/%2E%2E/transform"),
    ("POST", "/v1/models/..%5C..%5Cwindows%5Cwin.ini/transform"),
    ("POST", "/v1/models/demo%00/transform"),
    ("POST", "/v1/models/%2Fetc%2Fpasswd/transform"),
    ("POST", "/v1/models/" + "a" * 4000 + "/transform"),
    ("GET", "/v2/models/..%2F..%2F..%2Fetc%2Fpasswd"),
    ("GET", "/v2/models/../../../etc/passwd"),
    ("GET", "/v2/models/..%2Fdemo/ready"),
    ("POST", "/v2/models/..%2F..%2Fetc%2Fpasswd/infer"),
    ("GET", "/v2/models/demo/versions/..%2F..%2Fetc%2Fpasswd"),
]


@pytest.mark.parametrize(("method", "path"), TRAVERSALS, ids=[f"{m} {p[:60]}" for m, p in TRAVERSALS])
async def test_path_traversal_model_names_are_404(server: ServerProcess, method: str, path: str) -> None:
    r = await send(
        server, method, path, JSON if method == "POST" else None, row_json("1.0") if method == "POST" else b""
    )
    body = assert_error(r, 404)
    assert body["error_type"] in ("model_not_found", "not_found")
    assert len(body["error"]) < 400  # a long name is cut, not echoed whole


# ----- API key ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer wrong-key",
        f"Bearer {KEY}x",
        f"Bearer {KEY[:-1]}",
        f"Basic {KEY}",
        KEY,
        f"Bearer  {KEY}",
    ],
)
async def test_missing_or_wrong_api_key_is_401(server: ServerProcess, authorization: str | None) -> None:
    headers = dict(JSON) if authorization is None else {**JSON, "Authorization": authorization}
    r = await send(server, "POST", V1, headers, row_json("1.0"), auth=False)
    assert_error(r, 401, "unauthorized")
    assert r.headers.get("www-authenticate") == "Bearer"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_bearer_scheme_is_case_insensitive(server: ServerProcess, scheme: str) -> None:
    r = await send(server, "POST", V1, {**JSON, "Authorization": f"{scheme} {KEY}"}, row_json("1.0"), auth=False)
    assert r.status == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/v2"),
        ("GET", "/v2/models/demo"),
        ("POST", "/v2/models/demo/ready"),  # a probe is a GET: any other method needs the key
        ("GET", "/v2/models/demo/ready/x"),
        ("POST", V2),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/v2/health/../../v1/models"),
        ("GET", "/v2/health/%2e%2e/%2e%2e/metrics"),
        ("POST", "/v1/models/demo:predict"),
        ("POST", "/v1/models/demo"),  # KServe V1's readiness is a GET too
        ("GET", "/v1/models/demo/x"),
    ],
)
async def test_every_route_but_health_needs_the_key(server: ServerProcess, method: str, path: str) -> None:
    r = await send(server, method, path, auth=False)
    assert r.status in (401, 404), r.status  # a dot-segment path under /v2/health/ matches no route
    assert_error(r, r.status)


@pytest.mark.parametrize(
    "path",
    [
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/demo/ready",
        "/v2/models/demo/versions/1/ready",
        "/",  # KServe V1's liveness
        "/v1/models/demo",  # KServe V1's readiness
    ],
)
async def test_probes_need_no_key(server: ServerProcess, path: str) -> None:
    """Server health and model readiness: what Kubernetes, KServe and tritonclient probe with, keyless."""
    assert (await send(server, "GET", path, auth=False)).status == 200
    assert (await send(server, "GET", path, {"Authorization": "Bearer wrong"}, auth=False)).status == 200


# ----- V2 -----------------------------------------------------------------------------------


def v2_json(**tensor: object) -> bytes:
    base: dict[str, object] = {"name": "input", "shape": [1, D_MODEL], "datatype": "FP32", "data": [0.5] * D_MODEL}
    base.update(tensor)
    return orjson.dumps({"inputs": [{k: v for k, v in base.items() if v is not None}]})


def v2_binary(
    size: int, data: bytes, *, header_length: int | None = None, datatype: str = "FP32", shape: list[int] | None = None
) -> tuple[dict[str, str], bytes]:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": shape or [1, D_MODEL],
                    "datatype": datatype,
                    "parameters": {"binary_data_size": size},
                }
            ]
        }
    )
    length = len(header) if header_length is None else header_length
    return ({"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(length)}, header + data)


V2_JSON_CASES = {
    "unknown-input-name": v2_json(name="x"),
    "unknown-datatype-fp64": v2_json(datatype="FP64"),
    "unknown-datatype-int8": v2_json(datatype="INT8"),
    "unknown-datatype-bytes": v2_json(datatype="BYTES"),
    "shape-mismatch": v2_json(shape=[2, D_MODEL]),
    "shape-negative": v2_json(shape=[-1, D_MODEL]),
    "shape-float": v2_json(shape=[1.5, D_MODEL]),
    "shape-bool": v2_json(shape=[True, D_MODEL]),
    "shape-10^12": v2_json(shape=[10**12, D_MODEL]),
    "shape-overflows-int64": v2_json(shape=[2**62, 2**62, D_MODEL]),
    "no-data": v2_json(data=None),
    "data-strings": v2_json(data=["a"] * D_MODEL),
    "data-nan": row_json("NaN")
    .replace(b'{"inputs": [[', b'{"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [')
    .replace(b"]]}", b"]}]}"),
    "two-inputs": orjson.dumps({"inputs": [orjson.loads(v2_json())["inputs"][0]] * 2}),
    "no-inputs": b'{"inputs": []}',
    "inputs-not-list": b'{"inputs": {"name": "input"}}',
    "unknown-output": orjson.dumps({**orjson.loads(v2_json()), "outputs": [{"name": "logits"}]}),
    "id-not-string": orjson.dumps({**orjson.loads(v2_json()), "id": 7}),
    "timeout-string": orjson.dumps({**orjson.loads(v2_json()), "parameters": {"timeout": "soon"}}),
    "timeout-negative": orjson.dumps({**orjson.loads(v2_json()), "parameters": {"timeout": -1}}),
    "parameters-not-object": orjson.dumps({**orjson.loads(v2_json()), "parameters": [1]}),
    "nested-10000-deep": b'{"inputs": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",  # past orjson's 1024 levels
    "binary-data-size-without-binary": v2_json(data=None, parameters={"binary_data_size": 2048}),
    "top-level-array": b"[]",
}


@pytest.mark.parametrize("body", V2_JSON_CASES.values(), ids=V2_JSON_CASES.keys())
async def test_hostile_v2_json_is_400(server: ServerProcess, body: bytes) -> None:
    assert_error(await send(server, "POST", V2, JSON, body), 400, "invalid_input")


V2_BINARY_CASES = {
    "binary-data-size-mismatch": v2_binary(100, ONE_ROW),
    "binary-data-size-negative": v2_binary(-1, ONE_ROW),
    "binary-section-shorter": v2_binary(len(ONE_ROW), ONE_ROW[:1000]),
    "binary-section-longer": v2_binary(len(ONE_ROW), ONE_ROW + b"\0" * 8),
    "header-length-beyond-body": v2_binary(len(ONE_ROW), ONE_ROW, header_length=10**9),
    "header-length-cuts-json": v2_binary(len(ONE_ROW), ONE_ROW, header_length=10),
    "header-length-zero": v2_binary(len(ONE_ROW), ONE_ROW, header_length=0),
    "unknown-datatype": v2_binary(len(ONE_ROW), ONE_ROW, datatype="UINT8"),
    "nan-in-binary": v2_binary(len(ONE_ROW), np.full((1, D_MODEL), np.nan, dtype=np.float32).tobytes()),
    "shape-10^12-tiny-binary": v2_binary(len(ONE_ROW), ONE_ROW, shape=[10**12, D_MODEL]),
}


@pytest.mark.parametrize(("headers", "body"), V2_BINARY_CASES.values(), ids=V2_BINARY_CASES.keys())
async def test_hostile_v2_binary_is_400(server: ServerProcess, headers: dict[str, str], body: bytes) -> None:
    assert_error(await send(server, "POST", V2, headers, body), 400, "invalid_input")


async def test_v2_header_length_not_a_number_is_400(server: ServerProcess) -> None:
    headers, body = v2_binary(len(ONE_ROW), ONE_ROW)
    headers["Inference-Header-Content-Length"] = "-1"
    assert_error(await send(server, "POST", V2, headers, body), 400, "invalid_input")


async def test_v2_unknown_model_and_version_are_404(server: ServerProcess) -> None:
    assert_error(await send(server, "POST", "/v2/models/nope/infer", JSON, v2_json()), 404, "model_not_found")
    assert_error(
        await send(server, "POST", "/v2/models/demo/versions/2/infer", JSON, v2_json()), 404, "model_not_found"
    )


# ----- exposure -----------------------------------------------------------------------------


async def test_no_cors_unless_configured(server: ServerProcess) -> None:
    origin = {"Origin": "http://evil.example"}
    preflight = await send(server, "OPTIONS", V1, {**origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    r = await send(server, "POST", V1, {**JSON, **origin}, row_json("1.0"))
    assert r.status == 200
    assert "access-control-allow-origin" not in r.headers


def test_binds_loopback_by_default() -> None:
    from app.config.settings import load_settings

    assert load_settings().host == "127.0.0.1"  # conftest cleared FFN_HOST and FFN_CONFIG


# ----- issue 11, classes 3 and 4: every field type-checked, tensors hold numbers only ----------

STRICT_JSON_CASES = {
    "boolean-among-numbers": row_json("true"),
    "false-among-numbers": row_json("false"),
    "integer-beyond-2^64": row_json("18446744073709551616"),
    "integer-below--2^63": row_json("-9223372036854775809"),
    "30-digit-integer": row_json("1" + "0" * 29),
    "nested-4-deep": b'{"inputs": [[[[0.5]]]]}',
    "rows-and-numbers-mixed": f'{{"inputs": [[1.0, {ZEROS}], 1.0]}}'.encode(),
}


@pytest.mark.parametrize("body", STRICT_JSON_CASES.values(), ids=STRICT_JSON_CASES.keys())
async def test_loosely_typed_tensor_json_is_400(server: ServerProcess, body: bytes) -> None:
    assert_error(await send(server, "POST", V1, JSON, body), 400, "invalid_input")


async def test_large_floats_written_as_floats_are_numbers(server: ServerProcess) -> None:
    # Not everything big is refused: 1e20 is a float literal that float32 holds.
    x = np.zeros((1, D_MODEL), dtype=np.float32)
    x[0, 0] = 1e20
    r = await send(server, "POST", V1, JSON, row_json("1e20"))
    assert r.status == 200, r.body[:200]
    assert_close(np.asarray(r.json()["outputs"]), demo_reference(x), rtol=1e-5)


def with_non_ascii(headers: dict[str, str], body: bytes, digits: str) -> bytes:
    """A request whose header value DIGITS is replaced by `digits` as UTF-8 bytes."""
    return http_request("POST", V1, {**AUTH, **headers}, body, close=False).replace(b"DIGITS", digits.encode())


@pytest.mark.parametrize("digits", ["\u00b2", "\u0661\u0662", "\uff11\uff12", "1_000", "0x10"])
async def test_numeric_headers_take_ascii_digits_only(server: ServerProcess, digits: str) -> None:
    r = await raw_request(server.port, with_non_ascii({**JSON, "X-Timeout-Ms": "DIGITS"}, row_json("1.0"), digits))
    assert_error(r, 400, "invalid_input")
    headers, body = v2_binary(len(ONE_ROW), ONE_ROW)
    data = http_request(
        "POST", V2, {**AUTH, **headers, "Inference-Header-Content-Length": "DIGITS"}, body, close=False
    ).replace(b"DIGITS", digits.encode())
    assert_error(await raw_request(server.port, data), 400, "invalid_input")
    r = await raw_request(server.port, with_non_ascii(raw_headers("DIGITS,512"), ONE_ROW, digits))
    assert_error(r, 400, "invalid_input")


def npy_with_header(header: str, data: bytes = ONE_ROW, version: bytes = b"\x01\x00") -> bytes:
    """An .npy file with `header` as its header text, written by hand (np.save would refuse these)."""
    text = header.encode("latin-1")
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY" + version + len(text).to_bytes(2, "little") + text + data


NPY_HEADER_CASES = {
    "unhashable-key": "{[1]: 2, 'descr': '<f4', 'fortran_order': False, 'shape': (1, 512)}",
    "set-as-descr": "{'descr': {'<f4'}, 'fortran_order': False, 'shape': (1, 512)}",
    "dict-as-descr": "{'descr': {'a': 1}, 'fortran_order': False, 'shape': (1, 512)}",
    "integer-keys": "{1: '<f4', 2: False, 3: (1, 512)}",
    "huge-integer-literal": "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 5000 + ", 512)}",
    "30-digit-dimension": "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 30 + ", 512)}",
    "boolean-dimension": "{'descr': '<f4', 'fortran_order': False, 'shape': (True, 512)}",
    "float-dimension": "{'descr': '<f4', 'fortran_order': False, 'shape': (1.0, 512)}",
    "shape-as-list": "{'descr': '<f4', 'fortran_order': False, 'shape': [1, 512]}",
    "fortran-order-string": "{'descr': '<f4', 'fortran_order': 'False', 'shape': (1, 512)}",
    "fortran-order-zero": "{'descr': '<f4', 'fortran_order': 0, 'shape': (1, 512)}",
    "header-a-list": "['<f4', False, (1, 512)]",
    "header-nested-deep": "(" * 5000 + ")" * 5000,
    "header-a-call": "{'descr': '<f4', 'fortran_order': False, 'shape': tuple([1, 512])}",
}


@pytest.mark.parametrize("header", NPY_HEADER_CASES.values(), ids=NPY_HEADER_CASES.keys())
async def test_npy_headers_are_type_checked(server: ServerProcess, header: str) -> None:
    assert_error(await send(server, "POST", V1, NPY, npy_with_header(header)), 400, "invalid_input")


async def test_npy_of_an_unknown_version_is_400(server: ServerProcess) -> None:
    body = npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 512)}", version=b"\x09\x00")
    assert_error(await send(server, "POST", V1, NPY, body), 400, "invalid_input")


def v2_with(**fields: object) -> bytes:
    """A valid V2 JSON infer request with top-level `fields` replaced (or added)."""
    return orjson.dumps({**orjson.loads(v2_json()), **fields})


V2_TYPE_CASES = {
    "datatype-list": v2_json(datatype=["FP32"]),
    "datatype-object": v2_json(datatype={"FP32": 1}),
    "datatype-number": v2_json(datatype=32),
    "name-list": v2_json(name=["input"]),
    "name-object": v2_json(name={"input": 1}),
    "shape-object": v2_json(shape={"0": 1}),
    "shape-string": v2_json(shape="1,512"),
    "input-parameters-list": v2_json(parameters=[1]),
    "binary-data-size-string": v2_json(data=None, parameters={"binary_data_size": "2048"}),
    "binary-data-size-float": v2_json(data=None, parameters={"binary_data_size": 2048.0}),
    "binary-data-size-bool": v2_json(data=None, parameters={"binary_data_size": True}),
    "data-booleans": v2_json(data=[True] + [0.5] * (D_MODEL - 1)),
    "data-integer-beyond-2^64": v2_json(data=None).replace(
        b'"datatype"', b'"data": [18446744073709551616' + b", 0" * (D_MODEL - 1) + b'], "datatype"'
    ),
    "data-object": v2_json(data={"a": 1}),
    "fp16-data-beyond-65504": v2_json(datatype="FP16", data=[70000.0] + [0.0] * (D_MODEL - 1)),
    "input-a-list": orjson.dumps({"inputs": [[1, 2]]}),
    "inputs-object": orjson.dumps({"inputs": {"0": orjson.loads(v2_json())["inputs"][0]}}),
    "id-object": v2_with(id={"a": 1}),
    "id-list": v2_with(id=["a"]),
    "parameters-string": v2_with(parameters="timeout=5"),
    "binary-data-output-string-false": v2_with(parameters={"binary_data_output": "false"}),
    "binary-data-output-string-true": v2_with(parameters={"binary_data_output": "true"}),
    "binary-data-output-zero": v2_with(parameters={"binary_data_output": 0}),
    "timeout-string-number": v2_with(parameters={"timeout": "1000"}),
    "timeout-boolean": v2_with(parameters={"timeout": True}),
    "timeout-list": v2_with(parameters={"timeout": [1000]}),
    "outputs-object": v2_with(outputs={"name": "output"}),
    "outputs-strings": v2_with(outputs=["output"]),
    "output-name-list": v2_with(outputs=[{"name": ["output"]}]),
    "output-parameters-list": v2_with(outputs=[{"name": "output", "parameters": [1]}]),
    "output-binary-data-string": v2_with(outputs=[{"name": "output", "parameters": {"binary_data": "false"}}]),
}


@pytest.mark.parametrize("body", V2_TYPE_CASES.values(), ids=V2_TYPE_CASES.keys())
async def test_v2_fields_of_the_wrong_type_are_400(server: ServerProcess, body: bytes) -> None:
    assert_error(await send(server, "POST", V2, JSON, body), 400, "invalid_input")


@pytest.mark.parametrize(
    ("parameters", "binary"),
    [({"binary_data_output": False}, False), ({"binary_data_output": True}, True), ({}, False)],
)
async def test_v2_binary_data_output_is_a_real_boolean(server: ServerProcess, parameters: dict, binary: bool) -> None:
    r = await send(server, "POST", V2, JSON, v2_with(parameters=parameters))
    assert r.status == 200, r.body[:200]
    assert (r.headers["content-type"] == "application/octet-stream") is binary


# ----- issue 11, class 5: an output that overflows is refused, never sent as inf or null ---------


def overflowing_row(scale: float, dtype: type) -> np.ndarray:
    """A finite row of +-`scale` aligned with the demo weights so that output 0 grows past `dtype`'s range."""
    weights = demo_weights()
    direction = weights["layer1.weight"].T @ weights["layer2.weight"][0]
    x = (scale * np.sign(direction)).astype(dtype).reshape(1, D_MODEL)
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isfinite(x).all() and not np.isfinite(demo_reference(x.astype(np.float64)).astype(dtype)).all()
    return x


async def test_an_overflowing_output_is_422(server: ServerProcess) -> None:
    x = overflowing_row(3e38, np.float32)
    r = await send(server, "POST", V1, JSON, orjson.dumps({"inputs": x.tolist()}))
    assert_error(r, 422, "non_finite_output")
    r = await send(server, "POST", V2, JSON, v2_json(data=x.ravel().tolist()))
    assert_error(r, 422, "non_finite_output")


async def test_an_overflowing_answer_batched_with_good_ones_harms_none_of_them(server: ServerProcess) -> None:
    """The answers' finiteness is checked once per batch: one request's overflow is refused alone."""
    bad = overflowing_row(3e38, np.float32)
    good = np.random.default_rng(7).standard_normal((15, D_MODEL)).astype(np.float32)
    for _ in range(3):  # sent together, so that they share batches
        answers = await asyncio.gather(
            send(server, "POST", V1, raw_headers("1,512", "float32"), bad.tobytes()),
            *(send(server, "POST", V1, raw_headers("1,512", "float32"), row.tobytes()) for row in good),
        )
        assert_error(answers[0], 422, "non_finite_output")
        for row, r in zip(good, answers[1:], strict=True):
            assert r.status == 200, r.body[:300]
            assert_close(np.frombuffer(r.body, np.float32).reshape(1, D_MODEL), demo_reference(row[None, :]))


async def test_an_output_that_overflows_float16_on_the_wire_is_422(server: ServerProcess) -> None:
    x = overflowing_row(65504, np.float16)
    r = await send(server, "POST", V1, raw_headers("1,512", "float16"), x.tobytes())
    assert_error(r, 422, "non_finite_output")
    headers, body = v2_binary(x.nbytes, x.tobytes(), datatype="FP16")
    assert_error(await send(server, "POST", V2, headers, body), 422, "non_finite_output")


# ----- issue 11, class 10: edges of the HTTP layer ----------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v2/health/live/", "/v2/health/ready/", "/v1/models/", "/v2/models/demo/", "/metrics/"]
)
async def test_trailing_slashes_are_not_redirected_with_the_clients_host(server: ServerProcess, path: str) -> None:
    r = await send(server, "GET", path, {"Host": "evil.example"})
    assert_error(r, 404)
    assert "location" not in r.headers
    assert not any("evil" in value for value in r.headers.values())


async def test_the_documented_v2_slash_form_answers_directly(server: ServerProcess) -> None:
    plain, slash = await send(server, "GET", "/v2"), await send(server, "GET", "/v2/")
    assert plain.status == slash.status == 200
    assert slash.json() == plain.json() and slash.json()["name"] == "ffn-serve"


@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate,chunked", "x-custom, chunked", "GZIP ,chunked"])
async def test_transfer_codings_other_than_chunked_are_refused(server: ServerProcess, coding: str) -> None:
    body = row_json("1.0")
    framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    r = await send(server, "POST", V1, {**JSON, "Transfer-Encoding": coding}, framed)
    assert_error(r, 501, "unsupported_transfer_encoding")
    assert r.headers.get("connection") == "close"


PARSER_REFUSALS = {
    "space-in-header-name": b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",
    "bad-method": b"G(T /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
    "nul-in-header-value": b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "bad-chunk-size": b"POST /v1/models/demo/transform HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "content-length-and-chunked": b"POST /v1/models/demo/transform HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "content-length-superscript": "POST /v1/models/demo/transform HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n"
    "\r\nab".encode("latin-1"),
    "two-content-lengths": b"POST /v1/models/demo/transform HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
    b"Content-Length: 2\r\n\r\nab",
    "chunked-twice": b"POST /v1/models/demo/transform HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n"
    b"\r\n0\r\n\r\n",
    "gzip-last": b"POST /v1/models/demo/transform HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
}


@pytest.mark.parametrize("data", PARSER_REFUSALS.values(), ids=PARSER_REFUSALS.keys())
async def test_requests_the_http_parser_refuses_get_the_json_error_body(server: ServerProcess, data: bytes) -> None:
    assert_error(await raw_request(server.port, data), 400, "invalid_input")


# Request lines with no version, or a version but HTTP/1.1 and 1.0: before, the first two were answered 200.
UNSERVED_VERSIONS = {
    "no-version": (b"GET /v2/health/live\r\n\r\n", 400),
    "http-2.0": (b"GET /v2/health/live HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    "http-1.2": (b"GET /v2/health/live HTTP/1.2\r\nHost: x\r\n\r\n", 505),
    "http-3.0": (b"GET /v2/health/live HTTP/3.0\r\nHost: x\r\n\r\n", 505),
    "lower-case": (b"GET /v2/health/live http/1.1\r\nHost: x\r\n\r\n", 400),
    "rtsp": (b"GET /v2/health/live RTSP/1.0\r\nHost: x\r\n\r\n", 400),
    "http-2-preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
}


@pytest.mark.parametrize(("data", "status"), UNSERVED_VERSIONS.values(), ids=UNSERVED_VERSIONS.keys())
async def test_request_lines_without_http_1_1_or_1_0_are_refused(
    server: ServerProcess, data: bytes, status: int
) -> None:
    r = await raw_request(server.port, data)
    assert_error(r, status, "invalid_input" if status == 400 else "http_version_not_supported")
    assert r.headers.get("connection") == "close"


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0"])
async def test_http_1_1_and_1_0_are_served(server: ServerProcess, version: str) -> None:
    r = await raw_request(server.port, f"GET /v2/health/live {version}\r\nHost: x\r\n\r\n".encode())
    assert r.status == 200 and r.json() == {"live": True}
