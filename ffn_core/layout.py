"""The native layout of an FFN's weights: the keys and shapes a config has, and the strict check.

Native and torch state dicts (`weights`) and checkpoint families (`checkpoints`) are checked
against this layout, and they and the file readers (`readers`) report through `WeightsError`. So
both are here, below all three, which import this module and never each other in a circle;
`WeightsError` itself is ffn_core/errors.py's, where the modules that never import torch find it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from ffn_core.config import FFNConfig
from ffn_core.errors import WeightsError, brief

__all__ = ["FileWeights", "Shape", "WeightsError", "brief", "check_shapes", "config_from_keys", "expected_shapes"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class FileWeights:
    """An FFN as read from a file, before any dtype or device: checked keys and shapes."""

    config: FFNConfig
    tensors: dict[str, torch.Tensor]  # native key -> tensor as stored, in native orientation
    stored_keys: dict[str, str]  # native key -> the key the file holds it under, for messages


def expected_shapes(config: FFNConfig) -> dict[str, Shape]:
    """The native state dict of an FFN of this config: key -> shape."""
    d_model, d_ff = config.d_model, config.d_ff
    shapes: dict[str, Shape] = {"layer1.weight": (d_ff, d_model), "layer2.weight": (d_model, d_ff)}
    if config.bias1:
        shapes["layer1.bias"] = (d_ff,)
    if config.bias2:
        shapes["layer2.bias"] = (d_model,)
    if config.gated:
        shapes["linear_v.weight"] = (d_ff, d_model)
        if config.bias_gate:
            shapes["linear_v.bias"] = (d_ff,)
    return shapes


def check_shapes(path: Path, shapes: dict[str, Shape], expected: dict[str, Shape], why: str) -> None:
    """Raise naming the first expected key that is missing or has another shape than expected."""
    for key, shape in expected.items():
        if key not in shapes:
            raise WeightsError(f"{path}: missing key {key!r} (expected shape {list(shape)} {why})")
        if shapes[key] != shape:
            raise WeightsError(f"{path}: key {key!r} has shape {list(shapes[key])}, expected {list(shape)} {why}")


def config_from_keys(
    path: Path, *, d_model: int, d_ff: int, activation: str, gated: bool, present: Collection[str]
) -> FFNConfig:
    """The config of a file that does not describe itself: biases from which native keys it has."""
    try:
        return FFNConfig(
            d_model=d_model,
            d_ff=d_ff,
            activation=activation,
            gated=gated,
            bias1="layer1.bias" in present,
            bias2="layer2.bias" in present,
            bias_gate="linear_v.bias" in present if gated else True,
        )
    except ValueError as exc:  # sizes or activation the config refuses
        raise WeightsError(f"{path}: {exc}") from exc
