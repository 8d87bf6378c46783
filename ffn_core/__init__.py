"""ffn_core: the position-wise feed-forward network, its variants and its weight formats.

Plain PyTorch; knows nothing of HTTP.
"""

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
