"""Every decoder against generated input (hypothesis): a tensor, or a 4xx service error, never anything else.

Issue 11 asks for this of every decoder: any bytes, any JSON, any header value. Where a decoder
accepts, its tensor is checked against numpy reading the same values independently; where it
refuses, the error must be one the error table answers with a 4xx.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.errors import ServiceError
from app.protocol import fields, native
from app.protocol.admission import deadline_from
from app.protocol.errors import kind_of
from app.protocol.tensors import JsonBody, check_finite_output, read_json_body
from app.protocol.v2 import codec as v2

D = 4  # a small d_model, so that generated tensors are often valid
MAX_ROWS = 64
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----- strategies --------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=24,
)
finite32 = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_subnormal=False, width=32)


@st.composite
def tensors(draw: st.DrawFn) -> list[Any]:
    """Nested lists of numbers, mostly [rows, D] or [batch, seq, D], sometimes ragged or of the wrong width."""
    width = draw(st.sampled_from([D, D, D, D - 1, D + 1]))
    rows = draw(st.integers(0, 4))
    matrix = [draw(st.lists(finite32 | st.integers(-1000, 1000), min_size=width, max_size=width)) for _ in range(rows)]
    if draw(st.booleans()):
        return [matrix]
    if draw(st.integers(0, 9)) == 0 and matrix:
        matrix[-1] = matrix[-1][:-1]  # ragged
    return matrix


def dumps(value: object) -> bytes:
    """JSON text as any client could send it: big integers kept, NaN written as a literal."""
    return json.dumps(value).encode()


def refused_with_4xx(exc: BaseException) -> bool:
    return isinstance(exc, ServiceError) and 400 <= kind_of(exc).status < 500


def decode_or_4xx(decode: Any, *args: Any) -> Any:
    """decode(*args), or None when it refused with a 4xx service error; anything else fails the test."""
    try:
        return decode(*args)
    except Exception as exc:
        assert refused_with_4xx(exc), f"{type(exc).__name__}: {exc}"
        return None


def expected_rows(values: Any) -> np.ndarray:
    """What a valid tensor's rows must be, read by numpy on its own: float32, (rows, D)."""
    return np.asarray(values, dtype=np.float64).astype(np.float32).reshape(-1, D)


# ----- a JSON body read in two parts: the tensor's array apart from its envelope ---------------------

