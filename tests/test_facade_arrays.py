"""Arrays at the engine's facade: rows in and answers out as numpy arrays, in place, bfloat16 as its patterns.

The doors never import torch (tests/test_layers.py): they view a request's rows in its body
(app/protocol/tensors.py), the engine views them as a tensor (app/engine/registry.py:
rows_as_tensor) and answers an array carrying the dtype asked for (answer_as_array). Conversions
are checked against independent references: ml_dtypes' bfloat16 and float16 rounding for the
answers, torch's own for bfloat16's patterns read back as float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from app.config.settings import ModelSpec, Settings
from app.engine.registry import answer_as_array, rows_as_tensor
from app.protocol import tensors
from ffn_core.dtypes import BY_ARRAY, DTYPES

FLOAT32, FLOAT16, BFLOAT16 = DTYPES["float32"], DTYPES["float16"], DTYPES["bfloat16"]
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tricky_float32() -> np.ndarray:
    """Values whose rounding to 16 bits is easy to get wrong: ties both ways, subnormals, the limits, inf, zeros."""
    tie_even = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000, 0x3F807FFF, 0x3F808001], np.uint32)
    subnormals = np.array([1, 0x7FFF, 0x8000, 0x10000, 0x807FFFFF, 0x00400000, 0x007F8000], np.uint32)
    limits = np.array([0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0xFF7F8000, 0x00800000, 0x7F800000, 0xFF800000], np.uint32)
    zeros = np.array([0, 0x80000000], np.uint32)
    f16_limits = np.array([65504.0, 65519.99, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26], np.float32)
    rng = np.random.default_rng(7)
    random = np.concatenate(
        [rng.standard_normal(20_000), rng.standard_normal(20_000) * 1e30, rng.standard_normal(20_000) * 1e-30]
    ).astype(np.float32)
    bits = np.concatenate([tie_even, subnormals, limits, zeros, rng.integers(0, 2**32, 20_000, dtype=np.uint32)])
    values = np.concatenate([bits.view(np.float32), f16_limits, random])
    return values[~np.isnan(values)]  # NaN's patterns are not a rounding question: checked apart


# ----- answers: the engine's tensors as the arrays the doors encode ------------------------------------


def test_a_float32_answer_is_rounded_to_bfloat16_as_ml_dtypes_rounds_and_carried_as_its_patterns():
    x = tricky_float32()
    answer = answer_as_array(torch.from_numpy(x), BFLOAT16)
    assert answer.dtype == np.uint16 and BY_ARRAY[answer.dtype.str] is BFLOAT16
    np.testing.assert_array_equal(answer, x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_a_float32_answer_is_rounded_to_float16_as_numpy_rounds():
    x = tricky_float32()
    answer = answer_as_array(torch.from_numpy(x), FLOAT16)
    assert answer.dtype == np.float16
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(answer.view(np.uint16), x.astype(np.float16).view(np.uint16))


def test_nan_stays_nan_in_every_dtype():
    x = np.array([np.nan, -np.nan, 1.0], np.float32)
    for dtype in (FLOAT32, FLOAT16, BFLOAT16):
        answer = tensors.as_float32(answer_as_array(torch.from_numpy(x), dtype))
        assert np.isnan(answer[:2]).all() and answer[2] == 1.0
        assert not tensors.all_finite(answer_as_array(torch.from_numpy(x), dtype))


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_an_answer_already_in_its_dtype_is_the_batchs_own_memory(name):
    batch = torch.randn(6, 8).to(TORCH[name])
    rows = batch[2:5]  # a request's rows of its batch: a contiguous view
    answer = answer_as_array(rows, DTYPES[name])
    assert answer.ctypes.data == rows.data_ptr() and answer.shape == (3, 8)
    assert answer.dtype.str == DTYPES[name].array
    strided = answer_as_array(batch.t(), DTYPES[name])  # not contiguous: converted to a C-contiguous array
    assert strided.flags.c_contiguous and strided.shape == (8, 6)


def test_bfloat16_patterns_read_back_as_float32_exactly_as_torch_widens_them():
    """All 65,536 patterns, NaN payloads included: the JSON answer of a bfloat16 request."""
    patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    ours = tensors.as_float32(patterns)
    theirs = torch.from_numpy(patterns.view(np.int16)).view(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    half = np.random.default_rng(1).standard_normal(100).astype(np.float16)
    np.testing.assert_array_equal(tensors.as_float32(half), half.astype(np.float64).astype(np.float32))


def test_raw_bytes_are_the_arrays_own_memory_little_endian():
    x = np.arange(12, dtype="<f4").reshape(3, 4)
    raw = tensors.raw_bytes(x)
    assert bytes(raw) == x.tobytes() and len(raw) == 48
    assert np.frombuffer(raw, dtype=np.uint8).ctypes.data == x.ctypes.data
    patterns = answer_as_array(torch.tensor([1.0, -2.0]), BFLOAT16)
    assert bytes(tensors.raw_bytes(patterns)) == bytes([0x80, 0x3F, 0x00, 0xC0])  # 0x3F80, 0xC000


# ----- rows: a body's bytes as the engine's tensor ----------------------------------------------------


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_rows_are_viewed_in_the_body_and_reach_the_engine_in_place(name):
    x = torch.randn(3, 4).to(TORCH[name])
    carried = (x.view(torch.uint16) if name == "bfloat16" else x).numpy()
    body = bytearray(carried.tobytes())
    rows = tensors.view_rows(body, DTYPES[name], 3, 4)
    assert rows.dtype.str == DTYPES[name].array and rows.ctypes.data == np.frombuffer(body, np.uint8).ctypes.data
    tensor = rows_as_tensor(rows)
    assert tensor.dtype == TORCH[name] and tensor.data_ptr() == rows.ctypes.data
    assert torch.equal(tensor, x)


# ----- the facade: ServedModel.infer through a running app ---------------------------------------------


async def test_infer_answers_each_dtype_asked_for_from_each_dtype_sent(start_app):
    app = await start_app(Settings(models=[ModelSpec(name="demo")]))
    served = app.app.state.service.engine.model("demo")
    x = np.random.default_rng(2).standard_normal((4, served.d_model)).astype(np.float32) * 30
    plain = await served.infer(x, FLOAT32, deadline=None)
    assert plain.dtype == np.float32 and plain.shape == x.shape
    half = await served.infer(x, FLOAT16, deadline=None)
    np.testing.assert_array_equal(half.view(np.uint16), plain.astype(np.float16).view(np.uint16))
    brain = await served.infer(x, BFLOAT16, deadline=None)
    np.testing.assert_array_equal(brain, plain.astype(ml_dtypes.bfloat16).view(np.uint16))
    # bfloat16 rows in (their patterns), a float32 answer out: the float32 model computes on their values.
    patterns = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    from_patterns = await served.infer(patterns, FLOAT32, deadline=None)
    from_values = await served.infer(tensors.as_float32(patterns), FLOAT32, deadline=None)
    np.testing.assert_array_equal(from_patterns, from_values)
