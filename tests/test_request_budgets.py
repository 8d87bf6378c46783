"""Per-request budgets (issue 20, classes 6, 7 and 15), in-process: bytes held, the JSON envelope, pre-checks.

The bytes a process's requests hold are observed at the moment a request reaches the batcher
(ServedModel.infer wrapped, the real one called) and once it is answered; numbers are checked
against the float64 reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import orjson
import pytest

from app.config.settings import Settings
from app.engine.service import ServedModel
from app.protocol.limits import MAX_JSON_OBJECTS, MAX_JSON_STRINGS
from ffn_core.dtypes import DType
from tests.in_process import InProcessApp
from tests.reference import assert_close, demo_reference

V1 = "/v1/models/demo/transform"
V2 = "/v2/models/demo/infer"
KSERVE_V1 = "/v1/models/demo:predict"
ROW = np.linspace(-1, 1, 512, dtype=np.float32).reshape(1, 512)
StartApp = Callable[..., Awaitable[InProcessApp]]


def v2_body(x: np.ndarray, **extra: object) -> bytes:
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}
    return orjson.dumps({"inputs": [tensor], **extra})


def held_when_queued(
    monkeypatch: pytest.MonkeyPatch, running: InProcessApp, gate: asyncio.Event | None = None
) -> list[int]:
    """Record the process's held bytes each time a request reaches the batcher; the first waits for `gate`, if given."""
    held = running.app.state.service.held
    seen: list[int] = []
    original = ServedModel.infer

    async def infer(self: ServedModel, rows: np.ndarray, answer_dtype: DType, *, deadline: float | None) -> np.ndarray:
        seen.append(held.held)
        if gate is not None and len(seen) == 1:
            await gate.wait()
        return await original(self, rows, answer_dtype, deadline=deadline)

    monkeypatch.setattr(ServedModel, "infer", infer)
    return seen


# ----- class 7: bytes held are the tensor's, not the body's, and bounded per process ---------------


