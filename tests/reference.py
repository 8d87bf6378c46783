"""Independent float64 numpy arithmetic for the served models (never the code under test)."""

from __future__ import annotations

import numpy as np

from ffn_core import FeedForward


def numpy_weights(model: FeedForward) -> dict[str, np.ndarray]:
    """The module's parameters as float64 numpy arrays, by state-dict name."""
    return {k: v.detach().to("cpu").double().numpy() for k, v in model.state_dict().items()}


def relu_ffn(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """max(0, x W1ᵀ + b1) W2ᵀ + b2 in float64, for any leading shape."""
    x = np.asarray(x, dtype=np.float64)
    hidden = np.maximum(x @ w["layer1.weight"].T + w["layer1.bias"], 0.0)
    return hidden @ w["layer2.weight"].T + w["layer2.bias"]


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (round to nearest even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def bf16_bytes(x: np.ndarray) -> bytes:
    bits = np.ascontiguousarray(bf16_round(x)).view(np.uint32) >> 16
    return bits.astype("<u2").tobytes()


def from_bf16_bytes(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)
