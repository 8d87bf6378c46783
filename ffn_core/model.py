"""The position-wise feed-forward network, plain and gated.

Plain:  y = f(x W1 + b1) W2 + b2
Gated:  y = (f(x W1 + b1) ⊗ (x V + c)) W2 + b2      (ReGLU, GEGLU, SwiGLU, bilinear)

Parameter names are the seeds' (`layer1`, `layer2`, `linear_v`), so a state dict saved from
that FeedForward module loads unchanged. Inputs may have any leading shape [..., d_model].
"""

from __future__ import annotations

import torch
from torch import nn

from ffn_core.activations import get_activation
from ffn_core.config import FFNConfig


class FeedForward(nn.Module):
    """y = f(x W1 + b1) W2 + b2. No dropout in `forward`: serving never pays for it."""

    def __init__(self, config: FFNConfig) -> None:
        super().__init__()
        self.config = config
        self.layer1 = nn.Linear(config.d_model, config.d_ff, bias=config.bias1)
        self.layer2 = nn.Linear(config.d_ff, config.d_model, bias=config.bias2)
        self.activation = get_activation(config.activation)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden layer, before dropout and the output projection: (..., d_ff)."""
        return self.activation(self.layer1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN of every row of `x`: (..., d_model) -> (..., d_model)."""
        return self.layer2(self.hidden(x))  # (..., d_model)


class GatedFeedForward(FeedForward):
    """y = (f(x W1 + b1) ⊗ (x V + c)) W2 + b2, the GLU family."""

    def __init__(self, config: FFNConfig) -> None:
        super().__init__(config)
        self.linear_v = nn.Linear(config.d_model, config.d_ff, bias=config.bias_gate)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The gated hidden layer, f(x W1 + b1) ⊗ (x V + c): (..., d_ff)."""
        return self.activation(self.layer1(x)) * self.linear_v(x)  # (..., d_ff)


def build_ffn(config: FFNConfig) -> FeedForward:
    """A freshly initialised FFN of the given config (PyTorch's default init), in eval mode."""
    module = GatedFeedForward(config) if config.gated else FeedForward(config)
    return module.eval()


DEMO_CONFIG = FFNConfig(d_model=512, d_ff=2048, activation="relu")


def demo_ffn(seed: int = 0) -> FeedForward:
    """The built-in `demo` model: the original Transformer's sizes, weights from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    model = build_ffn(DEMO_CONFIG)
    with torch.no_grad():
        for param in model.parameters():
            # Same scale as nn.Linear's default init, drawn from our own generator so the
            # weights are identical on every machine and torch version.
            bound = 1.0 / (param.shape[-1] ** 0.5) if param.ndim == 2 else 0.02
            param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=generator))
    return model.requires_grad_(False)