# Objects whose members are often named "data" (the V2 tensor's name), holding anything at all.
named_data = st.recursive(
    scalars | tensors(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["data", "data", "inputs", "x"]) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def restored(value: Any, parsed: JsonBody) -> Any:
    """The envelope with the tensor's array put back at its place (a "data" member holding [])."""
    if isinstance(value, dict):
        return {k: parsed.tensor(v) if k == "data" and v == [] else restored(v, parsed) for k, v in value.items()}
    if isinstance(value, list):
        return [restored(v, parsed) for v in value]
    return value


def data_arrays(value: Any) -> list[list[Any]]:
    """Every array held by a member named "data", anywhere in the document."""
    if isinstance(value, dict):
        held = [v for k, v in value.items() if k == "data" and isinstance(v, list)]
        return held + [a for v in value.values() for a in data_arrays(v)]
    if isinstance(value, list):
        return [a for v in value for a in data_arrays(v)]
    return []


def numbers_only(value: Any) -> bool:
    return isinstance(value, list) and all(numbers_only(v) or isinstance(v, (int, float)) for v in value)


@EXAMPLES
@given(named_data, st.sampled_from([None, 0, 2]))
def test_a_json_body_read_in_two_parts_is_the_document_or_a_4xx(document: Any, indent: int | None) -> None:
    """Whatever the document, the envelope with its tensor put back is what one parse of it all reads, or
    the body is refused 4xx; a document whose one "data" array holds numbers only is never refused."""
    body = json.dumps(document, indent=indent).encode()
    try:
        parsed = read_json_body(body, "data", MAX_ROWS, D)
        document_read = restored(parsed.envelope, parsed)
    except Exception as exc:
        assert refused_with_4xx(exc), f"{type(exc).__name__}: {exc}"
        arrays = data_arrays(document)
        assert len(arrays) > 1 or (arrays and not numbers_only(arrays[0])), f"{exc}: {body[:200]!r}"
        return
    assert document_read == orjson.loads(body)  # the parser the protocols use, on the whole body


# ----- native ------------------------------------------------------------------------------------


@EXAMPLES
@given(st.binary(max_size=256))
def test_native_json_any_bytes(body: bytes) -> None:
    decode_or_4xx(native.decode_json, bytearray(body), D, MAX_ROWS)


@EXAMPLES
@given(json_values | tensors(), st.booleans())
def test_native_json_any_document(inputs: Any, wrapped: bool) -> None:
    document = {"inputs": inputs} if wrapped else inputs
    decoded = decode_or_4xx(native.decode_json, bytearray(dumps(document)), D, MAX_ROWS)
    if decoded is not None:
        np.testing.assert_array_equal(decoded.rows, expected_rows(inputs))
        assert decoded.shape == np.asarray(inputs).shape


@EXAMPLES
@given(
    st.binary(max_size=64),
    st.text(max_size=12) | st.just("2,4"),
    st.text(max_size=12) | st.sampled_from(["float32", "float16", "bfloat16", "FLOAT16", " float32 "]),
)
def test_native_raw_any_bytes_and_headers(body: bytes, shape: str, dtype: str) -> None:
    decoded = decode_or_4xx(native.decode_raw, bytearray(body), shape, dtype, D)
    if decoded is not None:
        assert decoded.rows.shape == (math.prod(decoded.shape[:-1]), D)
        assert len(body) == decoded.rows.size * decoded.dtype.itemsize


def npy_file(header: str, data: bytes) -> bytes:
    text = header.encode("utf-8", "replace")
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


npy_literals = st.recursive(
    scalars | st.tuples(st.integers(-3, 5), st.integers(-3, 5)) | st.just("<f4"),
    lambda inner: (
        st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.sampled_from(["descr", "fortran_order", "shape", "x"]), inner, max_size=4)
    ),
    max_leaves=10,
)


@EXAMPLES
@given(npy_literals.map(repr) | st.text(max_size=40), st.binary(max_size=48))
def test_native_npy_any_header(header: str, data: bytes) -> None:
    decoded = decode_or_4xx(native.decode_npy, bytearray(npy_file(header, data)), D)
    if decoded is not None:
        assert decoded.rows.shape[1] == D


@EXAMPLES
@given(st.binary(max_size=128))
def test_native_npy_any_bytes(body: bytes) -> None:
    decode_or_4xx(native.decode_npy, bytearray(b"\x93NUMPY" + body), D)
    decode_or_4xx(native.decode_npy, bytearray(body), D)


@EXAMPLES
@given(st.text(max_size=40) | st.none(), st.text(max_size=20) | st.none(), st.text(max_size=60) | st.none())
def test_native_negotiation_any_headers(
    content_type: str | None, content_encoding: str | None, accept: str | None
) -> None:
    decode_or_4xx(native.request_encoding, content_type)
    decode_or_4xx(fields.request_coding, content_encoding)
    decode_or_4xx(native.response_encoding, accept)


# ----- Open Inference Protocol ------------------------------------------------------------------

valid_tensor = st.fixed_dictionaries(
    {
        "name": st.just("input"),
        "shape": st.just([1, D]),
        "datatype": st.sampled_from(["FP32", "FP16", "BF16"]),
        "data": st.lists(finite32, min_size=D, max_size=D),
    }
)


