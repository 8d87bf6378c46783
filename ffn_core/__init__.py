"""ffn_core: the position-wise feed-forward network, its variants and its weight formats.

Plain PyTorch; knows nothing of HTTP. The names below are imported when first used (PEP 562), so
that `ffn_core.dtypes`, the one table of dtypes, can be read without importing torch: the doors
read it in processes that never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ffn_core.activations import ACTIVATIONS, get_activation
    from ffn_core.config import FFNConfig
    from ffn_core.digest import weights_digest
    from ffn_core.dropout import MonteCarloPasses, mc_dropout
    from ffn_core.model import (
        DEMO_CONFIG,
        FeedForward,
        FusedGatedFeedForward,
        GatedFeedForward,
        build_ffn,
        demo_ffn,
        fuse_gate,
    )
    from ffn_core.weights import FORMATS, WeightsError, load_ffn, save_ffn

# Each exported name and the module that defines it.
_HOMES = {
    "ACTIVATIONS": "activations",
    "get_activation": "activations",
    "FFNConfig": "config",
    "weights_digest": "digest",
    "MonteCarloPasses": "dropout",
    "mc_dropout": "dropout",
    "DEMO_CONFIG": "model",
    "FeedForward": "model",
    "FusedGatedFeedForward": "model",
    "GatedFeedForward": "model",
    "build_ffn": "model",
    "demo_ffn": "model",
    "fuse_gate": "model",
    "FORMATS": "weights",
    "WeightsError": "weights",
    "load_ffn": "weights",
    "save_ffn": "weights",
}

__all__ = [
    "ACTIVATIONS",
    "DEMO_CONFIG",
    "FORMATS",
    "FFNConfig",
    "FeedForward",
    "FusedGatedFeedForward",
    "GatedFeedForward",
    "MonteCarloPasses",
    "WeightsError",
    "build_ffn",
    "demo_ffn",
    "fuse_gate",
    "get_activation",
    "load_ffn",
    "mc_dropout",
    "save_ffn",
    "weights_digest",
]


def __getattr__(name: str) -> object:
    """An exported name, imported from its module on first use (then kept as this module's attribute)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ffn_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ffn_core.{home}"), name)
    globals()[name] = value
    return value