async def test_a_json_body_is_dropped_once_parsed_and_its_tensor_held_until_answered(
    start_app: StartApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = await start_app(Settings(warmup=False))
    seen = held_when_queued(monkeypatch, running)
    padded = orjson.dumps({"inputs": ROW.tolist()}) + b" " * (4 << 20)  # 4 MiB of valid whitespace
    r = await running.client.post(V1, content=padded, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert_close(np.asarray(r.json()["outputs"]), demo_reference(ROW))
    r = await running.client.post(V2, content=v2_body(ROW) + b" " * (4 << 20))
    assert r.status_code == 200
    assert_close(np.asarray(r.json()["outputs"][0]["data"]).reshape(1, 512), demo_reference(ROW))
    padded = orjson.dumps({"instances": ROW.tolist()}) + b" " * (4 << 20)
    r = await running.client.post(KSERVE_V1, content=padded, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert_close(np.asarray(r.json()["predictions"]), demo_reference(ROW))
    assert seen == [512 * 4] * 3  # one float32 row each: the 4 MiB bodies were let go
    assert running.app.state.service.held.held == 0


async def test_a_binary_body_is_held_as_its_tensor_until_answered(
    start_app: StartApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = await start_app(Settings(warmup=False))
    seen = held_when_queued(monkeypatch, running)
    x = np.tile(ROW, (3, 1))
    r = await running.client.post(
        V1, content=x.tobytes(), headers={"content-type": "application/octet-stream", "x-shape": "3,512"}
    )
    assert r.status_code == 200
    assert_close(np.asarray(r.json()["outputs"]), demo_reference(x))
    assert seen == [x.nbytes]  # the tensor is a view of the body: the same bytes, counted once
    assert running.app.state.service.held.held == 0


async def test_past_the_held_budget_a_request_is_429_before_its_body_is_read(
    start_app: StartApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: admission counted rows only, so bodies in flight were bounded by nothing but the connection cap.
    running = await start_app(Settings(warmup=False, max_body_bytes=600_000, max_held_bytes=1_000_000))
    gate = asyncio.Event()
    seen = held_when_queued(monkeypatch, running, gate)
    big = np.tile(ROW, (256, 1))  # 512 KiB raw: held while it waits
    headers = {"content-type": "application/octet-stream", "x-shape": "256,512"}
    first = asyncio.ensure_future(running.client.post(V1, content=big.tobytes(), headers=headers))
    async with asyncio.timeout(30):
        while not seen:
            await asyncio.sleep(0.01)
    r = await running.client.post(V1, content=big.tobytes(), headers=headers)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error_type"] == "too_many_bytes_held"
    small = await running.client.post(V1, content=orjson.dumps({"inputs": ROW.tolist()}))  # fits beside it
    assert small.status_code == 200
    gate.set()
    answered = await first
    assert answered.status_code == 200
    assert_close(np.asarray(answered.json()["outputs"]), demo_reference(big))
    assert running.app.state.service.held.held == 0
    r = await running.client.post(V1, content=big.tobytes(), headers=headers)
    assert r.status_code == 200  # the budget is given back


def test_the_held_budget_must_fit_the_largest_body() -> None:
    from app.config.settings import load_settings
    from app.config.settings_problems import SettingsError

    with pytest.raises(SettingsError, match="max_held_bytes"):
        load_settings(max_body_bytes=2_000_000, max_held_bytes=1_000_000)
    # The fronts of a shared engine split the budget: each share must take the largest body.
    # Each front's request is held twice (its bytes, and its rows in the hand-off): a share is a 2 x workers part.
    with pytest.raises(SettingsError, match="split between 4 fronts and their hand-off memory"):
        load_settings(max_body_bytes=2_000_000, max_held_bytes=15_000_000, shared_engine=True, workers=4)
    shared = load_settings(max_body_bytes=2_000_000, max_held_bytes=16_000_000, shared_engine=True, workers=4)
    assert shared.held_bytes_per_process == 2_000_000
    whole = load_settings(max_body_bytes=2_000_000, max_held_bytes=16_000_000, workers=4)
    assert whole.held_bytes_per_process == 16_000_000  # workers that are whole processes: each its own


# ----- class 6: the envelope around the tensor is bounded before parsing -----------------------------


async def test_a_v2_body_of_parameter_keys_is_refused_on_counts(start_app: StartApp) -> None:
    running = await start_app(Settings(warmup=False))
    keys = {f"k{i}": 1 for i in range(MAX_JSON_STRINGS)}  # 16,384 keys, 180 KB: past the envelope's bytes
    r = await running.client.post(V2, content=v2_body(ROW, parameters=keys))
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"
    assert "more than 65536 bytes besides its tensor data" in r.json()["error"]
    # Within the envelope's 64 KiB, its strings and objects are counted too (issue 28 class 6).
    strings = {"": [""] * MAX_JSON_STRINGS}  # 16,385 strings in 49 KB
    r = await running.client.post(V2, content=v2_body(ROW, extra=strings))
    assert r.status_code == 413 and "strings" in r.json()["error"], r.text
    objects = [{}] * (MAX_JSON_OBJECTS + 1)
    r = await running.client.post(V2, content=v2_body(ROW, extra=objects))
    assert r.status_code == 413 and "objects" in r.json()["error"], r.text


async def test_an_envelope_a_request_needs_is_read(start_app: StartApp) -> None:
    running = await start_app(Settings(warmup=False))
    parameters = {f"tag{i}": f"value {i}" for i in range(1000)}  # 2,000 strings: a generous envelope
    r = await running.client.post(V2, content=v2_body(ROW, id="req-1", parameters=parameters))
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "req-1"
    assert_close(np.asarray(r.json()["outputs"][0]["data"]).reshape(1, 512), demo_reference(ROW))


# ----- class 15: the pre-checks do not refuse valid requests -------------------------------------------


@pytest.mark.parametrize("request_id", ["[[[[", "[[[[[[[[[[]]]]", "12345678901234567890123", "[1e999, NaN]"])
async def test_an_id_that_looks_like_structure_or_numbers_is_only_an_id(start_app: StartApp, request_id: str) -> None:
    # Before: "[[[[" in a string was read as nesting deeper than a tensor (400).
    running = await start_app(Settings(warmup=False))
    x = ROW.copy()
    x[0, 0] = 1e20  # a value past 2**63: the 64-bit check looks at the text, which holds a long digit run
    r = await running.client.post(V2, content=v2_body(x, id=request_id))
    assert r.status_code == 200, r.text
    assert r.json()["id"] == request_id
    assert_close(np.asarray(r.json()["outputs"][0]["data"]).reshape(1, 512), demo_reference(x))


@pytest.mark.parametrize("value", [2**63 - 1, 2**64 - 1, -(2**63)])
async def test_integers_that_fit_in_64_bits_are_numbers(start_app: StartApp, value: int) -> None:
    # Before: 2**63 - 1 (and any 19-digit integer beside a value past 2**63) was refused as beyond 64 bits.
    running = await start_app(Settings(warmup=False))
    body = b'{"inputs": [[%d, 0.5%s]]}' % (value, b", 0.25" * 510)
    r = await running.client.post(V1, content=body)
    assert r.status_code == 200, r.text
    x = np.array([[float(np.float32(value)), 0.5] + [0.25] * 510])
    assert_close(np.asarray(r.json()["outputs"]), demo_reference(x), rtol=1e-4)


@pytest.mark.parametrize("literal", ["18446744073709551616", "-9223372036854775809", "1" + "0" * 29])
async def test_integers_beyond_64_bits_are_still_refused(start_app: StartApp, literal: str) -> None:
    running = await start_app(Settings(warmup=False))
    body = b'{"inputs": [[%s, 0.5%s]]}' % (literal.encode(), b", 0.25" * 510)
    r = await running.client.post(V1, content=body)
    assert r.status_code == 400 and "beyond 64 bits" in r.json()["error"]
