"""Inputs and weight files shared by the weight-loading tests (test_weights, test_checkpoints)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as save_numpy

from ffn_core import FeedForward

D_MODEL, D_FF = 8, 24


def inputs(rows: int = 5, d_model: int = D_MODEL) -> np.ndarray:
    """Fixed float32 rows, scaled to reach into every activation's nonlinear range."""
    return np.random.default_rng(rows).normal(size=(rows, d_model)).astype(np.float32) * 2


def run(model: FeedForward, x: np.ndarray) -> np.ndarray:
    """The model's output on `x` (cast to the model's dtype), as float64 numpy."""
    with torch.inference_mode():
        return model(torch.from_numpy(x).to(model.layer1.weight.dtype)).double().numpy()


def write(state: dict[str, np.ndarray], path: Path) -> Path:
    """`state` as safetensors if `path` ends in .safetensors, else as a PyTorch state dict."""
    if path.suffix == ".safetensors":
        save_numpy(state, str(path))
    else:
        torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    return path
