"""app/protocol/tensors.py: all_finite, the check every input and every answer passes, against torch's element-wise isfinite.

Arrays as the engine's facade carries them (ffn_core/dtypes.py): float32 and float16 in their own
dtype, bfloat16 as uint16 arrays of its bit patterns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.protocol.errors import NonFiniteOutput
from app.protocol.tensors import all_finite, check_finite_output

SPECIALS = [np.nan, np.inf, -np.inf]


def as_carried(tensor: torch.Tensor) -> np.ndarray:
    """The array that carries `tensor` across the facade: bfloat16 as its uint16 patterns."""
    return (tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_every_special_value_anywhere_is_found(dtype, rows):
    base = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)).to(dtype)
    assert all_finite(as_carried(base))
    for special in SPECIALS:
        for position in (0, rows * 4, rows * 8 - 1):
            x = base.clone().view(-1)
            x[position] = special
            assert not all_finite(as_carried(x.view(rows, 8))), (special, position)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_is_judged_as_torch_judges_it(dtype):
    """All 65,536 patterns, each alone: NaNs of every payload, both infinities, subnormals, both zeros."""
    patterns = torch.arange(2**16, dtype=torch.int32).to(torch.uint16).view(dtype)
    expected = torch.isfinite(patterns).tolist()
    mantissa_bits = 10 if dtype == torch.float16 else 7
    assert expected.count(False) == 2 * 2**mantissa_bits  # the exponent all ones: two signs, every mantissa
    found = [all_finite(as_carried(patterns[i : i + 1])) for i in range(2**16)]
    assert found == expected


@pytest.mark.parametrize("value", [1e19, 3e38, -3.4e38, 1e-45])
def test_finite_values_near_the_limits_are_finite(value):
    """Values near float32's limits, whose squares or sums would overflow, are finite."""
    x = np.full((4, 8), value, dtype=np.float32)
    assert np.isfinite(x).all()
    assert all_finite(x)
    x[2, 3] = np.nan
    assert not all_finite(x)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
def test_an_empty_array_and_a_row_of_an_answer_are_checked_as_they_are(dtype):
    assert all_finite(np.empty((0, 8), dtype=dtype))
    answer = torch.arange(32, dtype=torch.float32).view(4, 8)
    answer[3, 0] = np.inf
    carried = as_carried(answer.to({np.float32: torch.float32, np.float16: torch.float16}.get(dtype, torch.bfloat16)))
    assert all_finite(carried[:3]) and not all_finite(carried[3:])  # views of one batch's output


def test_an_answer_sliced_from_a_batch_is_refused_only_for_its_own_rows():
    """check_finite_output checks a batch's output once (its answers are slices of it): a slice of a
    batch whose other rows overflowed is still judged on its own rows, and no later batch is taken
    for one checked before."""
    finite = torch.arange(32, dtype=torch.float32).view(4, 8).numpy()
    for row in range(4):
        check_finite_output(finite[row : row + 1])  # the first checks the whole batch, the others find it checked
    overflowed = torch.arange(32, dtype=torch.float32).view(4, 8).numpy()
    overflowed[2, 5] = np.inf
    check_finite_output(overflowed[0:2])
    check_finite_output(overflowed[3:4])
    with pytest.raises(NonFiniteOutput):
        check_finite_output(overflowed[2:3])
    again = finite.copy()  # the same values in a new array, then one written non-finite: a new base
    again[1, 1] = np.nan
    check_finite_output(again[0:1])
    with pytest.raises(NonFiniteOutput):
        check_finite_output(again[1:2])
    with pytest.raises(NonFiniteOutput):
        check_finite_output(np.full((1, 8), -np.inf, dtype=np.float32))  # an array of its own
