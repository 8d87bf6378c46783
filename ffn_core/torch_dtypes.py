"""The torch side of ffn_core/dtypes.py: each row's torch dtype.

Apart from the table, which imports no torch (the doors read it in processes that never do).
Torch names its dtypes as the table does, so the column is derived from the names.
"""

from __future__ import annotations

import torch

from ffn_core.dtypes import DTYPES

TORCH: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
