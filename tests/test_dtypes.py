"""ffn_core/dtypes.py, the one table of dtypes, against torch's and numpy's own figures; read without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ffn_core.dtypes import BY_ARRAY, BY_NUMPY, BY_V2, DTYPES, dtype_named
from ffn_core.torch_dtypes import TORCH

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(DTYPES))
def test_each_row_agrees_with_torch_and_numpy(name):
    row = DTYPES[name]
    assert TORCH[name] is getattr(torch, name)
    assert row.itemsize == TORCH[name].itemsize == np.dtype(row.array).itemsize
    assert row.largest == torch.finfo(TORCH[name]).max
    if row.numpy is not None:
        assert np.dtype(row.numpy) == np.dtype(name) and row.numpy == row.array
    assert BY_ARRAY[np.empty(0, dtype=row.array).dtype.str] is row  # an array's dtype names its row
    assert BY_V2[row.v2] is row and dtype_named(f"torch.{name}") is row


def test_bfloat16_is_carried_as_uint16_and_has_no_numpy_dtype():
    row = DTYPES["bfloat16"]
    assert row.numpy is None and np.dtype(row.array) == np.uint16 and "<u2" not in BY_NUMPY
    # An array carries bfloat16 as its patterns: torch views them as bfloat16 without a copy.
    patterns = torch.tensor([1.0, -2.5, 2.0**100], dtype=torch.bfloat16).view(torch.uint16).numpy()
    assert patterns.dtype.str == row.array and patterns.tolist() == [0x3F80, 0xC020, 0x7180]
    assert torch.from_numpy(patterns).view(torch.bfloat16).tolist() == [1.0, -2.5, 2.0**100]


def test_the_table_is_read_without_importing_torch():
    # The doors read it in processes that never import torch; ffn_core's other names import it on first use.
    code = (
        "import sys\nfrom ffn_core.dtypes import DTYPES\nprint('torch' in sys.modules)\n"
        "from ffn_core import FFNConfig\nprint('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]
