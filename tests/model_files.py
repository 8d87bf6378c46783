"""Weight files that tests replace while a server serves them, and the numpy answers they must give."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ffn_core import FFNConfig, build_ffn, save_ffn
from tests.reference import numpy_ffn, numpy_weights


def write_ffn(path: Path, seed: int, *, d_model: int = 16, d_ff: int = 64) -> dict[str, np.ndarray]:
    """A ReLU FFN from `seed`, saved natively to `path` by replacing it in one step (as an operator
    would: write beside, then rename over); its weights as float64 numpy, for the reference."""
    torch.manual_seed(seed)
    model = build_ffn(FFNConfig(d_model=d_model, d_ff=d_ff, activation="relu"))
    beside = path.with_name(f".{path.name}.new")
    save_ffn(model, beside)
    os.replace(beside, path)
    return numpy_weights(model)


def answer(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """What a server serving `params` (ReLU) must answer for `x`, in float64."""
    return numpy_ffn(x, params, "relu")


def matches(y: np.ndarray, params: dict[str, np.ndarray], x: np.ndarray) -> bool:
    """`y` is the answer of `params` for `x`, to float32 tolerance."""
    expected = answer(params, x)
    return bool(np.abs(y - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max()))


def add_table(config: Path, name: str, weights: str) -> None:
    """Add a [[models]] table for `name` to the config file, once: a load serves only the models
    the configuration names (as Triton loads only what its repository holds)."""
    text = config.read_text()
    if f'name = "{name}"' not in text:
        config.write_text(f'{text}\n[[models]]\nname = "{name}"\nweights = "{weights}"\n')
