"""Request bodies and headers built by hand, independently of ffn_client's encoders.

Tests that talk to the server directly use these, so that a bug in the client's encodings
cannot hide in both a request and its check.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np
import orjson

from ffn_testing import http_request, raw_request
from tests.reference import assert_close, bf16_round, demo_reference

BINARY = "application/octet-stream"


def raw_headers(shape: str | Sequence[int], dtype: str = "float32", **extra: str) -> dict[str, str]:
    """Headers of a raw-binary /transform request that asks for a raw-binary answer.

    `shape` is X-Shape as numbers, or as the very string to send (hostile tests send bad ones).
    """
    x_shape = shape if isinstance(shape, str) else ",".join(map(str, shape))
    return {"content-type": BINARY, "accept": BINARY, "x-shape": x_shape, "x-dtype": dtype, **extra}


def npy_bytes(array: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    """`array` as an .npy file (what np.save writes)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def bf16_bytes(x: np.ndarray) -> bytes:
    """Little-endian bfloat16 bytes of `x`, rounded to nearest even."""
    bits = np.ascontiguousarray(bf16_round(x)).view(np.uint32) >> 16
    return bits.astype("<u2").tobytes()


def from_bf16_bytes(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of little-endian bfloat16 bytes (exact)."""
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


async def demo_answers_right(port: int, headers: Mapping[str, str]) -> None:
    """A valid JSON request of 3 rows to the demo model (with `headers`, the key), answered as the float64 reference says."""
    x = np.linspace(-1, 1, 3 * 512, dtype=np.float32).reshape(3, 512)
    body = orjson.dumps({"inputs": x.tolist()})
    request = http_request("POST", "/v1/models/demo/transform", {**headers, "Content-Type": "application/json"}, body)
    r = await raw_request(port, request)
    assert r.status == 200, r.body[:300]
    assert_close(np.asarray(r.json()["outputs"]), demo_reference(x))