@st.composite
def v2_documents(draw: st.DrawFn) -> Any:
    """An infer request whose every field is either valid or any JSON value at all."""
    tensor = dict(draw(valid_tensor))
    for key in ("name", "shape", "datatype", "data", "parameters"):
        if draw(st.integers(0, 4)) == 0:
            tensor[key] = draw(json_values | tensors())
    document: dict[str, Any] = {"inputs": [tensor]}
    for key in ("id", "parameters", "outputs", "inputs"):
        if draw(st.integers(0, 5)) == 0:
            document[key] = draw(json_values)
    if draw(st.integers(0, 3)) == 0:
        document["parameters"] = {"binary_data_output": draw(json_values), "timeout": draw(json_values)}
    if draw(st.integers(0, 3)) == 0:
        document["outputs"] = [
            {
                "name": draw(st.sampled_from(["output", "x"]) | json_values),
                "parameters": draw(st.fixed_dictionaries({"binary_data": json_values}) | json_values),
            }
        ]
    return document


@EXAMPLES
@given(v2_documents())
def test_v2_any_document(document: Any) -> None:
    decoded = decode_or_4xx(v2.decode, bytearray(dumps(document)), None, D, MAX_ROWS)
    if decoded is not None:
        np.testing.assert_array_equal(decoded.rows, expected_rows(document["inputs"][0]["data"]))
        assert isinstance(decoded.binary_output, bool)
        assert decoded.timeout_us is None or (isinstance(decoded.timeout_us, float) and decoded.timeout_us >= 0)


@EXAMPLES
@given(st.binary(max_size=256), st.none() | st.text(max_size=8) | st.integers(0, 300).map(str))
def test_v2_any_bytes_and_header_length(body: bytes, header_length: str | None) -> None:
    decode_or_4xx(v2.decode, bytearray(body), header_length, D, MAX_ROWS)


@EXAMPLES
@given(st.integers(-4, 40), st.binary(max_size=40), st.sampled_from(["FP32", "FP16", "BF16", "FP64"]))
def test_v2_binary_any_sizes(declared: int, data: bytes, datatype: str) -> None:
    header = dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [len(data) // (4 * D) or 1, D],
                    "datatype": datatype,
                    "parameters": {"binary_data_size": declared},
                }
            ]
        }
    )
    decoded = decode_or_4xx(v2.decode, bytearray(header + data), str(len(header)), D, MAX_ROWS)
    if decoded is not None:
        assert declared == len(data) == decoded.rows.size * decoded.dtype.itemsize


# ----- headers and fields shared by both --------------------------------------------------------


@EXAMPLES
@given(st.text(max_size=24))
def test_numeric_headers_any_text(value: str) -> None:
    number = decode_or_4xx(fields.header_number, value, "X-Timeout-Ms")
    if number is not None:
        assert math.isfinite(number) and value.strip().isascii()
    integer = decode_or_4xx(fields.header_int, value, "Content-Length")
    if integer is not None:
        assert integer >= 0 and value.strip().isdigit()


@EXAMPLES
@given(st.text(max_size=24) | st.floats() | st.integers())
def test_deadlines_any_value(value: str | float) -> None:
    async def deadline() -> float | None:
        return decode_or_4xx(deadline_from, value, 1000.0)

    at = asyncio.run(deadline())
    if at is not None:
        assert math.isfinite(at)


@EXAMPLES
@given(json_values)
def test_typed_fields_any_value(value: Any) -> None:
    container = {"field": value}
    for read in (
        fields.str_field,
        fields.bool_field,
        fields.int_field,
        fields.number_field,
        fields.object_field,
        fields.list_field,
    ):
        decode_or_4xx(read, container, "field", "parameter")
    flag = decode_or_4xx(fields.bool_field, container, "field", "parameter")
    assert flag is None or value is flag


@EXAMPLES
@given(st.lists(st.floats(width=32), min_size=1, max_size=8))
def test_output_check_any_values(values: list[float]) -> None:
    import torch

    output = torch.tensor(values, dtype=torch.float32)
    finite = all(math.isfinite(v) for v in values)
    for tensor in (output, output.to(torch.bfloat16), output.to(torch.float16)):
        wide_enough = bool(torch.isfinite(tensor).all())
        # As the engine answers it: bfloat16 as its uint16 patterns (ffn_core/dtypes.py).
        array = (tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy()
        if finite and wide_enough:
            check_finite_output(array)
        else:
            with pytest.raises(ServiceError) as refused:
                check_finite_output(array)
            assert kind_of(refused.value).status == 422
