"""app/protocol/tensors.py: all_finite, the check every input and every answer passes, against numpy's element-wise isfinite."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.protocol.tensors import all_finite

SPECIALS = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_every_special_value_anywhere_is_found(dtype, rows):
    base = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)).to(dtype)
    assert all_finite(base)
    for special in SPECIALS:
        for position in (0, rows * 4, rows * 8 - 1):
            x = base.clone().view(-1)
            x[position] = special
            assert not all_finite(x.view(rows, 8)), (special, position)


@pytest.mark.parametrize("value", [1e19, 3e38, -3.4e38, 1e-45])
def test_finite_values_near_the_limits_are_finite(value):
    """Values near float32's limits, whose squares or sums would overflow, are finite."""
    x = torch.full((4, 8), value, dtype=torch.float32)
    assert np.isfinite(x.numpy()).all()
    assert all_finite(x)
    x[2, 3] = np.nan
    assert not all_finite(x)


def test_an_empty_tensor_and_a_row_of_an_answer_are_checked_as_they_are():
    assert all_finite(torch.empty((0, 8)))
    answer = torch.arange(32, dtype=torch.float32).view(4, 8)
    answer[3, 0] = np.inf
    assert all_finite(answer[:3]) and not all_finite(answer[3:])  # views of one batch's output
