"""Endpoints declared once: the fast path and FastAPI's own routes answer alike.

The same requests go to two apps, one with the fast path in front and one that leaves every
request to FastAPI's routing; status, content type, the headers that carry meaning and the
body must be equal. The fast path must really be the one answering in the first app.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import numpy as np
import orjson
import pytest
import pytest_asyncio
from starlette.middleware.errors import ServerErrorMiddleware

from app.config.settings import Settings
from app.http.endpoints import FastPath
from app.main import ENDPOINTS, create_app
from tests.in_process import serve_in_process

D = 512
x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _v2_binary(array: np.ndarray, path: str) -> tuple[str, str, bytes, dict[str, str]]:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(array.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": array.nbytes},
                }
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    )
    headers = {"inference-header-content-length": str(len(header)), "content-type": "application/octet-stream"}
    return "POST", path, header + array.tobytes(), headers


REQUESTS: dict[str, tuple[str, str, bytes, dict[str, str]]] = {
    "native json": (
        "POST",
        "/v1/models/demo/transform",
        orjson.dumps({"inputs": x.tolist()}),
        {"content-type": "application/json"},
    ),
    "native raw": (
        "POST",
        "/v1/models/demo/transform",
        x.tobytes(),
        {"content-type": "application/octet-stream", "x-shape": f"3,{D}", "accept": "application/octet-stream"},
    ),
    "native npy": (
        "POST",
        "/v1/models/demo/transform",
        _npy(x),
        {"content-type": "application/x-npy", "accept": "application/x-npy"},
    ),
    "native bad shape": ("POST", "/v1/models/demo/transform", orjson.dumps({"inputs": [[1.0, 2.0]]}), {}),
    "native unknown model": ("POST", "/v1/models/nope/transform", orjson.dumps({"inputs": x.tolist()}), {}),
    "native bad accept": (
        "POST",
        "/v1/models/demo/transform",
        orjson.dumps({"inputs": x.tolist()}),
        {"accept": "text/html"},
    ),
    "v2 json": (
        "POST",
        "/v2/models/demo/infer",
        orjson.dumps(
            {"id": "7", "inputs": [{"name": "input", "shape": [3, D], "datatype": "FP32", "data": x.ravel().tolist()}]}
        ),
        {},
    ),
    "v2 binary": _v2_binary(x, "/v2/models/demo/infer"),
    "v2 versioned": _v2_binary(x, "/v2/models/demo/versions/1/infer"),
    "v2 wrong version": _v2_binary(x, "/v2/models/demo/versions/2/infer"),
    "native monte carlo": (
        "POST",
        "/v1/models/demo/transform?mc_passes=3&mc_seed=1&mc_dropout=0.1",
        x.tobytes(),
        {"content-type": "application/octet-stream", "x-shape": f"3,{D}", "accept": "application/octet-stream"},
    ),
    "v2 monte carlo": (
        "POST",
        "/v2/models/demo/infer",
        orjson.dumps(
            {
                "inputs": [{"name": "input", "shape": [3, D], "datatype": "FP32", "data": x.ravel().tolist()}],
                "parameters": {"mc_passes": 3, "mc_seed": 1, "mc_dropout": 0.1},
            }
        ),
        {},
    ),
    "kserve v1": ("POST", "/v1/models/demo:predict", orjson.dumps({"instances": x.tolist()}), {}),
    "kserve v1 bad instances": ("POST", "/v1/models/demo:predict", orjson.dumps({"instances": [1.0, 2.0]}), {}),
    "kserve v1 unknown model": ("POST", "/v1/models/nope:predict", orjson.dumps({"inputs": x.tolist()}), {}),
    "native json gzip, answered deflate": (
        "POST",
        "/v1/models/demo/transform",
        gzip.compress(orjson.dumps({"inputs": x.tolist()})),
        {"content-type": "application/json", "content-encoding": "gzip", "accept-encoding": "deflate"},
    ),
    "v2 binary deflate, answered gzip": (
        *_v2_binary(x, "/v2/models/demo/infer")[:2],
        zlib.compress(_v2_binary(x, "/v2/models/demo/infer")[2]),
        {**_v2_binary(x, "/v2/models/demo/infer")[3], "content-encoding": "deflate", "accept-encoding": "gzip"},
    ),
    "kserve v1 gzip bomb": (
        "POST",
        "/v1/models/demo:predict",
        gzip.compress(bytes(8 << 20)),
        {"content-type": "application/json", "content-encoding": "gzip"},
    ),
    "v2 bad datatype": (
        "POST",
        "/v2/models/demo/infer",
        orjson.dumps({"inputs": [{"name": "input", "shape": [1, D], "datatype": "INT8", "data": [0] * D}]}),
        {},
    ),
}
COMPARED_HEADERS = (
    "content-type",
    "x-shape",
    "x-dtype",
    "inference-header-content-length",
    "retry-after",
    "x-mc-seed",
    "x-request-id",
    "content-encoding",
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def both() -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """The two apps, shared by the cases: each case sends both the same request, so that whatever
    one app has answered before, the other has too."""
    settings = Settings(max_batch_rows=64, max_body_bytes=4 << 20)  # the gzip bomb inflates past it
    async with AsyncExitStack() as stack:
        fast = await stack.enter_async_context(serve_in_process(settings))
        routed = await stack.enter_async_context(serve_in_process(settings, fast_path=False))
        assert any(m.cls is FastPath for m in fast.app.edge_middleware)
        assert not any(m.cls is FastPath for m in routed.app.edge_middleware)
        yield fast.client, routed.client


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", list(REQUESTS))
async def test_fast_path_and_fastapi_routes_answer_alike(both, case: str) -> None:
    fast, routed = both
    method, path, body, headers = REQUESTS[case]
    headers = {**(headers or {}), "X-Request-Id": "one-id-for-both"}  # else error bodies differ by their ids
    a = await fast.request(method, path, content=body, headers=headers)
    b = await routed.request(method, path, content=body, headers=headers)
    assert a.status_code == b.status_code, (a.text[:200], b.text[:200])
    assert {h: a.headers.get(h) for h in COMPARED_HEADERS} == {h: b.headers.get(h) for h in COMPARED_HEADERS}
    assert a.content == b.content


async def test_every_fast_endpoint_is_also_a_fastapi_route() -> None:
    app = create_app(Settings(), fast_path=False)
    routes = {(method, route.path) for route in app.routes for method in getattr(route, "methods", ())}
    for endpoint in ENDPOINTS:
        assert (endpoint.method, endpoint.path) in routes
    assert sum(endpoint.fast for endpoint in ENDPOINTS) == 4  # transform, infer, versioned infer, KServe V1 predict


async def test_the_fast_path_answers_in_front_of_fastapis_own_middleware(start_app, monkeypatch) -> None:
    """Tensor requests skip FastAPI's stack (Starlette's error middleware and the rest); other requests cross it."""
    crossed: list[str] = []
    original = ServerErrorMiddleware.__call__

    async def counting(self, scope, receive, send):
        crossed.append(scope.get("path", scope["type"]))
        await original(self, scope, receive, send)

    monkeypatch.setattr(ServerErrorMiddleware, "__call__", counting)
    client = (await start_app(Settings(max_batch_rows=8))).client
    crossed.clear()
    r = await client.post(
        "/v1/models/demo/transform",
        content=x.tobytes(),
        headers={"content-type": "application/octet-stream", "x-shape": f"3,{D}", "accept": "application/octet-stream"},
    )
    assert r.status_code == 200 and r.headers["x-shape"] == f"3,{D}"
    assert crossed == []
    assert (await client.get("/v1/models")).status_code == 200
    assert crossed == ["/v1/models"]
