"""Independent float64 numpy arithmetic to check the served models against (never the code under test).

The one reference FFN of the test suite: the formula written out in numpy, activations included,
so that a bug in ffn_core or torch cannot hide in both the answer and its check.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import numpy as np

from ffn_core import FeedForward

_erf = np.vectorize(math.erf, otypes=[np.float64])

ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda z: np.maximum(z, 0.0),
    "gelu": lambda z: 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0))),
    "gelu_tanh": lambda z: 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3))),
    "silu": lambda z: z / (1.0 + np.exp(-z)),
    "identity": lambda z: z,
}


def numpy_ffn(x: np.ndarray, params: Mapping[str, np.ndarray], activation: str = "relu") -> np.ndarray:
    """y = f(x W1ᵀ + b1) [⊙ (x Vᵀ + c)] W2ᵀ + b2 in float64, for any leading shape.

    `params` has the native names ([out, in] weights); a missing bias is zero, and the gate
    applies when `linear_v.weight` is there.
    """
    hidden = numpy_hidden(x, params, activation)  # (..., d_ff)
    w2, b2 = (np.asarray(params.get(key, 0.0), dtype=np.float64) for key in ("layer2.weight", "layer2.bias"))
    return hidden @ w2.T + b2  # (..., d_model)


def numpy_hidden(x: np.ndarray, params: Mapping[str, np.ndarray], activation: str = "relu") -> np.ndarray:
    """The hidden layer f(x W1ᵀ + b1) [⊙ (x Vᵀ + c)] in float64: what dropout acts on, (..., d_ff)."""
    x = np.asarray(x, dtype=np.float64)
    p = {key: np.asarray(value, dtype=np.float64) for key, value in params.items()}
    hidden = ACTIVATIONS[activation](x @ p["layer1.weight"].T + p.get("layer1.bias", 0.0))
    if "linear_v.weight" in p:
        hidden = hidden * (x @ p["linear_v.weight"].T + p.get("linear_v.bias", 0.0))
    return hidden


def numpy_weights(model: FeedForward) -> dict[str, np.ndarray]:
    """The module's parameters as float64 numpy arrays, by state-dict name."""
    return {k: v.detach().to("cpu").double().numpy() for k, v in model.state_dict().items()}


@functools.cache
def demo_weights() -> dict[str, np.ndarray]:
    """The built-in `demo` model's weights (fixed seed), as the server loads them."""
    from ffn_core import demo_ffn

    return numpy_weights(demo_ffn())


def demo_reference(x: np.ndarray) -> np.ndarray:
    """What the server's `demo` model (ReLU, d_model 512) must answer for `x`, in float64."""
    return numpy_ffn(x, demo_weights(), "relu")


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-5) -> None:
    """Largest error within `rtol` of the largest reference value (elementwise rtol breaks near 0)."""
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    error = np.abs(actual - expected).max()
    scale = np.abs(expected).max()
    assert error <= rtol * scale, f"max error {error:.3g} > {rtol:g} x {scale:.3g}"


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (round to nearest even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)
